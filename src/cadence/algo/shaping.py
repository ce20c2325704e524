"""Reward shaping that depends on the response, not on what it says: DAPO's overlong penalty.

A pure function of response lengths; the learner adds it to each response's reward before the
advantages are computed (learner/batch.py), so it is the same whichever process scored the
reward, and the reward recorded with the sample stays the raw score.
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int, penalty: float) -> Tensor:
    """Soft overlong punishment per response: 0 up to the buffer, then linear down to -penalty.

    DAPO (Yu et al. 2025, arXiv 2503.14476, Sec. 3.4, eq. 13) with L_max = `max_new_tokens` and
    L_cache = `buffer`, scaled by `penalty` (verl's `overlong_buffer.penalty_factor`):
      R_length(y) = 0                                     if |y| <= L_max - L_cache
                  = ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
                  = -1                                    if |y| > L_max
    times `penalty`. A response cut at `max_new_tokens` gets -penalty, one `buffer / 2` tokens into
    the buffer -penalty / 2. `lengths` are the tokens the policy wrote (EOS included when emitted;
    a multi-turn episode's tool replies excluded), any shape; `max_new_tokens` is the cap on them
    (a multi-turn episode's, not one turn's); `buffer` = 0 turns the penalty off (all zeros).
    """
    if buffer < 0 or buffer > max_new_tokens:
        raise ValueError(
            f"overlong buffer must be in [0, max_new_tokens = {max_new_tokens}]; got {buffer}"
        )
    if buffer == 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    expected = max_new_tokens - buffer  # the longest response that is not penalised
    over = (lengths.to(torch.float32) - expected).clamp(min=0.0)  # tokens into the buffer
    return -penalty * torch.clamp(over / buffer, max=1.0)
