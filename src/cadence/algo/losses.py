"""Policy losses, the KL penalty and loss aggregation, as pure functions of tensors.

A loss returns `(loss, metrics)` where `loss` is the weighted SUM of per-token losses over one
micro-batch, not a mean. Aggregation is split in two: `token_weights` is known per micro-batch,
`normaliser` only once the whole global batch is in. The learner sums micro-batch gradients and
divides by the normaliser at step time, so streaming micro-batches gives the same update as one
big batch. Metrics are weighted sums with the same weights, to be normalised the same way.

Padding is masked by selection (`torch.where`), never by multiplying with zero, so a padded
position holding a huge or infinite log-prob cannot turn the loss or its gradient into NaN.
This module must not know about models, optimisers or configs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

AGG_MODES = ("token-mean", "seq-mean", "seq-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass(frozen=True)
class LossParams:
    """Hyper-parameters shared by the policy losses."""

    clip_low: float = 0.2  # ratio floor is 1 - clip_low
    clip_high: float = 0.2  # ratio ceiling is 1 + clip_high (DAPO's clip-higher raises it alone)
    kl_coef: float = 0.0  # weight of the per-token KL(pi || ref) penalty; 0 turns it off
    kl_estimator: str = "k3"  # one of KL_ESTIMATORS

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"clip_low must be in [0, 1); got {self.clip_low}")
        if self.clip_high < 0.0:
            raise ValueError(f"clip_high must be >= 0; got {self.clip_high}")
        if self.kl_coef < 0.0:
            raise ValueError(f"kl_coef must be >= 0; got {self.kl_coef}")
        _check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)


@dataclass
class PolicyBatch:
    """One micro-batch of B responses padded to T tokens, as the losses see it."""

    logprobs: Tensor  # (B, T) under the policy being trained, with grad
    old_logprobs: Tensor  # (B, T) under the policy that sampled the tokens
    advantages: Tensor  # (B,) one per sequence
    loss_mask: Tensor  # (B, T) 1/True on response tokens, 0/False on prompt and padding
    token_weights: Tensor  # (B, T) from `token_weights(loss_mask, mode)`
    ref_logprobs: Tensor | None = None  # (B, T) under the frozen reference policy

    def __post_init__(self) -> None:
        shape = self.logprobs.shape
        if len(shape) != 2:
            raise ValueError(f"logprobs must have shape (B, T); got {tuple(shape)}")
        for name in ("old_logprobs", "loss_mask", "token_weights", "ref_logprobs"):
            value = getattr(self, name)
            if value is not None and value.shape != shape:
                raise ValueError(f"{name} must have shape {tuple(shape)}; got {tuple(value.shape)}")
        if self.advantages.shape != shape[:1]:
            raise ValueError(
                f"advantages must have shape ({shape[0]},), one per sequence; "
                f"got {tuple(self.advantages.shape)}"
            )


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(allowed)}")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi || ref) from log-probs of tokens sampled from pi.

    Schulman 2020, "Approximating KL Divergence" (blog), with log_ratio = log pi - log ref and
    r = ref / pi = exp(-log_ratio):
      k1 = log_ratio                    unbiased, high variance, can be negative
      k2 = 0.5 * log_ratio**2           biased, low variance, >= 0
      k3 = r - 1 - log r                unbiased, low variance, >= 0 (GRPO's choice, eq. 4 of
                                        DeepSeekMath, arXiv 2402.03300)
    """
    _check_choice("kl_estimator", estimator, KL_ESTIMATORS)
    return _kl_from_log_ratio(logprobs - ref_logprobs, estimator)  # (B, T)


def _kl_from_log_ratio(log_ratio: Tensor, estimator: str) -> Tensor:
    if estimator == "k1":
        return log_ratio  # (B, T)
    if estimator == "k2":
        return 0.5 * log_ratio**2  # (B, T)
    return torch.exp(-log_ratio) - 1.0 + log_ratio  # (B, T)


def _masked_log_ratio(a: Tensor, b: Tensor, mask: Tensor) -> Tensor:
    # Zero on padding before any exp(), so exp cannot overflow there and backward stays finite.
    return torch.where(mask, a - b, 0.0)  # (B, T)


def _weighted_sum(values: Tensor, weights: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, values * weights, 0.0).sum()  # ()


