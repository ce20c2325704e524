"""`POST /v1/completions`: OpenAI's text completions, a prompt as text or token ids, with each
sampled token's id and log-prob (and the likeliest alternatives when `logprobs` = k > 0).

One prompt per request (a list of several is refused: send them as requests of their own, which
the engine batches anyway); `echo`, `suffix` and a `best_of` other than `n` are refused by
fields.py. No HTTP and no engine here: app.py prepares and answers.

The design in full: docs/serve.md, `cadence/serve/completions.py`.
"""

from __future__ import annotations

import secrets
from typing import Any

from pydantic import ConfigDict, Field, StrictInt

from cadence.serve.chat import BadRequest, Sampling, TopLogprobs, check_text, envelope
from cadence.serve.logprobs import MAX_TOP_LOGPROBS, clip, text_decoder, text_deltas
from cadence.types import Completion

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this route


class CompletionRequest(Sampling):
    """What /v1/completions accepts; undeclared fields stay in `model_extra` for fields.py."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str = ""
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: int | None = Field(DEFAULT_MAX_TOKENS, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**62)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    include_stop_str_in_output: bool = False

    def prompt_ids(self, encode) -> list[int]:
        """The one prompt's token ids (text through `encode`, ids as they are)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise BadRequest(
                    f"prompt: {len(prompt)} prompts in one request; cadence serve takes one "
                    "(send one request each: the engine batches them)"
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            return encode(check_text(prompt, "prompt"))
        return list(prompt)

    def seeds(self) -> list[int]:
        base = self.seed if self.seed is not None else secrets.randbits(62)
        return [base + j for j in range(self.n)]


def choice_text(c: Completion, request: CompletionRequest) -> tuple[str, str]:
    """The choice's text (before the stop string that ended it, unless kept) and finish reason."""
    end = len(c.text)
    if c.finish_reason == "stop" and not request.include_stop_str_in_output:
        end = min((c.text.find(s) for s in request.stops if s in c.text), default=end)
    return c.text[:end], "length" if c.finish_reason == "length" else "stop"


def token_logprobs(
    c: Completion, top: TopLogprobs, text: str, tokenizer, asked: bool
) -> list[dict[str, Any]]:
    """Per token: its own text, log-prob, alternatives (None unless asked), its offset in the
    choice's text and what it adds to that text (the legacy `logprobs`, and stream chunks)."""
    decode = tokenizer.decode
    deltas = clip(text_deltas(c.token_ids, c.text, text_decoder(tokenizer)), 0, len(text))
    out, offset = [], 0
    for token_id, logprob, alternatives, delta in zip(
        c.token_ids, c.logprobs, top, deltas, strict=True
    ):
        out.append(
            {
                "token": decode([token_id]),
                "logprob": logprob,
                "top": {decode([i]): lp for i, lp in alternatives} if asked else None,
                "offset": offset,
                "text": delta,
            }
        )
        offset += len(delta)
    return out


def legacy_logprobs(tokens: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "tokens": [t["token"] for t in tokens],
        "token_logprobs": [t["logprob"] for t in tokens],
        "top_logprobs": None if tokens and tokens[0]["top"] is None else [t["top"] for t in tokens],
        "text_offset": [t["offset"] for t in tokens],
    }


def completion_response(
    request: CompletionRequest,
    model: str,
    prompt_ids: list[int],
    completions: list[Completion],
    tokenizer,
    tops: list[TopLogprobs] | None = None,
) -> dict[str, Any]:
    """The OpenAI text_completion object, with `prompt_token_ids` and each choice's
    `token_ids`; `tops[j]` are choice j's alternatives per token (none when not asked)."""
    choices = []
    for j, c in enumerate(completions):
        text, finish = choice_text(c, request)
        top = tops[j] if tops else [[] for _ in c.token_ids]
        tokens = token_logprobs(c, top, text, tokenizer, request.logprobs is not None)
        choices.append(
            {
                "index": j,
                "text": text,
                "logprobs": legacy_logprobs(tokens),
                "finish_reason": finish,
                "token_ids": c.token_ids,
            }
        )
    return envelope("cmpl", "text_completion", model, prompt_ids, completions, choices)
