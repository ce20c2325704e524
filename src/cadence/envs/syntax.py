"""The call syntax of tool environments: how the policy calls a tool and how the tool answers.

Read on: docs/envs.md.
"""

from __future__ import annotations

import re

CALL_START, CALL_END = "<call>", "</call>"
RESULT_START, RESULT_END = "<result>", "</result>"
MAX_ARGUMENT_CHARS = 1000
MAX_RESULT_CHARS = 200

_CALL = re.compile(r"<call>\s*([A-Za-z_][A-Za-z0-9_]*)\s*:(.*?)</call>", re.DOTALL)


class MalformedCall(ValueError):
    """The turn opens a call that cannot be read; the message is what the policy reads."""


def call_text(name: str, argument: str) -> str:
    return f"{CALL_START}{name}: {argument}{CALL_END}"


def result_text(text: str) -> str:
    return f"{RESULT_START}{text}{RESULT_END}"


def error_text(message: str) -> str:
    return result_text(f"error: {message}")


def parse_call(turn: str) -> tuple[str, str] | None:
    """(tool name, argument) of the turn's call; None when the turn calls nothing."""
    if CALL_START not in turn:
        return None
    match = _CALL.search(turn)
    if match is None:
        raise MalformedCall(f"malformed call: write {call_text('NAME', 'ARGUMENT')}")
    name, argument = match.group(1), match.group(2).strip()
    if len(argument) > MAX_ARGUMENT_CHARS:
        raise MalformedCall(f"argument longer than {MAX_ARGUMENT_CHARS} characters")
    return name, argument