def _finish(
    pg_per_token: Tensor, ratio: Tensor, is_clipped: Tensor, batch: PolicyBatch, params: LossParams
) -> tuple[Tensor, dict[str, Tensor]]:
    """Adds the optional KL term, reduces to weighted sums and builds the metrics."""
    mask = batch.loss_mask != 0  # (B, T)
    weights = batch.token_weights * batch.loss_mask  # (B, T)
    if params.kl_coef > 0 and batch.ref_logprobs is None:
        raise ValueError(f"kl_coef={params.kl_coef} > 0 needs ref_logprobs; got None")
    per_token = pg_per_token  # (B, T)
    kl_sum = torch.zeros((), device=pg_per_token.device)
    if batch.ref_logprobs is not None:
        log_ratio = _masked_log_ratio(batch.logprobs, batch.ref_logprobs, mask)  # (B, T)
        kl = _kl_from_log_ratio(log_ratio, params.kl_estimator)  # (B, T)
        kl_sum = _weighted_sum(kl.detach(), weights, mask)
        if params.kl_coef > 0:
            per_token = per_token + params.kl_coef * kl  # (B, T)
    metrics = {
        "pg_loss": _weighted_sum(pg_per_token.detach(), weights, mask),
        "kl": kl_sum,
        "clip_frac": _weighted_sum(is_clipped.to(weights.dtype), weights, mask),
        "ratio": _weighted_sum(ratio.detach(), weights, mask),
    }
    return _weighted_sum(per_token, weights, mask), metrics


def ppo_clip_loss(batch: PolicyBatch, params: LossParams) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate policy loss, per token, as a weighted sum.

    PPO (Schulman et al. 2017, arXiv 1707.06347, eq. 7), negated to be minimised:
      loss_t = -min(ratio_t * A, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A),
      ratio_t = exp(logprobs_t - old_logprobs_t),
    with separate lower and upper clip bounds ("clip-higher", DAPO, arXiv 2503.14476, Sec. 3.1),
    plus kl_coef * KL_t when kl_coef > 0 (the per-token KL term of GRPO, arXiv 2402.03300, eq. 3).
    Returns sum_t(loss_t * token_weights_t * loss_mask_t), not normalised. `clip_frac` sums the
    weights of tokens where the clipped term was the smaller one, i.e. where clipping cut the
    gradient off.
    """
    mask = batch.loss_mask != 0  # (B, T)
    ratio = torch.exp(_masked_log_ratio(batch.logprobs, batch.old_logprobs, mask))  # (B, T)
    adv = batch.advantages.unsqueeze(-1)  # (B, 1)
    unclipped = ratio * adv  # (B, T)
    clipped = ratio.clamp(1.0 - params.clip_low, 1.0 + params.clip_high) * adv  # (B, T)
    pg_per_token = -torch.minimum(unclipped, clipped)  # (B, T)
    return _finish(pg_per_token, ratio, clipped < unclipped, batch, params)


def pg_loss(batch: PolicyBatch, params: LossParams) -> tuple[Tensor, dict[str, Tensor]]:
    """Vanilla policy-gradient loss, per token, as a weighted sum.

    REINFORCE (Williams 1992): loss_t = -A * logprobs_t, whose gradient is -A * grad log pi_t;
    plus kl_coef * KL_t when kl_coef > 0. Only valid on-policy (old == current policy): nothing
    corrects for stale samples. Same return convention as `ppo_clip_loss`; `clip_frac` is 0 and
    `ratio` reports exp(logprobs - old_logprobs) to show how off-policy the batch was.
    """
    mask = batch.loss_mask != 0  # (B, T)
    ratio = torch.exp(_masked_log_ratio(batch.logprobs, batch.old_logprobs, mask))  # (B, T)
    adv = batch.advantages.unsqueeze(-1)  # (B, 1)
    pg_per_token = -adv * batch.logprobs  # (B, T)
    return _finish(pg_per_token, ratio, torch.zeros_like(mask), batch, params)


def token_weights(loss_mask: Tensor, mode: str) -> Tensor:
    """Per-token loss weights of one micro-batch for aggregation `mode`; 0 on masked tokens.

    token-mean:   1 per valid token (DAPO's token-level loss, arXiv 2503.14476, Sec. 3.3).
    seq-mean:     1/len_i on each token of sequence i (GRPO, arXiv 2402.03300, eq. 3: 1/|o_i|).
    seq-sum-norm: 1 per valid token; the constant normaliser does the rest (Dr. GRPO,
                  arXiv 2503.20783, which removes GRPO's 1/|o_i| length bias).
    """
    _check_choice("loss aggregation mode", mode, AGG_MODES)
    mask = loss_mask.to(torch.float32)  # (B, T)
    if mode != "seq-mean":
        return mask
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # (B, 1)
    return mask / lengths  # (B, T)


def normaliser(mode: str, num_tokens: int, num_seqs: int, max_new_tokens: int) -> float:
    """Global-batch divisor for `mode`: full loss = sum(token_loss * token_weights) / normaliser.

    token-mean: valid tokens in the global batch; seq-mean: sequences in it; seq-sum-norm:
    num_seqs * max_new_tokens, a constant that does not depend on response lengths (Dr. GRPO,
    Liu et al. 2025, arXiv 2503.20783).
    """
    _check_choice("loss aggregation mode", mode, AGG_MODES)
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
