"""User code named by "package.module:attribute" (reward functions, tools, environment classes,
environment factories): one way to split the name, import the module and look the attribute
up, so every key that names code fails the same way. What the attribute must be is the
caller's check."""

from __future__ import annotations

import importlib
from typing import Any


class SpecError(ValueError):
    """A "module:attribute" name that does not name an attribute: the message says why."""


def load_attribute(spec: str, what: str, form: str = "'package.module:name'") -> Any:
    """The attribute `spec` names; `what` (e.g. "reward spec") and `form` (the accepted forms)
    say what it is in messages."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SpecError(f"{what} {spec!r} must be {form}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # not found, or its own import failed (a SyntaxError, say)
        raise SpecError(
            f"{what} {spec!r}: cannot import module {module_name!r}: {type(e).__name__}: {e} "
            "(is it on PYTHONPATH?)"
        ) from e
    if not hasattr(module, attr):
        raise SpecError(f"{what} {spec!r}: module {module_name!r} has no {attr!r}")
    return getattr(module, attr)
