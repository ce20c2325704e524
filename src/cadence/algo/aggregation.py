"""Loss aggregation: per-token weights of a micro-batch and the global batch's normaliser.

A loss is a weighted sum over a micro-batch's tokens (`token_weights`); the learner divides the
summed gradients by `normaliser` once the whole global batch is in, so the update does not depend
on how the batch was split. Pure functions of masks and counts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cadence.choices import LOSS_AGGREGATIONS

AGG_MODES = LOSS_AGGREGATIONS


def _check_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; allowed: {', '.join(AGG_MODES)}")


def token_weights(loss_mask: Tensor, mode: str) -> Tensor:
    """Per-token loss weights of one micro-batch for aggregation `mode`; 0 on masked tokens.

    token-mean:   1 per valid token (DAPO's token-level loss, arXiv 2503.14476, Sec. 3.3).
    seq-mean:     1/len_i on each token of sequence i (GRPO, arXiv 2402.03300, eq. 3: 1/|o_i|).
    seq-sum-norm: 1 per valid token; the constant normaliser does the rest (Dr. GRPO,
                  arXiv 2503.20783, which removes GRPO's 1/|o_i| length bias).
    """
    _check_mode(mode)
    mask = loss_mask.to(torch.float32)  # (B, T)
    if mode != "seq-mean":
        return mask
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # (B, 1)
    return mask / lengths  # (B, T)


def normaliser(mode: str, num_tokens: int, num_seqs: int, max_new_tokens: int) -> float:
    """Global-batch divisor for `mode`: full loss = sum(token_loss * token_weights) / normaliser.

    token-mean: valid tokens in the global batch; seq-mean: sequences in it; seq-sum-norm:
    num_seqs * max_new_tokens, a constant that does not depend on response lengths (Dr. GRPO,
    Liu et al. 2025, arXiv 2503.20783); `max_new_tokens` is the cap on the tokens the policy
    writes in one response (a multi-turn episode's cap, not one turn's). Under seq-mean (and
    seq-sum-norm) an empty response, one with no valid token, still counts in num_seqs: it adds
    0 to the sum and 1 to the divisor (TRL's convention; verl leaves it out of the count).
    """
    _check_mode(mode)
    if mode == "token-mean":
        value, what = num_tokens, f"num_tokens={num_tokens}"
    elif mode == "seq-mean":
        value, what = num_seqs, f"num_seqs={num_seqs}"
    else:
        value = num_seqs * max_new_tokens
        what = f"num_seqs * max_new_tokens = {num_seqs} * {max_new_tokens}"
    if value <= 0:
        raise ValueError(f"{mode} normaliser must be > 0; got {what}")
    return float(value)
