"""Reading and writing the configuration: TOML files, dotted `--set` overrides, and the resolved
config as TOML (written to every run directory)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from cadence.config.base import ConfigError
from cadence.config.root import Config


def _format_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(root)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"config key '{key}': {msg}")
    return "\n".join(lines)


def _parse_value(raw: str) -> Any:
    """A TOML literal (number, bool, quoted string, list) or else the raw string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=c` overrides to a nested dict (in place) and return it."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override '{item}' is not of the form section.key=value")
        *parents, leaf = key.strip().split(".")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config key '{key}': '{p}' is not a section")
        node[leaf] = _parse_value(raw.strip())
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a TOML file (or the defaults), apply overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file '{p}' is not valid TOML: {e}") from e
    apply_overrides(data, overrides or [])
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (written to every run directory)."""
    out: list[str] = []
    for section, values in cfg.model_dump(exclude_none=True).items():
        _toml_table(section, values, out)
    return "\n".join(out)


def _toml_table(name: str, values: dict[str, Any], out: list[str]) -> None:
    """`[name]` with its plain keys, then each nested table as `[name.key]`."""
    out.append(f"[{name}]")
    plain = (k for k, v in values.items() if not isinstance(v, dict))
    out.extend(f"{_toml_key(k)} = {toml_value(values[k])}" for k in plain)
    out.append("")
    for k, v in values.items():
        if isinstance(v, dict):
            _toml_table(f"{name}.{_toml_key(k)}", v, out)


def _toml_key(key: str) -> str:
    """A bare key where TOML allows one, else a quoted one (a Ray resource such as
    'accelerator_type:A100')."""
    if key and all(c.isascii() and (c.isalnum() or c in "_-") for c in key):
        return key
    return json.dumps(key)


def toml_value(v: Any) -> str:
    """`v` written as TOML (a dict as an inline table)."""
    if isinstance(v, dict):  # a sub-table (model.lora), inline
        if not v:
            return "{}"
        return "{ " + ", ".join(f"{_toml_key(k)} = {toml_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return json.dumps(str(v))  # a JSON string is a valid TOML basic string
