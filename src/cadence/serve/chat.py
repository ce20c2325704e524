"""The chat-completions request and response, OpenAI's schema plus token ids.

The design in full: docs/internals.md, `cadence/serve/chat.py`.
"""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from cadence.types import Completion

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


class ChatRequest(Sampling):
    """What /v1/chat/completions accepts; unknown OpenAI fields are ignored, unsupported values
    of known ones are refused by name."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = ""
    messages: list[ChatMessage] = Field(default_factory=list)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**62)
    stream: Literal[False] = False
    logprobs: bool | None = None  # accepted; log-probs are always returned
    top_logprobs: Literal[0] | None = None
    prompt_token_ids: list[StrictInt] | None = None  # cadence: the prompt, exactly
    return_token_ids: bool | None = None  # vLLM's flag: accepted; token ids are always returned
    include_stop_str_in_output: bool = False  # vLLM's flag: keep the stop string in `content`

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def seeds(self) -> list[int]:
        base = self.seed if self.seed is not None else secrets.randbits(62)
        return [base + j for j in range(self.n)]


def render(request: ChatRequest, tokenizer) -> list[int]:
    """The prompt's token ids (see the module docstring)."""
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    if not request.messages:
        raise BadRequest("messages: at least one message is needed (or prompt_token_ids)")
    if tokenizer.chat_template:
        from jinja2 import TemplateError

        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        try:
            out = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True
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


def _content(c: Completion, stops: list[str], keep_stop: bool) -> str:
    if c.finish_reason != "stop" or keep_stop:
        return c.text
    cut = min((c.text.find(s) for s in stops if s in c.text), default=-1)
    return c.text if cut < 0 else c.text[:cut]


def _logprobs(c: Completion, tokenizer) -> dict[str, Any]:
    content = []
    for token_id, logprob in zip(c.token_ids, c.logprobs, strict=True):
        token = tokenizer.decode([token_id])
        content.append(
            {
                "token": token,
                "logprob": logprob,
                "bytes": list(token.encode("utf-8")),
                "top_logprobs": [],
            }
        )
    return {"content": content}


def response(
    request: ChatRequest,
    model: str,
    prompt_ids: list[int],
    completions: list[Completion],
    tokenizer,
) -> dict[str, Any]:
    """The OpenAI chat.completion object, with `prompt_token_ids` and each choice's `token_ids`."""
    stops = request.stops
    choices = [
        {
            "index": j,
            "message": {
                "role": "assistant",
                "content": _content(c, stops, request.include_stop_str_in_output),
            },
            "finish_reason": "length" if c.finish_reason == "length" else "stop",
            "logprobs": _logprobs(c, tokenizer),
            "token_ids": c.token_ids,
        }
        for j, c in enumerate(completions)
    ]
    completion_tokens = sum(len(c.token_ids) for c in completions)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
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
