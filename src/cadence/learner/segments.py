"""Attention by segments: what lets the packed layout put a micro-batch's groups end to end in
one row without a (row x row) mask.

A packed row's attention mask is a segments tensor (`segments`: (N, 1, 2, L) int64, each
position's group in its row and its segment in the group, 0 the prompt, j response j, -1 padding),
which transformers hands to the attention function untouched (a 4-D mask is taken as prepared).
The wrapped attention functions (`install`: sdpa, flash, flex) see it and attend group by group:
each group's queries against its own keys under the shared-prompt rule (causal; the prompt, or
the query's own response), through transformers' SDPA, in one call per group or, for long
responses, one for its prompt and one per response; every other mask goes to the function
wrapped. Memory and work are those of the groups apart, whatever the row's length; padding
attends to nothing and reads zeros. A model with eager attention is not wrapped: the layout check
then finds wrong log-probs and trains unpacked (learner/forward.py). docs/learner.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def segments(rows: Sequence[Sequence[tuple[int, Sequence[int]]]], width: int) -> Tensor:
    """(N, 1, 2, width) int64: for each row of groups (prompt length, response lengths) end to
    end, each position's group in the row and its segment (0 prompt, j response j; -1 both on
    padding)."""
    out = torch.full((len(rows), 1, 2, width), -1, dtype=torch.long)
    for n, row in enumerate(rows):
        group: list[int] = []
        segment: list[int] = []
        for g, (prompt_len, lens) in enumerate(row):
            group += [g] * (prompt_len + sum(lens))
            segment += [0] * prompt_len + [j + 1 for j, r in enumerate(lens) for _ in range(r)]
        out[n, 0, 0, : len(group)] = torch.tensor(group, dtype=torch.long)
        out[n, 0, 1, : len(segment)] = torch.tensor(segment, dtype=torch.long)
    return out


def is_segments(mask: object) -> bool:
    return (
        isinstance(mask, Tensor)
        and mask.dtype == torch.long
        and mask.dim() == 4
        and mask.shape[1] == 1
        and mask.shape[2] == 2
    )


def _runs(group: list[int]) -> list[tuple[int, int, int]]:
    """(group id, start, end) of each run of equal ids."""
    runs, start = [], 0
    for i in range(1, len(group) + 1):
        if i == len(group) or group[i] != group[start]:
            runs.append((group[start], start, i))
            start = i
    return runs


def by_segments(module, query: Tensor, key: Tensor, value: Tensor, mask: Tensor, **kwargs):
    """Attention of a packed batch: (B, L, H, D) and no weights, as transformers' functions."""
    kwargs.pop("is_causal", None)
    rows = []
    for b in range(query.shape[0]):
        pieces = []
        for group, start, end in _runs(mask[b, 0, 0].tolist()):
            if group < 0:  # padding: attends to nothing, reads zeros
                shape = (1, end - start, query.shape[1], value.shape[-1])
                pieces.append(query.new_zeros(shape))
                continue
            one = (query[b : b + 1], key[b : b + 1], value[b : b + 1])
            pieces += _group(module, one, start, mask[b, 0, 1, start:end], kwargs)
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows, dim=0), None


def _group(module, qkv: tuple[Tensor, Tensor, Tensor], start: int, seg: Tensor, kwargs: dict):
    """One group's attention outputs, (1, n, H, D) pieces in order: in one call under its
    shared-prompt mask, or, where that mask would be mostly blocked (long responses), its prompt
    and then each response against [prompt | itself], which skips the blocks between responses."""
    n = len(seg)
    spans = _runs(seg.tolist())  # (segment, start, end): the prompt first, then each response
    prompt = spans[0][2] if spans[0][0] == 0 else 0
    apart = prompt * prompt + sum((e - a) * (prompt + e - a) for j, a, e in spans if j > 0)
    device = seg.device
    if n < 512 or 2 * apart >= n * n:
        pos = torch.arange(n, device=device)
        causal = pos[None, :] <= pos[:, None]  # (n, n) [q, k]
        visible = (seg[None, :] == 0) | (seg[None, :] == seg[:, None])  # (n, n)
        return [_attend(module, qkv, start, start + n, None, causal & visible, kwargs)]
    pieces = []
    for j, a, e in spans:
        r = e - a
        causal = torch.ones(r, r, dtype=torch.bool, device=device).tril()  # (r, r)
        if j == 0:
            pieces.append(_attend(module, qkv, start + a, start + e, None, causal, kwargs))
            continue
        allowed = torch.cat([causal.new_ones(r, prompt), causal], dim=1)  # (r, P + r)
        keys = (start, start + prompt)
        pieces.append(_attend(module, qkv, start + a, start + e, keys, allowed, kwargs))
    return pieces


def _attend(module, qkv, a: int, e: int, prefix: tuple[int, int] | None, allowed, kwargs):
    """Queries [a, e) against keys [a, e), after `prefix`'s keys if given, under `allowed`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    query, key, value = qkv
    k, v = key[:, :, a:e], value[:, :, a:e]
    if prefix is not None:
        k = torch.cat([key[:, :, prefix[0] : prefix[1]], k], dim=2)
        v = torch.cat([value[:, :, prefix[0] : prefix[1]], v], dim=2)
    out, _ = sdpa_attention_forward(
        module, query[:, :, a:e], k, v, allowed[None, None], is_causal=False, **kwargs
    )
    return out  # (1, e - a, H, D)


def _wrapped(original: Callable) -> Callable:
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if is_segments(attention_mask):
            return by_segments(module, query, key, value, attention_mask, **kwargs)
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    attention.segmented = True  # type: ignore[attr-defined]
    return attention


def install() -> None:
    """Wrap transformers' registered attention functions (once per process)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name in (
        "sdpa",
        "flash_attention_2",
        "flash_attention_3",
        "flash_attention_4",
        "flex_attention",
    ):
        original = ALL_ATTENTION_FUNCTIONS.get(name)
        if original is not None and not getattr(original, "segmented", False):
            AttentionInterface.register(name, _wrapped(original))
