"""The chat-completions request and response, OpenAI's schema plus token ids.

A request's messages (tools and past tool calls among them) are rendered by the model's own chat
template; the answer carries per choice the sampled token ids, their log-probs (with the
likeliest alternatives when `top_logprobs` asks) and the tool calls read back from the text.
Fields the schema does not declare are kept for fields.py to refuse or pass.

The design in full: docs/serve.md, `cadence/serve/chat.py`.
"""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from cadence.serve.logprobs import MAX_TOP_LOGPROBS
from cadence.serve.tools import Turn, arguments_for_template, read_turn, template_refuses_tools
from cadence.types import Completion

TopLogprobs = list[list[tuple[int, float]]]  # per token: (id, log-prob), likeliest first

MIN_TEMPERATURE = 0.01  # below it logits / temperature overflow float32; 0 is greedy
MAX_STOPS = 16  # every stop string is searched for after every token of the request


class BadRequest(ValueError):
    """The request cannot be served as sent (HTTP 400); the message says which field and why."""


@dataclass(frozen=True)
class Limits:
    """What the served model takes: token ids below `vocab_size` (its embedding rows), at most
    `max_positions` tokens of prompt and completion, at most `max_tokens` per completion."""

    vocab_size: int
    max_positions: int
    max_tokens: int


def check_text(text: str, field: str) -> str:
    """`text` if it is valid Unicode (a lone surrogate such as "\\ud800" is not, and no tokenizer
    takes it): a BadRequest naming `field` otherwise."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"{field}: not valid Unicode text ({e.reason} at {e.start})") from None
    return text


class Sampling(BaseModel):
    """The sampling fields both request schemas share (chat completions, vLLM's generate)."""

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=64)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None

    @field_validator("temperature")
    @classmethod
    def _not_too_small(cls, t: float) -> float:
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {t}")
        return t

    @field_validator("stop")
    @classmethod
    def _stops_are_text(cls, stop: str | list[str] | None) -> str | list[str] | None:
        for s in [stop] if isinstance(stop, str) else stop or []:
            if not s:
                raise ValueError("a stop string must not be empty (it would stop every response)")
            check_text(s, "stop")
        return stop

    @property
    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's past calls
    tool_call_id: str | None = None  # a tool's reply: the call it answers
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _valid_text(cls, content):
        if isinstance(content, str):
            check_text(content, "messages.content")
        return content

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = [p.get("text", "") for p in self.content if p.get("type") == "text"]
        if len(parts) != len(self.content) or not all(isinstance(p, str) for p in parts):
            raise BadRequest("messages: only text content parts are supported")
        return "".join(parts)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (a call's arguments an object, not JSON text)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            try:
                out["tool_calls"] = arguments_for_template(self.tool_calls)
            except ValueError as e:
                raise BadRequest(str(e)) from None
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class ChatRequest(Sampling):
    """What /v1/chat/completions accepts; undeclared fields stay in `model_extra` for
    fields.py, unsupported values of declared ones are refused by name."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str = ""
    messages: list[ChatMessage] = Field(default_factory=list)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**62)
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # include_usage: a last chunk with the usage
    logprobs: bool | None = None  # accepted; log-probs are always returned
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "auto" or "none": no forced calls
    prompt_token_ids: list[StrictInt] | None = None  # cadence: the prompt, exactly
    return_token_ids: bool | None = None  # vLLM's flag: accepted; token ids are always returned
    include_stop_str_in_output: bool = False  # vLLM's flag: keep the stop string in `content`

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def with_tools(self) -> bool:
        """Tools are shown to the model, and its calls read back."""
        return bool(self.tools) and self.tool_choice != "none"

    def check_tool_choice(self) -> None:
        if self.tool_choice not in (None, "auto", "none"):
            raise BadRequest(
                f"tool_choice = {self.tool_choice!r} is not honoured (cadence serve does not "
                "constrain decoding to a call): leave it out, or send 'auto' or 'none'"
            )

    def seeds(self) -> list[int]:
        base = self.seed if self.seed is not None else secrets.randbits(62)
        return [base + j for j in range(self.n)]


def render(request: ChatRequest, tokenizer) -> list[int]:
    """The prompt's token ids (see the module docstring)."""
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    if not request.messages:
        raise BadRequest("messages: at least one message is needed (or prompt_token_ids)")
    if request.with_tools:
        why = template_refuses_tools(tokenizer)
        if why is not None:
            raise BadRequest(f"tools: this model's chat template cannot take them: {why}")
    if tokenizer.chat_template:
        from jinja2 import TemplateError

        messages = [m.for_template() for m in request.messages]
        tools = {"tools": request.tools} if request.with_tools else {}
        try:
            out = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True, **tools
            )
        except TemplateError as e:  # templates refuse what they cannot render, by raising
            raise BadRequest(f"messages: the model's chat template refused them: {e}") from None
        return list(out["input_ids"])
    ids: list[int] = []
    for m in request.messages:
        ids += tokenizer(m.text(), add_special_tokens=False)["input_ids"]
    return ids


