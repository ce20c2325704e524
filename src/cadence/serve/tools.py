"""Tools in chat completions: the tools and past calls rendered by the model's own chat template,
and the calls the model writes (Hermes/Qwen `<tool_call>{...}</tool_call>`) parsed back into
OpenAI's `tool_calls`.

A template that cannot carry tool calls (no template, one that ignores `tools=`, or writes calls
in another format) is refused by name before anything is generated: a model that never saw its
tools would answer without them. A turn whose call cannot be read stays text (`content`), as
vLLM's parsers leave it. No HTTP and no engine here.

The design in full: docs/serve.md, `cadence/serve/tools.py`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from cadence.envs.chat_tools import OPEN, ChatFormat, ChatToolsError, MalformedToolCall, parse_calls

_CHECKED: dict[tuple[int, str | None], str | None] = {}  # (tokenizer, template) -> why not


def template_refuses_tools(tokenizer) -> str | None:
    """Why the tokenizer's chat template cannot carry tool calls the Hermes way (None when it
    can); checked once per tokenizer and template."""
    key = (id(tokenizer), tokenizer.chat_template)
    if key not in _CHECKED:
        try:
            ChatFormat(tokenizer)
            _CHECKED[key] = None
        except ChatToolsError as e:
            _CHECKED[key] = str(e)
    return _CHECKED[key]


def arguments_for_template(tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's calls (`arguments` a JSON text) as chat templates read them (an object)."""
    out = []
    for call in tool_calls:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                raise ValueError(
                    "messages.tool_calls.function.arguments: not a JSON text"
                ) from None
        out.append({**call, "function": function})
    return out


@dataclass(frozen=True)
class Turn:
    """A generated turn read for tool calls: `content` is text[start:end] (None when empty)."""

    content: str | None
    start: int
    end: int
    tool_calls: list[dict[str, Any]]


def read_turn(text: str) -> Turn:
    """The calls in `text` as OpenAI `tool_calls` (each with a fresh id), and the text before the
    first call as the content; a turn without a readable call is all content."""
    try:
        calls = parse_calls(text)
    except MalformedToolCall:
        calls = []
    if not calls:
        return Turn(text, 0, len(text), [])
    head = text[: text.find(OPEN)]
    start = len(head) - len(head.lstrip())
    end = len(head.rstrip())
    wire = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for c in calls
    ]
    return Turn(text[start:end] or None, start, max(start, end), wire)
