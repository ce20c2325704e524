"""`stream = true`: a finished answer as OpenAI's server-sent events, a chunk per sampled token.

cadence's engines hand back whole completions, so the chunks are sent once a request's
completions are done: streaming changes how the answer travels, not when its first token
arrives. Each token's chunk carries its text delta (the deltas join to the non-streamed
`content` / `text`), its log-prob entry and its id; a choice's tool calls come in one chunk after
its text, then its finish reason; `stream_options.include_usage` adds a last chunk with the
usage; `data: [DONE]` ends the stream.

The design in full: docs/serve.md, `cadence/serve/stream.py`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from cadence.serve.chat import ChatRequest, read_choice
from cadence.serve.completions import CompletionRequest
from cadence.serve.logprobs import clip, text_decoder, text_deltas
from cadence.types import Completion

DONE = "data: [DONE]\n\n"


def event(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


def _wants_usage(options: dict[str, Any] | None) -> bool:
    return bool((options or {}).get("include_usage"))


def chat_chunks(
    request: ChatRequest, full: dict[str, Any], completions: list[Completion], tokenizer
) -> Iterator[dict[str, Any]]:
    """The chat.completion.chunk objects of `full` (the non-streamed answer)."""
    head = {"id": full["id"], "object": "chat.completion.chunk", "created": full["created"]}
    head["model"] = full["model"]
    asked = bool(request.logprobs) or bool(request.top_logprobs)

    def chunk(j: int, delta: dict[str, Any], **fields: Any) -> dict[str, Any]:
        choice = {"index": j, "delta": delta, "logprobs": None, "finish_reason": None}
        return {**head, "choices": [choice | fields]}

    for j, (c, choice) in enumerate(zip(completions, full["choices"], strict=True)):
        turn, finish = read_choice(c, request)
        deltas = clip(
            text_deltas(c.token_ids, c.text, text_decoder(tokenizer)), turn.start, turn.end
        )
        yield chunk(j, {"role": "assistant", "content": ""})
        entries = choice["logprobs"]["content"]
        for token_id, entry, delta in zip(c.token_ids, entries, deltas, strict=True):
            # a chunk carries log-probs only when asked, as OpenAI's and vLLM's do
            logprobs = {"content": [entry]} if asked else None
            yield chunk(j, {"content": delta}, logprobs=logprobs, token_ids=[token_id])
        calls = choice["message"].get("tool_calls") or []
        if calls:
            yield chunk(j, {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]})
        yield chunk(j, {}, finish_reason=finish)
    if _wants_usage(request.stream_options):
        yield {**head, "choices": [], "usage": full["usage"]}


def completion_chunks(
    request: CompletionRequest, full: dict[str, Any], completions: list[Completion], tokenizer
) -> Iterator[dict[str, Any]]:
    """The streamed text_completion objects of `full` (the non-streamed answer): each token's
    text is its slice of the choice's text, between its offset and the next."""
    head = {"id": full["id"], "object": "text_completion", "created": full["created"]}
    head["model"] = full["model"]
    for j, (c, choice) in enumerate(zip(completions, full["choices"], strict=True)):
        lp, text = choice["logprobs"], choice["text"]
        ends = [*lp["text_offset"][1:], len(text)]
        for i, (start, end) in enumerate(zip(lp["text_offset"], ends, strict=True)):
            logprobs = {
                "tokens": [lp["tokens"][i]],
                "token_logprobs": [lp["token_logprobs"][i]],
                "top_logprobs": None if lp["top_logprobs"] is None else [lp["top_logprobs"][i]],
                "text_offset": [start],
            }
            piece = {"index": j, "text": text[start:end], "logprobs": logprobs}
            yield {
                **head,
                "choices": [piece | {"finish_reason": None, "token_ids": [c.token_ids[i]]}],
            }
        end = {"index": j, "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}
        yield {**head, "choices": [end]}
    if _wants_usage(request.stream_options):
        yield {**head, "choices": [], "usage": full["usage"]}
