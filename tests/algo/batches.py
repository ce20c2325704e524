"""Builders of the small hand-worked batches the loss tests share."""

import math

import torch

from cadence.algo.aggregation import token_weights
from cadence.algo.losses import PolicyBatch

LN2 = math.log(2.0)
LN3 = math.log(3.0)


def make_batch(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    mode: str = "token-mean",
) -> PolicyBatch:
    """On-policy batch (old == logprobs) unless told otherwise; all tokens valid by default."""
    logprobs = logprobs.clone().requires_grad_(True)
    mask = torch.ones_like(logprobs) if loss_mask is None else loss_mask
    old = logprobs.detach().clone() if old_logprobs is None else old_logprobs
    return PolicyBatch(
        logprobs=logprobs,
        old_logprobs=old,
        advantages=advantages,
        loss_mask=mask,
        token_weights=token_weights(mask, mode),
        ref_logprobs=ref_logprobs,
    )
