"""The configuration reference, docs/config.md, written from the config's own field descriptions.

Run `python -m cadence.config.doc` from the repository root after adding or changing a config
field; `tests/test_config_doc.py` fails while the page and this output differ, so the reference
cannot drift from the code. Everything here is read from the pydantic models of `config/`
(section by section: key, type, default, allowed values, description); nothing is written by
hand, and nothing of cadence but the config is imported, so the page says what validation
enforces and this module must never grow a second description of a key.
"""

from __future__ import annotations

import argparse
import re
import sys
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt, MinLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from cadence.config import Config, ConfigError, load_config
from cadence.config.files import toml_value

DEFAULT_OUT = Path("docs/config.md")
REGENERATE = "python -m cadence.config.doc"

HEADER = """# Configuration reference

Generated from the field descriptions in `src/cadence/config/` by `{regenerate}`
(run it from the repository root after changing a config field; a test fails while this page
is out of date). Do not edit it by hand.

A run's configuration is a TOML file, one table per section below; any key can be overridden on
the command line with `--set section.key=value` (a TOML literal; a bare word is a string), e.g.
`--set train.iterations=10 --set pipeline.mode=periodic`. An unknown key or a bad value stops
the command with exit code 2 and a message naming the key and what is allowed:

```
$ cadence train configs/default.toml --set pipeline.mode=fast
cadence: error: {example_error}
```

Some keys apply only with others (a Ray key with `pipeline.backend = "ray"`, a tool key with
`env.kind = "tool"`); setting one where it does not apply is refused with the key to set
instead. Every run writes its resolved configuration to `OUT/config.toml`.
"""

_SCALARS = {bool: "boolean", int: "integer", float: "float", str: "string"}


def _type_name(annotation: Any) -> str:
    """The TOML type a key takes, in words."""
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    if origin is Literal:
        return "string"
    if origin in (Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        name = " or ".join(_type_name(a) for a in kept)
        return f"{name} (optional)" if len(kept) < len(args) else name
    if origin is list:
        return f"array of {_type_name(args[0])}s"
    if origin is dict:
        return "table"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "table"
    raise TypeError(f"config_doc cannot name the type {annotation!r}: teach _type_name it")


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    default = field.get_default(call_default_factory=True)
    if default is None:
        return "unset"
    if isinstance(default, BaseModel):
        return "a table"
    return _code(toml_value(default))


def _allowed(field: FieldInfo) -> str:
    """Allowed values: a Literal's choices, else the numeric bounds, else '' (any)."""
    if get_origin(field.annotation) is Literal:
        return ", ".join(_code(toml_value(a)) for a in get_args(field.annotation))
    parts = []
    for m in field.metadata:
        if isinstance(m, Ge):
            parts.append(f">= {toml_value(m.ge)}")
        elif isinstance(m, Gt):
            parts.append(f"> {toml_value(m.gt)}")
        elif isinstance(m, Le):
            parts.append(f"<= {toml_value(m.le)}")
        elif isinstance(m, Lt):
            parts.append(f"< {toml_value(m.lt)}")
        elif isinstance(m, MinLen):
            parts.append(f"at least {m.min_length} item")
    return ", ".join(_code(p) for p in parts)


def _cell(text: str) -> str:
    """Prose safe inside a Markdown table cell: no pipe, tag or emphasis is misread, and a
    docs page it names becomes a link (this page sits beside the others in docs/)."""
    for raw, safe in (("|", "\\|"), ("<", "&lt;"), (">", "&gt;"), ("*", "\\*")):
        text = text.replace(raw, safe)
    text = re.sub(r"\bdocs/([\w-]+\.md)\b", r"[\1](\1)", text)
    return " ".join(text.split())


def _code(text: str) -> str:
    """A code span for a table cell (a pipe must still be escaped there)."""
    return "`" + text.replace("|", "\\|") + "`" if text else ""


def _section_model(field: FieldInfo) -> type[BaseModel] | None:
    """The model of a sub-table (rollout.vllm, model.lora), or None for a plain key."""
    for t in get_args(field.annotation) or (field.annotation,):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def _description(dotted: str, field: FieldInfo) -> str:
    if not field.description:
        raise ValueError(
            f"config key '{dotted}' has no description: give it a docstring under the field in "
            f"its section of src/cadence/config/, then run `{REGENERATE}`"
        )
    return " ".join(field.description.split())  # a docstring's lines, as one paragraph


def _table(name: str, model: type[BaseModel], intro: str, out: list[str]) -> None:
    """`## [name]`: its intro, a row per key, then each sub-table as its own section."""
    hashes = "#" * (name.count(".") + 2)
    out += [f"{hashes} `[{name}]`", "", _cell(intro), ""]
    out += ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
    subtables = []
    for key, field in model.model_fields.items():
        dotted = f"{name}.{key}"
        text = _cell(_description(dotted, field))
        sub = _section_model(field)
        if sub is not None:
            subtables.append((dotted, sub, _description(dotted, field)))
            text += f" See [`[{dotted}]`](#{_anchor(dotted)})."
        row = [_code(key), _type_name(field.annotation), _default(field), _allowed(field), text]
        out.append("| " + " | ".join(row) + " |")
    out.append("")
    for dotted, sub, intro_text in subtables:
        _table(dotted, sub, intro_text, out)


def _anchor(dotted: str) -> str:
    """GitHub's heading anchor for `## [a.b]`: punctuation dropped, lower case."""
    return dotted.replace(".", "").lower()


def _example_error() -> str:
    """The message a bad value gets, produced by validation itself so the quote cannot drift."""
    try:
        load_config(None, ["pipeline.mode=fast"])
    except ConfigError as e:
        return str(e)
    raise AssertionError("pipeline.mode = 'fast' was accepted: pick another bad value")


def render(root: type[BaseModel] = Config) -> str:
    """The whole of docs/config.md, from the root config's sections in their order."""
    out = [HEADER.format(regenerate=REGENERATE, example_error=_example_error())]
    for name, field in root.model_fields.items():
        model = _section_model(field)
        if model is None:
            raise TypeError(f"config section '{name}' is not a table")
        _table(name, model, _description(name, field), out)
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=REGENERATE, description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="page to write")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if out of date")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.is_file() else ""
        if current != text:
            print(f"{args.out} is out of date: run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
