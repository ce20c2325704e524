"""reasoning-gym's procedural tasks as a cadence task: a weighted mix of its datasets.

`ReasoningGymTask` builds reasoning-gym's `CompositeDataset` twice: `size` training rows drawn
with `seed`, and `num_heldout` held-out rows drawn with a seed of their own, hashed from
`heldout_seed`. The hash matters: reasoning-gym seeds row i of a dataset with `seed + i` (and
the k-th dataset of a mix with `seed + k + 1`), so two mixes whose seeds are close share their
rows shifted by the difference (seeds 1 and 2, as its own TRL example draws train and validation,
share all rows but one). Any training row whose question is held out is dropped all the same, so
held-out questions never reach training, whatever the seeds.

Read on: docs/data.md.
"""

from __future__ import annotations

import difflib
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from cadence.data.base import (
    DataError,
    Example,
    ListedTask,
    stable_seed,
)

INSTALL_HINT = "pip install 'cadence[reasoning-gym]'"
KEY = "data.reasoning_gym.datasets"
RESERVED = ("seed", "size")  # the table sets them: a dataset's own seed would hold out nothing
_SEEDS = 2**31  # some generators seed numpy, which takes seeds below 2**32 only


@dataclass(frozen=True)
class DatasetChoice:
    """One dataset of the mix: its registered name, its weight, its config's keyword arguments."""

    name: str
    weight: float = 1.0
    config: dict[str, Any] = field(default_factory=dict)


def import_reasoning_gym():
    """The `reasoning_gym` package, or a `DataError` saying how to install it."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise DataError(
            f"data.task = 'reasoning_gym' needs reasoning-gym, which is not installed ({e}): "
            f"{INSTALL_HINT}"
        ) from None
    return reasoning_gym


def check_datasets(choices: Sequence[DatasetChoice]) -> None:
    """Build each dataset once with its config, so that a bad name, key or value fails here."""
    rg = import_reasoning_gym()
    registry = rg.factory.DATASETS  # name -> (dataset class, config dataclass)
    if not choices:
        raise DataError(f"{KEY} is empty: name at least one reasoning-gym dataset")
    for c in choices:
        if c.name not in registry or c.name == "composite":
            near = difflib.get_close_matches(c.name, list(registry), n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            raise DataError(
                f"{KEY}: reasoning-gym has no dataset {c.name!r}{hint} (its "
                f"{len(registry) - 1} datasets: reasoning_gym.factory.DATASETS)"
            )
        if c.weight <= 0:
            raise DataError(f"{KEY}.{c.name}.weight must be > 0, got {c.weight}")
        known = [f.name for f in fields(registry[c.name][1]) if f.name not in RESERVED]
        for key in c.config:
            if key in RESERVED:
                raise DataError(
                    f"{KEY}.{c.name}.config.{key}: set by data.reasoning_gym.{key} for every "
                    "dataset (a dataset's own seed would hold out rows that training also "
                    "draws): leave it out"
                )
            if key not in known:
                raise DataError(
                    f"{KEY}.{c.name}.config: {c.name} has no key {key!r}; its keys: "
                    f"{', '.join(known)}"
                )
        try:
            rg.create_dataset(c.name, **c.config, seed=0, size=1)[0]
        except Exception as e:  # its config's validate() asserts; generators raise anything
            raise DataError(
                f"{KEY}.{c.name}.config {c.config}: {c.name} refuses it: {type(e).__name__}: {e}"
            ) from None


def system_prompt(developer_prompt: str | None) -> str | None:
    """The system message: a name in reasoning-gym's `SYSTEM_PROMPTS` gives its text; any other
    string is the text itself."""
    if developer_prompt is None:
        return None
    import_reasoning_gym()
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS.get(developer_prompt, developer_prompt)


CONFIG_KEY = "cadence_dataset_config"  # a row's metadata: its dataset's configured settings


def heldout_mix_seed(heldout_seed: int) -> int:
    """The held-out mix's seed: hashed, so no small training seed lies within a mix's size."""
    return stable_seed(f"reasoning_gym:heldout:{heldout_seed}") % _SEEDS


def draw_rows(choices: Sequence[DatasetChoice], size: int, seed: int) -> list[dict[str, Any]]:
    """Rows 0..size-1 of the weighted mix drawn with `seed` (reasoning-gym's own sampling)."""
    import_reasoning_gym()
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

    specs = [DatasetSpec(c.name, c.weight, dict(c.config)) for c in choices]
    mix = CompositeDataset(CompositeConfig(size=size, seed=seed, datasets=specs))
    configs = {c.name: dict(c.config) for c in choices}
    rows = [mix[i] for i in range(size)]
    for row in rows:  # what the grader needs to be the configured dataset's (rewards/)
        row["metadata"][CONFIG_KEY] = configs[row["metadata"]["source_dataset"]]
    return rows


def to_example(row: dict[str, Any], system: str | None = None) -> Example:
    """A row as an `Example`, labelled with its dataset; its metadata must pickle (it travels to
    worker processes with the prompt)."""
    metadata = row["metadata"]
    name = metadata["source_dataset"]
    try:
        pickle.dumps(metadata)
    except Exception as e:
        raise DataError(
            f"{KEY}.{name}: a row's metadata cannot be pickled to the rollout workers "
            f"({type(e).__name__}: {e})"
        ) from None
    question = row["question"]
    answer = row["answer"]
    return Example(
        question=question,
        answer="" if answer is None else str(answer),
        messages=(("system", system), ("user", question)) if system is not None else (),
        task=name,
        metadata=metadata,
    )


class ReasoningGymTask(ListedTask):
    """A weighted mix of reasoning-gym datasets, with the same interface as `ArithmeticTask`.

    `size` training rows are drawn with `seed`; `train_iter` visits each once per epoch in an
    order shuffled by (seed, epoch). The held-out set is the distinct questions among
    `num_heldout` rows drawn with a seed hashed from `heldout_seed`; training rows that repeat
    one of them are dropped (`num_overlap` counts them). See the module docstring.
    """

    num_skipped = 0  # generated, never read from a file: nothing is ever malformed

    def __init__(
        self,
        datasets: Sequence[DatasetChoice],
        size: int = 1000,
        seed: int = 0,
        num_heldout: int = 200,
        heldout_seed: int = 0,
        developer_prompt: str | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if num_heldout < 0:
            raise ValueError(f"num_heldout must be >= 0, got {num_heldout}")
        check_datasets(datasets)
        self.seed = seed
        self.names = tuple(c.name for c in datasets)
        system = system_prompt(developer_prompt)
        held: dict[str, Example] = {}
        if num_heldout:
            for row in draw_rows(datasets, num_heldout, heldout_mix_seed(heldout_seed)):
                held.setdefault(row["question"], to_example(row, system))
        rows = draw_rows(datasets, size, seed)
        self._train = [to_example(r, system) for r in rows if r["question"] not in held]
        self.num_overlap = len(rows) - len(self._train)
        if not self._train:
            raise DataError(
                f"every one of the {size} training rows of data.reasoning_gym is also held out: "
                "raise data.reasoning_gym.size, lower data.num_heldout, or widen the datasets' "
                "configs"
            )
        self._heldout = list(held.values())