def check_prompt(
    prompt_ids: list[int], max_new_tokens: int, limits: Limits, field: str = "prompt_token_ids"
) -> None:
    """Refuse a prompt the model cannot take: empty, an id it has no embedding for, or too long
    for `max_new_tokens` more (the message says "exceeds the model's maximum context length",
    the words OpenAI-API clients, verifiers' harnesses among them, look for to tell an overlong
    prompt from other errors)."""
    if not prompt_ids:
        raise BadRequest("the prompt is empty: send messages with content, or prompt_token_ids")
    total = len(prompt_ids) + max_new_tokens
    if total > limits.max_positions:
        raise BadRequest(
            f"a prompt of {len(prompt_ids)} tokens + max_tokens {max_new_tokens} = {total} "
            f"exceeds the model's maximum context length of {limits.max_positions} positions: "
            "shorten the prompt or lower max_tokens"
        )
    for i, token in enumerate(prompt_ids):
        if not 0 <= token < limits.vocab_size:
            raise BadRequest(
                f"{field}[{i}] = {token} is not a token of this model: ids are 0 to "
                f"{limits.vocab_size - 1} (POST /tokenize gives a text's ids)"
            )


def content_end(c: Completion, stops: list[str], keep_stop: bool) -> int:
    """Where the answer's text ends in `c.text`: before the stop string that ended it, unless
    the request keeps it."""
    if c.finish_reason != "stop" or keep_stop:
        return len(c.text)
    cut = min((c.text.find(s) for s in stops if s in c.text), default=-1)
    return len(c.text) if cut < 0 else cut


def read_choice(c: Completion, request: ChatRequest) -> tuple[Turn, str]:
    """The choice's message (its content's span in `c.text`, its tool calls) and finish reason."""
    end = content_end(c, request.stops, request.include_stop_str_in_output)
    turn = read_turn(c.text[:end]) if request.with_tools else Turn(c.text[:end], 0, end, [])
    if turn.tool_calls:
        return turn, "tool_calls"
    return turn, "length" if c.finish_reason == "length" else "stop"


def token_entry(token_id: int, logprob: float, top: list[tuple[int, float]], decode):
    """One token of `logprobs.content`: its text, log-prob, bytes and likeliest alternatives."""
    token = decode([token_id])
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode("utf-8")),
        "top_logprobs": [  # with the id: two tokens may decode alike (bytes of one character)
            {"token": (t := decode([i])), "logprob": lp, "bytes": list(t.encode()), "token_id": i}
            for i, lp in top
        ],
    }


def response(
    request: ChatRequest,
    model: str,
    prompt_ids: list[int],
    completions: list[Completion],
    tokenizer,
    tops: list[TopLogprobs] | None = None,
) -> dict[str, Any]:
    """The OpenAI chat.completion object, with `prompt_token_ids` and each choice's `token_ids`;
    `tops[j]` are choice j's alternatives per token (none when not asked)."""
    choices = []
    for j, c in enumerate(completions):
        turn, finish = read_choice(c, request)
        message: dict[str, Any] = {"role": "assistant", "content": turn.content}
        if turn.tool_calls:
            message["tool_calls"] = turn.tool_calls
        top = tops[j] if tops else [[] for _ in c.token_ids]
        entries = zip(c.token_ids, c.logprobs, top, strict=True)
        choices.append(
            {
                "index": j,
                "message": message,
                "finish_reason": finish,
                "logprobs": {"content": [token_entry(*e, tokenizer.decode) for e in entries]},
                "token_ids": c.token_ids,
            }
        )
    return envelope("chatcmpl", "chat.completion", model, prompt_ids, completions, choices)


def envelope(
    prefix: str,
    kind: str,
    model: str,
    prompt_ids: list[int],
    completions: list[Completion],
    choices: list[dict[str, Any]],
) -> dict[str, Any]:
    """An OpenAI answer object around `choices`: id, object, usage and `prompt_token_ids`."""
    completion_tokens = sum(len(c.token_ids) for c in completions)
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt_ids) + completion_tokens,
        },
        "prompt_token_ids": prompt_ids,
    }
