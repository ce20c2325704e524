"""How a reward function is called: `(prompt, completion, answer)`, plus the row's metadata for
a function that asks for it.

A reward asks for the row's own data (`Prompt.metadata`, a reasoning-gym row's `metadata`) by
taking a keyword parameter named `metadata`, or `**kwargs` as TRL's reward functions do; every
other reward is called with the three texts, exactly as before. This module must not import
torch or call anything but the reward it is given.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


def takes_metadata(fn: Callable[..., Any]) -> bool:
    """Whether `fn` takes `metadata=` (a parameter of that name, or `**kwargs`)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: the three texts only
        return False
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return any(
        p.kind == inspect.Parameter.VAR_KEYWORD or (p.name == "metadata" and p.kind in keyword)
        for p in params
    )


def call_reward(
    fn: Callable[..., Any],
    prompt: str,
    completion: str,
    answer: str,
    metadata: dict[str, Any] | None = None,
) -> Any:
    """`fn(prompt, completion, answer)`, with `metadata=` when there is some and `fn` takes it."""
    if metadata is not None and takes_metadata(fn):
        return fn(prompt, completion, answer, metadata=metadata)
    return fn(prompt, completion, answer)
