"""What every section of the configuration shares: the error a bad key raises, the strict base
class (unknown keys refused, assignments validated), and Ray's resource check."""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict

from cadence.errors import ConfigError

__all__ = ["RAY_BUILTIN_RESOURCES", "ConfigError", "Section", "changed", "check_custom_resources"]


class Section(BaseModel):
    """A section: unknown keys refused, assignments validated, and each field described by the
    docstring under it (what docs/config.md shows)."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )


# Ray's own resources, which have keys of their own (num_cpus_per_worker, num_gpus_per_rank...)
RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def check_custom_resources(key: str, resources: dict[str, float]) -> None:
    """Custom Ray resources: a name Ray does not own, an amount above 0."""
    for name, amount in resources.items():
        if name in RAY_BUILTIN_RESOURCES or name.startswith("node:"):
            raise ValueError(
                f"{key}.{name} is a resource Ray defines itself: CPUs and GPUs have keys of their "
                "own (num_cpus_per_*, num_gpus_per_*); name a custom resource of your nodes"
            )
        if not amount > 0:
            raise ValueError(f"{key}.{name} = {amount}: a resource amount must be above 0")


def changed(section: BaseModel, keys: Iterable[str]) -> list[str]:
    """The `keys` of `section` whose value differs from their default: the keys a config sets
    (compared with the defaults, not by what was written: a written-out config sets every key)."""
    fields = type(section).model_fields
    return [
        k for k in keys if getattr(section, k) != fields[k].get_default(call_default_factory=True)
    ]
