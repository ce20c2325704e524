"""Rollout correction: importance weights and rejection masks for the gap between the policy that
sampled a token (the engine's behaviour log-probs) and the learner's policy.

The engine that samples is never exactly the learner: it may hold older weights (off-policy
groups), and even with the same weights it computes with other kernels, batch shapes and
precision. With rho_t = pi_target(y_t) / pi_behaviour(y_t), the target being the learner's
proximal policy (its old log-probs, "decoupled") or the policy itself ("bypass"; see
`AlgoParams.correction_proximal`), each mode turns rho into a weight w_t that multiplies the
token's policy-gradient term:

Read on: docs/corrections.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

_LEVELS = {
    "none": "token",
    "token_truncate": "token",
    "token_mask": "token",
    "icepop": "token",
    "sequence_truncate": "sequence",
    "sequence_mask": "sequence",
    "geometric_mask": "geometric",
}
TRUNCATE_MODES = frozenset({"token_truncate", "sequence_truncate"})
_MASK_MODES = frozenset({"token_mask", "sequence_mask", "icepop"})
SAFETY_BOUND = 20.0  # |log-ratio| bound before exp(), as losses.LOG_RATIO_CLAMP

# Sums the loss returns for the learner to add over a step's micro-batches (and ranks) ...
CORRECTION_SUMS = (
    "rollout_is_sum",
    "rollout_is_sq_sum",
    "rollout_rs_masked_tokens",
    "k3_kl_sum",
    "log_ppl_abs_diff_sum",
    "num_correction_tokens",
    "num_correction_seqs",
)
# ... and largest values it keeps the largest of (the smallest rho as the largest 1 / rho, so
# that 0 is neutral for both: an empty or idle micro-batch reports 0).
CORRECTION_MAXIMA = ("rollout_is_max", "rollout_is_inv_min")
# Figures of a step; over an iteration's steps the largest and smallest are kept, not averaged.
CORRECTION_FIGURES = (
    "rollout_is_mean",
    "rollout_is_min",
    "rollout_is_max",
    "rollout_is_eff_sample_size",
    "rollout_rs_masked_fraction",
    "log_ppl_abs_diff",
    "k3_kl",
)
LARGEST_FIGURES = ("rollout_is_max",)
SMALLEST_FIGURES = ("rollout_is_min",)


@dataclass
class Correction:
    """What a mode makes of one micro-batch's log-ratios, all (B, T)."""

    ratio: Tensor  # rho at the mode's level (token, sequence or geometric), clamped; 1 on padding
    weights: Tensor  # w: the factor on each token's policy-gradient term; 1 on padding
    rejected: Tensor  # bool: tokens a mask mode set to weight 0
    truncated: Tensor  # bool: tokens whose weight a truncate mode clipped


def level_ratio(log_ratio: Tensor, loss_mask: Tensor, level: str) -> Tensor:
    """rho at `level`: exp(log rho_t) per token ("token"), the sequence's product
    exp(sum_t log rho_t) ("sequence") or geometric mean exp(mean_t log rho_t) ("geometric"),
    sums and means over `loss_mask` tokens; log-ratios clamped to [-20, 20] before exp().
    A sequence's value is given to each of its tokens; 1 on padding."""
    mask = loss_mask != 0  # (B, T)
    log_ratio = torch.where(mask, log_ratio, 0.0)  # (B, T)
    if level == "token":
        per_token = log_ratio  # (B, T)
    else:
        per_seq = log_ratio.sum(-1, keepdim=True)  # (B, 1)
        if level == "geometric":
            per_seq = per_seq / mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
        per_token = per_seq.expand_as(log_ratio)  # (B, T)
    ratio = torch.exp(per_token.clamp(-SAFETY_BOUND, SAFETY_BOUND))  # (B, T)
    return torch.where(mask, ratio, 1.0)


def correction_weights(
    log_ratio: Tensor, loss_mask: Tensor, mode: str, clip_min: float, clip_max: float
) -> Correction:
    """The weights of `mode` (module docstring) for log_ratio = log pi_target - log
    pi_behaviour (B, T), detached; band [clip_min, clip_max], both ends included."""
    if mode not in _LEVELS:
        raise ValueError(f"unknown rollout_correction {mode!r}; allowed: {', '.join(_LEVELS)}")
    mask = loss_mask != 0  # (B, T)
    rho = level_ratio(log_ratio.detach(), mask, _LEVELS[mode])  # (B, T)
    outside = mask & ((rho < clip_min) | (rho > clip_max))  # (B, T)
    nothing = torch.zeros_like(mask)  # (B, T)
    if mode in TRUNCATE_MODES:
        return Correction(rho, rho.clamp(clip_min, clip_max), nothing, outside)
    if mode in _MASK_MODES:
        return Correction(rho, torch.where(outside, 0.0, rho), outside, nothing)
    if mode == "geometric_mask":
        return Correction(rho, torch.where(outside, 0.0, 1.0), outside, nothing)
    return Correction(rho, torch.ones_like(rho), nothing, nothing)  # none


