"""Tool calls in the model's own chat format: the prompt that shows the tools, the calls read from
the policy's turn, and the replies written in the template's tool role.

Text only: the rollout worker tokenises what this renders, once, and appends it untrained; the
policy's own tokens are never re-rendered. Imports no model library (the template engine is
reached through the tokenizer).

Read on: docs/envs.md.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_NAME, _ARG, _VALUE, _CONTENT = "probe_tool_a8f3", "probe_arg_b9d4", "probe_val_d6e7", "probe_c4f9"
_PROBE_SCHEMA = {
    "type": "function",
    "function": {
        "name": _NAME,
        "description": "A probe.",
        "parameters": {
            "type": "object",
            "properties": {_ARG: {"type": "string", "description": "A probe."}},
            "required": [_ARG],
        },
    },
}
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
OPEN = "<tool_call>"


class ChatToolsError(ValueError):
    """The chat template cannot carry tool calls; the message says why and what to do."""


class MalformedToolCall(ValueError):
    """A call in the policy's turn cannot be read; the message is what the policy reads."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def message(self) -> dict[str, Any]:
        """The call as a chat message's `tool_calls` entry."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_calls(turn: str) -> list[ToolCall]:
    """The Hermes calls in `turn`, in order; [] when it calls nothing. A call that is not a JSON
    object with a string "name" and an object of "arguments" (or a JSON text of one) raises."""
    calls = []
    for body in _CALL.findall(turn):
        try:
            value = json.loads(body)
        except json.JSONDecodeError as e:
            raise MalformedToolCall(
                f"a tool call is not JSON ({e.msg}): {body.strip()[:80]}"
            ) from None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            raise MalformedToolCall('a tool call needs {"name": ..., "arguments": {...}}')
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON text
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(arguments, dict):
            raise MalformedToolCall(f'the "arguments" of {value["name"]} are not a JSON object')
        calls.append(ToolCall(value["name"], arguments))
    if not calls and OPEN in turn:
        raise MalformedToolCall("a tool call is not closed with </tool_call>")
    return calls


class ChatFormat:
    """A chat template that carries tool calls (checked when built; see the module docstring);
    with `tools=False`, one that carries a user's replies only (a text environment's)."""

    def __init__(self, tokenizer: Any, template: str | None = None, tools: bool = True) -> None:
        self.tokenizer, self.template = tokenizer, template
        self.eos = tokenizer.eos_token
        if tools:
            self._check()
        else:
            self._basics()
            self.user_reply("hi")  # raises unless a reply can follow a turn token-exactly

    def render(self, messages: list[dict], add_generation_prompt: bool = False, **kw) -> str:
        text = self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **kw,
        )
        if not isinstance(text, str):
            raise ChatToolsError(f"the chat template gave {type(text).__name__}, not text")
        return text

    def prompt(self, messages: list[dict], tools: list[dict] | None) -> str:
        """The episode's prompt: `messages` with the tools' schemas, opening the assistant."""
        return self.render(messages, add_generation_prompt=True, tools=tools or None)

    def tool_reply(self, results: list[tuple[str, str]]) -> str:
        """What follows an assistant message that called tools: a tool message per (name,
        content), then the next assistant message's opening."""
        head = _dummy({"role": "assistant", "content": "", "tool_calls": [_call(results[0][0])]})
        tail = [{"role": "tool", "name": name, "content": content} for name, content in results]
        return self._suffix(head, tail)

    def user_reply(self, text: str) -> str:
        """What follows an assistant message when the user (a text environment) answers."""
        head = _dummy({"role": "assistant", "content": "dummy"})
        return self._suffix(head, [{"role": "user", "content": text}])

    def _suffix(self, head: list[dict], tail: list[dict]) -> str:
        before = self.render(head)
        cut = before.rfind(self.eos)
        if cut < 0:
            raise ChatToolsError(
                f"the chat template does not end an assistant message with the EOS token "
                f"{self.eos!r}: a policy turn ends at EOS, so its reply could not follow it"
            )
        before = before[: cut + len(self.eos)]
        after = self.render(head + tail, add_generation_prompt=True)
        if not after.startswith(before):
            raise ChatToolsError(
                "the chat template renders an assistant message differently once a reply "
                "follows it (it is not prefix-preserving), so the trajectory could not stay "
                "token-exact: give a template that keeps earlier messages as they were"
            )
        return after[len(before) :]

    def _check(self) -> None:
        """Refuse a template that cannot carry a tool conversation, token-exactly: a probe
        conversation built the way episodes build it (prompt, the call as the template writes
        it, EOS, the reply) must be what the template renders for the whole conversation."""
        self._basics()
        user, tools = [{"role": "user", "content": "hi"}], [_PROBE_SCHEMA]
        assistant = {"role": "assistant", "content": "", "tool_calls": [_call(_NAME)]}
        reply = {"role": "tool", "name": _NAME, "content": _CONTENT}
        opened = self.prompt(user, tools)
        if _NAME not in opened:
            raise ChatToolsError(
                "the chat template ignores tools= (no tool's schema reaches the prompt), so the "
                "model would never see its tools: use a model whose template supports tools, or "
                "give one as data.chat_template (configs/chat-tools.jinja renders them Hermes' way)"
            )
        full = self.render([*user, assistant, reply], add_generation_prompt=True, tools=tools)
        if not all(s in full for s in (_NAME, _ARG, _VALUE, _CONTENT)):
            raise ChatToolsError(
                "the chat template drops an assistant's tool call or the tool's reply when it "
                "renders them, so it cannot carry a tool conversation"
            )
        called = self.render([*user, assistant], tools=tools)
        cut = called.rfind(self.eos)
        if not called.startswith(opened) or cut < len(opened):
            raise ChatToolsError(
                "the chat template does not write an assistant message as the generation prompt "
                f"opens it, ending with the EOS token {self.eos!r} (which ends a policy turn)"
            )
        written = called[len(opened) : cut]
        self._check_format(written)
        if opened + written + self.eos + self.tool_reply([(_NAME, _CONTENT)]) != full:
            raise ChatToolsError(
                "the chat template renders an assistant message differently once a reply "
                "follows it (it is not prefix-preserving: Qwen3's templates drop past <think> "
                "blocks, say), so the trajectory could not stay token-exact: give a template "
                "that keeps earlier messages as they were, as data.chat_template"
            )

    def _basics(self) -> None:
        if self.template is None and not self.tokenizer.chat_template:
            raise ChatToolsError("the tokenizer has no chat template to write the episode with")
        if not self.eos:
            raise ChatToolsError("the tokenizer has no EOS token to end a policy turn with")

    def _check_format(self, written: str) -> None:
        try:
            calls = parse_calls(written)
        except MalformedToolCall:
            calls = []
        if calls != [ToolCall(_NAME, {_ARG: _VALUE})]:
            raise ChatToolsError(
                "the chat template writes a tool call in a format other than Hermes' "
                '<tool_call>{"name": ..., "arguments": {...}}</tool_call>, the one cadence reads: '
                f"{written[-160:]!r}"
            )


def _call(name: str) -> dict:
    return ToolCall(name, {_ARG: _VALUE}).message()


def _dummy(assistant: dict) -> list[dict]:
    return [{"role": "user", "content": "dummy"}, assistant]
