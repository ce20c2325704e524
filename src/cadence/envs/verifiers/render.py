"""A verifiers renderer for a model without a chat template (the embedded default), in cadence's
own conventions: how verifiers' training client turns messages into token ids and completions
back into messages.

Read on: docs/envs.md.
"""

from __future__ import annotations

import json
from typing import Any

from renderers.base import (
    ParsedResponse,
    ParsedToolCall,
    RenderedTokens,
    ToolCallParseStatus,
    reject_assistant_in_extension,
)
from renderers.configs import BaseRendererConfig

from cadence.envs.syntax import (
    CALL_END,
    CALL_START,
    MalformedCall,
    call_text,
    parse_call,
    result_text,
)

IMPORT_PATH = "cadence.envs.verifiers.render.PlainRenderer"


class PlainRendererConfig(BaseRendererConfig):
    """No settings: the rendering is fixed (the module docstring)."""


class PlainRenderer:
    config_class = PlainRendererConfig

    def __init__(self, tokenizer, config: PlainRendererConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.config = config or PlainRendererConfig()

    @property
    def is_prefix_stable(self) -> bool:
        return True  # concatenation: appending messages never changes the tokens before them

    @property
    def supports_tools(self) -> bool:
        return True

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def message_text(self, message: dict[str, Any]) -> str:
        text = _content_text(message.get("content"))
        if message.get("role") == "tool":
            return result_text(text)
        for call in message.get("tool_calls") or []:
            function = call.get("function", call)
            text += call_text(function["name"], _argument_text(function.get("arguments")))
        return text

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> RenderedTokens:
        out = RenderedTokens()
        for i, message in enumerate(messages):
            ids = self.encode(self.message_text(message))
            sampled = message.get("role") == "assistant"
            out.token_ids += ids
            out.message_indices += [i] * len(ids)
            out.sampled_mask += [sampled] * len(ids)
            out.is_content += [True] * len(ids)
        out.message_roles = [m.get("role", "") for m in messages]
        return out

    def render_ids(self, messages, *, tools=None, add_generation_prompt: bool = False) -> list[int]:
        return self.render(messages, tools=tools).token_ids

    def parse_response(
        self,
        token_ids: list[int],
        *,
        tools: list[dict[str, Any]] | None = None,
        prompt_ids: list[int] | None = None,
    ) -> ParsedResponse:
        stops = set(self.get_stop_token_ids())
        kept = [t for t in token_ids if t not in stops]
        text = self.tokenizer.decode(kept, skip_special_tokens=False)
        if CALL_START not in text:
            return ParsedResponse(content=text)
        content = text[: text.index(CALL_START)]
        return ParsedResponse(content=content, tool_calls=[_tool_call(text, tools or [])])

    def get_stop_token_ids(self) -> list[int]:
        eos = self.tokenizer.eos_token_id
        return [] if eos is None else [eos]

    def bridge_to_next_turn(
        self,
        previous_prompt_ids: list[int],
        previous_completion_ids: list[int],
        new_messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
    ) -> RenderedTokens | None:
        """The previous prompt and completion as they were, then the new messages' tokens."""
        if not new_messages or reject_assistant_in_extension(new_messages):
            return None
        previous = [*previous_prompt_ids, *previous_completion_ids]
        added = self.render(new_messages)
        return RenderedTokens(
            token_ids=previous + added.token_ids,
            message_indices=[-1] * len(previous) + added.message_indices,
            sampled_mask=[False] * (len(previous) + len(added.token_ids)),
            is_content=[False] * len(previous) + added.is_content,
            message_roles=added.message_roles,
        )


def _content_text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = [p.get("text", "") for p in content if p.get("type") == "text"]
    if len(parts) != len(content):
        raise ValueError("the plain renderer renders text content only (no images)")
    return "".join(parts)


def _argument_text(arguments: Any) -> str:
    """A call's one argument as the policy wrote it (the first value of its JSON object)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    if isinstance(arguments, dict) and arguments:
        return str(next(iter(arguments.values())))
    return ""


def _tool_call(text: str, tools: list[dict[str, Any]]) -> ParsedToolCall:
    raw = text[text.index(CALL_START) :]
    try:
        name, argument = parse_call(text)  # the text holds CALL_START: a call or an error
    except MalformedCall:
        unclosed = CALL_END not in raw  # cut off by the turn's token limit
        status = (
            ToolCallParseStatus.UNCLOSED_BLOCK
            if unclosed
            else ToolCallParseStatus.MALFORMED_STRUCTURE
        )
        return ParsedToolCall(raw=raw, status=status)
    schema = _parameters(tools).get(name)
    if schema is None:
        return ParsedToolCall(raw=raw, name=name, status=ToolCallParseStatus.UNKNOWN_TOOL)
    properties = list((schema.get("properties") or {}).keys())
    first = (schema.get("required") or properties or ["argument"])[0]
    return ParsedToolCall(raw=raw, name=name, arguments={first: argument})


def _parameters(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Tool name -> its parameters' JSON schema; flat specs and OpenAI's envelope alike."""
    out = {}
    for tool in tools:
        spec = tool.get("function", tool)
        out[spec["name"]] = spec.get("parameters") or {}
    return out