def correction_sums(corr: Correction, log_ratio: Tensor, loss_mask: Tensor) -> dict[str, Tensor]:
    """One micro-batch's `CORRECTION_SUMS` and `CORRECTION_MAXIMA` (scalars) over its `loss_mask`
    tokens, from the mode's `corr` and log_ratio = log pi_target - log pi_behaviour (B, T)."""
    mask = loss_mask != 0  # (B, T)
    log_ratio = torch.where(mask, log_ratio.detach(), 0.0).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    rho = torch.where(mask, corr.ratio, 0.0)  # (B, T)
    inv = torch.where(mask, 1.0 / corr.ratio, 0.0)  # (B, T) corr.ratio >= e^-20: finite
    k3 = torch.exp(log_ratio) - 1.0 - log_ratio  # (B, T) 0 on padding
    lengths = mask.sum(-1)  # (B,)
    # |mean_t log pi_behaviour - mean_t log pi_target| of each response with a loss token
    log_ppl_diff = log_ratio.sum(-1).abs() / lengths.clamp(min=1)  # (B,)
    zero = rho.new_zeros(())
    return {
        "rollout_is_sum": rho.sum(),
        "rollout_is_sq_sum": (rho * rho).sum(),
        "rollout_is_max": rho.max() if rho.numel() else zero,
        "rollout_is_inv_min": inv.max() if inv.numel() else zero,
        "rollout_rs_masked_tokens": (corr.rejected & mask).sum().to(rho.dtype),
        "k3_kl_sum": k3.sum(),
        "log_ppl_abs_diff_sum": log_ppl_diff.sum(),
        "num_correction_tokens": mask.sum().to(rho.dtype),
        "num_correction_seqs": (lengths > 0).sum().to(rho.dtype),
    }


def correction_figures(sums: Mapping[str, float], maxima: Mapping[str, float]) -> dict[str, float]:
    """verl's figures from a step's summed `CORRECTION_SUMS` and `CORRECTION_MAXIMA`, over the
    step's n loss tokens (all 0 when n = 0):

      rollout_is_mean             (1/n) sum_t rho_t: rho at the mode's level, before truncation or
                                  masking (verl's token-level definition; a sequence's rho counts
                                  once per token, as verl's masked mean does)
      rollout_is_min, _max        the smallest and largest rho_t
      rollout_is_eff_sample_size  (sum_t rho_t)^2 / (n sum_t rho_t^2) = 1 / mean((rho/mean rho)^2),
                                  verl's normalised ESS, in (0, 1], 1 when all rho are equal
                                  (verl clamps rho to [1/C, C] first; here rho is as the mode
                                  sees it, before truncation)
      rollout_rs_masked_fraction  tokens a mask mode set to weight 0, over n
      k3_kl                       (1/n) sum_t (exp(r_t) - 1 - r_t), r_t = log pi_target - log
                                  pi_behaviour: KL(pi_behaviour || pi_target) estimated on the
                                  engine's samples (verl's k3_kl)
      log_ppl_abs_diff            mean over responses with a loss token of |mean_t log pi_behaviour
                                  - mean_t log pi_target| (verl's: the gap in log-perplexity)
    """
    n, seqs = sums["num_correction_tokens"], sums["num_correction_seqs"]
    if n == 0:
        return dict.fromkeys(CORRECTION_FIGURES, 0.0)
    total, squares = sums["rollout_is_sum"], sums["rollout_is_sq_sum"]
    inv_min = maxima["rollout_is_inv_min"]
    return {
        "rollout_is_mean": total / n,
        "rollout_is_min": 1.0 / inv_min if inv_min > 0 else 0.0,
        "rollout_is_max": maxima["rollout_is_max"],
        # <= 1 by Cauchy-Schwarz; sums taken in another order can make equal ratios 1 + 1e-14
        "rollout_is_eff_sample_size": min(total * total / (n * squares), 1.0)
        if squares > 0
        else 0.0,
        "rollout_rs_masked_fraction": sums["rollout_rs_masked_tokens"] / n,
        "log_ppl_abs_diff": sums["log_ppl_abs_diff_sum"] / max(seqs, 1.0),
        "k3_kl": sums["k3_kl_sum"] / n,
    }


def tis_weights(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, loss_mask: Tensor, cap: float
) -> tuple[Tensor, Tensor]:
    """Truncated importance weights min(pi_old / pi_behaviour, cap) per token, and where they cut:
    `token_truncate` with band [0, cap] (Ionides 2008; Yao et al. 2025's TIS). 1 on padding."""
    log_ratio = old_logprobs.detach() - behaviour_logprobs  # (B, T)
    corr = correction_weights(log_ratio, loss_mask, "token_truncate", 0.0, cap)
    return corr.weights, corr.truncated  # (B, T), (B, T)
