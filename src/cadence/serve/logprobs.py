"""What a response says per token besides the sampled id: the most likely alternatives
(`top_logprobs`) and the text each token adds (streamed deltas, completions' offsets).

cadence's engines return each sampled token's log-prob only, so the alternatives come from one
forward pass of the served model over prompt + completion, under the distribution the engine
sampled from (softmax(logits / temperature); the logits' own at temperature 0). It runs on the
server's tokenizer thread, never on the event loop, and only for requests that ask. Token texts
are decoded as the engines decode (special tokens skipped) and never split a character.

The design in full: docs/serve.md, `cadence/serve/logprobs.py`.
"""

from __future__ import annotations

import torch

from cadence.engine.base import log_softmax

MAX_TOP_LOGPROBS = 20  # OpenAI's ceiling


@torch.inference_mode()
def top_logprobs(
    model, prompt_ids: list[int], token_ids: list[int], k: int, temperature: float
) -> list[list[tuple[int, float]]]:
    """Per sampled token, the `k` likeliest tokens at its position and their log-probs, most
    likely first."""
    if not token_ids or k <= 0:
        return [[] for _ in token_ids]
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + token_ids[:-1]], device=device)
    # the last len(token_ids) positions only: no logits over the prompt
    logits = model(input_ids=ids, logits_to_keep=len(token_ids)).logits[0].float()
    logp = log_softmax(logits / temperature if temperature > 0 else logits)
    values, indices = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return [
        list(zip(row_ids, row_lps, strict=True))
        for row_ids, row_lps in zip(indices.tolist(), values.tolist(), strict=True)
    ]


def text_decoder(tokenizer):
    """Token ids to text as the engines decode a completion (special tokens skipped)."""
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def text_deltas(token_ids: list[int], text: str, decode) -> list[str]:
    """The text each token adds to `text` (the whole completion's), in order: the deltas join to
    `text`; a token that ends inside a character adds nothing and the next one adds it."""
    deltas, emitted = [], ""
    for i in range(1, len(token_ids) + 1):
        so_far = decode(token_ids[:i]) if i < len(token_ids) else text
        if so_far.startswith(emitted) and not so_far.endswith("\ufffd"):
            deltas.append(so_far[len(emitted) :])
            emitted = so_far
        else:
            deltas.append("")
    if "".join(deltas) != text:  # a decoding that is not prefix-stable: all of it at the end
        return [""] * (len(token_ids) - 1) + [text]
    return deltas


def clip(deltas: list[str], start: int, end: int) -> list[str]:
    """`deltas` cut to the characters start..end of the text they join to (a content that stops
    before a stop string, or the text before a tool call)."""
    out, at = [], 0
    for d in deltas:
        out.append(d[max(start - at, 0) : max(end - at, 0)])
        at += len(d)
    return out
