"""Policy losses and the KL penalty, as pure functions (aggregation.py: weights; dpo.py: DPO).

Policy-gradient losses may read `behaviour_logprobs` (what the inference engine recorded when it
sampled) for the rollout correction (`algo.rollout_correction`, correction.py), which multiplies
each token's policy-gradient term (not the KL term) by a weight; `rloo_loss` reads each
response's reward and group.
This module must not know about models, optimisers or configs.

Read on: docs/algorithms.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from cadence.algo.advantages import rloo_advantages
from cadence.algo.correction import TRUNCATE_MODES, correction_sums, correction_weights
from cadence.algo.params import KL_ESTIMATORS, AlgoParams, check_choice

# Metrics that are counts, summed over a step (online DPO's).
COUNT_METRICS = ("num_pairs", "dpo_ties")
# Metrics that are numbers of tokens, divided by the step's response tokens whatever the
# aggregation mode; every other metric is divided by the same normaliser as the loss.
TOKEN_METRICS = (
    "clip_frac",
    "dual_clip_frac",
    "tis_trunc_frac",
    "ratio_clamped_frac",
    "kl_clamped_frac",
)
LOG_RATIO_CLAMP = 20.0  # |log-ratio| bound before exp(): exp(20) = 4.85e8


@dataclass
class PolicyBatch:
    """One micro-batch of B responses padded to T tokens, as the losses see it."""

    logprobs: Tensor  # (B, T) under the policy being trained, with grad
    old_logprobs: Tensor  # (B, T) the ratio's denominator: the sampling (or, TIS, proximal) policy
    advantages: Tensor  # (B,) one per sequence, or (B, T) one per token (distillation)
    loss_mask: Tensor  # (B, T) 1/True on response tokens, 0/False on prompt and padding
    token_weights: Tensor  # (B, T) from `token_weights(loss_mask, mode)`
    ref_logprobs: Tensor | None = None  # (B, T) under the frozen reference policy
    behaviour_logprobs: Tensor | None = None  # (B, T) recorded by the engine at sampling time
    rewards: Tensor | None = None  # (B,) each response's reward
    group_ids: Tensor | None = None  # (B,) each response's group; a group's rows are consecutive

    def __post_init__(self) -> None:
        shape = self.logprobs.shape
        if len(shape) != 2:
            raise ValueError(f"logprobs must have shape (B, T); got {tuple(shape)}")
        per_token = ("old_logprobs", "loss_mask", "token_weights", "ref_logprobs")
        for name in (*per_token, "behaviour_logprobs"):
            value = getattr(self, name)
            if value is not None and value.shape != shape:
                raise ValueError(f"{name} must have shape {tuple(shape)}; got {tuple(value.shape)}")
        if self.advantages is not None and self.advantages.shape == shape:
            pass  # per token: policy-gradient losses only (`token_advantages`)
        elif self.advantages is not None and self.advantages.shape != shape[:1]:
            raise ValueError(
                f"advantages must have shape ({shape[0]},) or {tuple(shape)}; "
                f"got {tuple(self.advantages.shape)}"
            )
        for name in ("rewards", "group_ids"):
            value = getattr(self, name)
            if value is not None and value.shape != shape[:1]:
                raise ValueError(
                    f"{name} must have shape ({shape[0]},), one per sequence; "
                    f"got {tuple(value.shape)}"
                )


def token_advantages(batch: PolicyBatch) -> Tensor:
    """The advantages as the per-token losses read them: (B, 1) for one per sequence, (B, T) as
    given for one per token."""
    adv = batch.advantages
    return adv if adv.dim() == 2 else adv.unsqueeze(-1)


def _sequence_advantages(batch: PolicyBatch) -> Tensor:
    if batch.advantages.dim() != 1:
        raise ValueError("this loss reads one advantage per sequence, not one per token")
    return batch.advantages


def _clamped_exp(log_ratio: Tensor) -> tuple[Tensor, Tensor]:
    """exp(log_ratio) with log_ratio clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP], and where
    the clamp cut (True). The gradient is zero where it cut."""
    clamped = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # same shape
    return torch.exp(clamped), clamped != log_ratio


def kl_penalty(
    logprobs: Tensor, ref_logprobs: Tensor, estimator: str, clamp: float = 0.0
) -> Tensor:
    """Per-token estimate of KL(pi || ref) from log-probs of tokens sampled from pi.

    Schulman 2020, "Approximating KL Divergence" (blog), with log_ratio = log pi - log ref and
    r = ref / pi = exp(-log_ratio):
      k1 = log_ratio                    unbiased, high variance, can be negative
      k2 = 0.5 * log_ratio**2           biased, low variance, >= 0
      k3 = r - 1 - log r                unbiased, low variance, >= 0 (GRPO's choice, eq. 4 of
                                        DeepSeekMath, arXiv 2402.03300)
    k3 is computed with log_ratio clamped to [-20, 20], so it is at most e^20 - 21 = 4.85e8 and
    finite, with zero gradient beyond the clamp. `clamp` > 0 also caps k3 at that value (verl
    caps it at 10, which k3 reaches at log_ratio = -2.6 or 11), with zero gradient beyond.
    """
    check_choice("kl_estimator", estimator, KL_ESTIMATORS)
    return _kl_from_log_ratio(logprobs - ref_logprobs, estimator, clamp)[0]  # (B, T)


def _kl_from_log_ratio(
    log_ratio: Tensor, estimator: str, clamp: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The estimate, where its log-ratio was clamped, where k3 was capped (all (B, T))."""
    untouched = torch.zeros_like(log_ratio, dtype=torch.bool)  # (B, T)
    if estimator == "k1":
        return log_ratio, untouched, untouched  # (B, T)
    if estimator == "k2":
        return 0.5 * log_ratio**2, untouched, untouched  # (B, T)
    log_r = (-log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T) log(ref / pi)
    k3 = torch.exp(log_r) - 1.0 - log_r  # (B, T)
    if clamp == 0:
        return k3, log_r != -log_ratio, untouched
    return k3.clamp(max=clamp), log_r != -log_ratio, k3 > clamp


def _masked_log_ratio(a: Tensor, b: Tensor, mask: Tensor) -> Tensor:
    # Zero on padding before any exp(), so exp cannot overflow there and backward stays finite.
    return torch.where(mask, a - b, 0.0)  # (B, T)


def _weighted_sum(values: Tensor, weights: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, values * weights, 0.0).sum()  # ()


def _count(flags: Tensor, mask: Tensor) -> Tensor:
    """Number of valid tokens where `flags` holds, as a float (a `TOKEN_METRICS` numerator)."""
    return (flags & mask).sum().to(torch.float32)  # ()


@dataclass
class _Terms:
    """What a policy-gradient loss hands to `_finish`, all (B, T)."""

    pg_per_token: Tensor  # the policy-gradient loss of each token, with grad
    ratio: Tensor  # the importance ratio it used (reported)
    clipped: Tensor  # bool: where clipping cut the ratio (`clip_frac`)
    clamped: Tensor  # bool: where the ratio's log was clamped (`ratio_clamped_frac`)
    ratio_in_loss: bool = True  # whether pg_per_token holds pi / pi_old (params.RATIO_LOSSES)


def _corrected(
    terms: _Terms, batch: PolicyBatch, params: AlgoParams
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy-gradient term times the rollout correction's factor, and its metrics.

    Decoupled: the mode's weights of pi_old / pi_behaviour. Bypass (old_logprobs are the
    behaviour ones): the mode acts on pi / pi_behaviour, the policy's log-probs detached (verl's
    bypass); a loss whose term holds the ratio pi / pi_old takes only the mode's mask, since that
    ratio already is the importance weight (verl: "would be double-counting"), a loss without
    one (pg, rloo) the whole weight. Metrics: `CORRECTION_SUMS` and `CORRECTION_MAXIMA`, and
    `tis_weight` (the factor, weighted like the loss) and `tis_trunc_frac` (tokens a truncate
    mode clipped), as `tis_cap` reported them.
    """
    if not params.corrects:
        return terms.pg_per_token, {}
    mode = params.rollout_correction
    if batch.behaviour_logprobs is None:
        raise ValueError(f"rollout_correction={mode!r} needs behaviour_logprobs; got None")
    bypass = params.correction_proximal == "bypass"
    if bypass and terms.ratio_in_loss and mode in TRUNCATE_MODES:
        raise ValueError(f"{mode!r} with the bypass adds nothing to a loss with a ratio")
    mask = batch.loss_mask != 0  # (B, T)
    target = batch.logprobs if bypass else batch.old_logprobs  # (B, T)
    log_ratio = _masked_log_ratio(target.detach(), batch.behaviour_logprobs, mask)  # (B, T)
    corr = correction_weights(
        log_ratio, mask, mode, params.correction_clip_min, params.correction_clip_max
    )
    factor = corr.weights  # (B, T)
    if bypass and terms.ratio_in_loss:
        factor = torch.where(corr.rejected, 0.0, 1.0)  # (B, T)
    weights = batch.token_weights * batch.loss_mask  # (B, T)
    metrics = correction_sums(corr, log_ratio, mask) | {
        "tis_weight": _weighted_sum(factor, weights, mask),
        "tis_trunc_frac": _count(corr.truncated, mask),
    }
    return factor * terms.pg_per_token, metrics  # (B, T)


def _kl_term(
    batch: PolicyBatch, params: AlgoParams
) -> tuple[Tensor | None, Tensor, dict[str, Tensor]]:
    """The per-token KL to the reference (with grad; None without ref_logprobs), where its
    log-ratio was clamped, and its metrics."""
    mask = batch.loss_mask != 0  # (B, T)
    if params.kl_coef > 0 and batch.ref_logprobs is None:
        raise ValueError(f"kl_coef={params.kl_coef} > 0 needs ref_logprobs; got None")
    if batch.ref_logprobs is None:
        return None, torch.zeros_like(mask), {"kl": torch.zeros((), device=mask.device)}
    weights = batch.token_weights * batch.loss_mask  # (B, T)
    log_ratio = _masked_log_ratio(batch.logprobs, batch.ref_logprobs, mask)  # (B, T)
    kl, clamped, capped = _kl_from_log_ratio(log_ratio, params.kl_estimator, params.kl_clamp)
    metrics = {
        "kl": _weighted_sum(kl.detach(), weights, mask),
        "kl_clamped_frac": _count(capped, mask),
    }
    return kl, clamped, metrics


def _finish(
    terms: _Terms, batch: PolicyBatch, params: AlgoParams, extra: dict[str, Tensor] | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Applies the rollout correction, adds the optional KL term, reduces to weighted sums and
    builds the metrics."""
    mask = batch.loss_mask != 0  # (B, T)
    weights = batch.token_weights * batch.loss_mask  # (B, T)
    pg_per_token, tis_metrics = _corrected(terms, batch, params)  # (B, T)
    kl, kl_clamped, kl_metrics = _kl_term(batch, params)
    per_token = pg_per_token  # (B, T)
    if kl is not None and params.kl_coef > 0:
        per_token = per_token + params.kl_coef * kl  # (B, T)
    metrics = {
        "pg_loss": _weighted_sum(pg_per_token.detach(), weights, mask),
        "clip_frac": _count(terms.clipped, mask),
        "ratio": _weighted_sum(terms.ratio.detach(), weights, mask),
        "ratio_clamped_frac": _count(terms.clamped | kl_clamped, mask),
    }
    metrics = metrics | kl_metrics | tis_metrics | (extra or {})
    return _weighted_sum(per_token, weights, mask), metrics


def _policy_ratio(batch: PolicyBatch) -> tuple[Tensor, Tensor]:
    """pi / pi_old per token (log-ratio clamped, 1 on padding) and where the clamp cut."""
    mask = batch.loss_mask != 0  # (B, T)
    ratio, clamped = _clamped_exp(_masked_log_ratio(batch.logprobs, batch.old_logprobs, mask))
    return ratio, clamped  # (B, T), (B, T)


def ppo_clip_loss(batch: PolicyBatch, params: AlgoParams) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate policy loss, per token, as a weighted sum.

    PPO (Schulman et al. 2017, arXiv 1707.06347, eq. 7), negated to be minimised:
      loss_t = -min(ratio_t * A, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A),
      ratio_t = exp(logprobs_t - old_logprobs_t)   (log-ratio clamped to [-20, 20]),
    with separate lower and upper clip bounds ("clip-higher", DAPO, arXiv 2503.14476, Sec. 3.1),
    plus kl_coef * KL_t when kl_coef > 0 (the per-token KL term of GRPO, arXiv 2402.03300, eq. 3).
    Returns sum_t(loss_t * token_weights_t * loss_mask_t), not normalised. `clip_frac` counts the
    tokens where the clipped term was the smaller one, i.e. where clipping cut the gradient off.

    Dual-clip PPO (Ye et al. 2020, arXiv 1912.09729, eq. 5) with `clip_ratio_c` = c > 1: for
    A < 0 the loss is also capped, loss_t = min(loss_t, -c * A), so a token whose ratio has run
    far above 1 under a negative advantage has a bounded loss and no gradient. Counted in
    `dual_clip_frac`. verl applies it with c = 3 by default; here it is off unless set.

    With a `rollout_correction` (decoupled) each token's clipped term is multiplied by the mode's
    weight of pi_old_t / pi_behaviour_t (correction.py): old_logprobs are then the *proximal*
    policy (the policy at the iteration's start) that the trust region is drawn around, and the
    weight corrects for the samples having come from pi_behaviour. `token_truncate`,
    min(pi_old / pi_behaviour, C), is the TIS form of Yao et al. 2025 ("Your Efficient RL
    Framework Secretly Brings You Off-Policy RL Training", blog), which is also the decoupled PPO
    objective of AReaL (Fu et al. 2025, arXiv 2505.24298) with its behaviour weight truncated at
    C. With the bypass, old_logprobs are the behaviour ones and only the mode's mask applies.
    """
    ratio, clamped = _policy_ratio(batch)  # (B, T), (B, T)
    adv = token_advantages(batch)  # (B, 1) or (B, T)
    unclipped = ratio * adv  # (B, T)
    clipped = ratio.clamp(1.0 - params.clip_low, 1.0 + params.clip_high) * adv  # (B, T)
    pg_per_token = -torch.minimum(unclipped, clipped)  # (B, T)
    extra = {}
    if params.clip_ratio_c > 0:
        bound = (-params.clip_ratio_c * adv).expand_as(pg_per_token)  # (B, T)
        dual = (adv < 0) & (pg_per_token > bound)  # (B, T)
        pg_per_token = torch.where(dual, bound, pg_per_token)  # (B, T)
        extra["dual_clip_frac"] = _count(dual, batch.loss_mask != 0)
    terms = _Terms(pg_per_token, ratio, clipped < unclipped, clamped)
    return _finish(terms, batch, params, extra)


def pg_loss(batch: PolicyBatch, params: AlgoParams) -> tuple[Tensor, dict[str, Tensor]]:
    """Vanilla policy-gradient loss, per token, as a weighted sum.

    REINFORCE (Williams 1992): loss_t = -A * logprobs_t, whose gradient is -A * grad log pi_t;
    plus kl_coef * KL_t when kl_coef > 0. Only valid on-policy (old == current policy) unless a
    `rollout_correction` multiplies each term by the mode's importance weight of the sampled
    token: of pi_old / pi_behaviour (decoupled) or pi / pi_behaviour (bypass). Same return
    convention as `ppo_clip_loss`; `clip_frac` is 0 and `ratio` reports
    exp(logprobs - old_logprobs) to show how off-policy the batch was.
    """
    ratio, clamped = _policy_ratio(batch)  # (B, T), (B, T)
    adv = token_advantages(batch)  # (B, 1) or (B, T)
    pg_per_token = -adv * batch.logprobs  # (B, T)
    unclipped = torch.zeros_like(clamped)  # (B, T)
    return _finish(_Terms(pg_per_token, ratio, unclipped, clamped, False), batch, params)


def gspo_loss(batch: PolicyBatch, params: AlgoParams) -> tuple[Tensor, dict[str, Tensor]]:
    """Group Sequence Policy Optimisation: one clipped importance ratio per sequence.

    GSPO (Zheng et al. 2025, arXiv 2507.18071, eqs. 5-7): the sequence ratio is the geometric
    mean of its token ratios, s_i = exp(1/|y_i| * sum_t (logprobs_t - old_logprobs_t)), and the
    loss of sequence i is -min(s_i * A_i, clip(s_i, 1 - clip_low, 1 + clip_high) * A_i): the
    whole sequence is clipped or not. Its gradient is -A_i * s_i / |y_i| * sum_t grad log pi_t
    where not clipped. Each token carries its sequence's loss, so with `loss_agg = "seq-mean"`
    (weights 1/|y_i|, the paper's objective and verl's) the sum over tokens is the mean over
    sequences; "token-mean" weighs each sequence by its length (GSPO-token's gradient with TRL's
    default normalisation). The GSPO paper uses much smaller clip ranges than PPO's (3e-4 / 4e-4).
    log s_i is clamped to [-20, 20]. `clip_frac` and `ratio` report each token's sequence.
    """
    mask = batch.loss_mask != 0  # (B, T)
    log_ratio = _masked_log_ratio(batch.logprobs, batch.old_logprobs, mask)  # (B, T)
    lengths = mask.sum(-1).clamp(min=1)  # (B,) an empty response: ratio 1, weight 0
    seq_ratio, clamped = _clamped_exp(log_ratio.sum(-1) / lengths)  # (B,), (B,)
    adv = _sequence_advantages(batch)  # (B,)
    unclipped = seq_ratio * adv  # (B,)
    clipped = seq_ratio.clamp(1.0 - params.clip_low, 1.0 + params.clip_high) * adv
    pg_seq = -torch.minimum(unclipped, clipped)  # (B,)
    shape = log_ratio.shape
    terms = _Terms(
        pg_per_token=pg_seq[:, None].expand(shape),  # (B, T) each token: its sequence's loss
        ratio=seq_ratio[:, None].expand(shape),
        clipped=(clipped < unclipped)[:, None].expand(shape),
        clamped=clamped[:, None].expand(shape),
    )
    return _finish(terms, batch, params)


def cispo_loss(batch: PolicyBatch, params: AlgoParams) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped IS-weight policy optimisation: REINFORCE weighted by a clipped, detached ratio.

    CISPO (MiniMax-M1, arXiv 2506.13585, eqs. 4-5): loss_t = -sg(w_t) * A * logprobs_t with
    w_t = clip(ratio_t, 1 - clip_low, 1 + clip_high) and sg the stop-gradient, so every token
    keeps a gradient -w_t * A * grad log pi_t (PPO's clip zeroes it outside the trust region),
    bounded by (1 + clip_high) * |A|. On-policy (ratio 1) it is `pg_loss`. The paper sets no
    lower bound (`clip_low = 1`) and tunes the upper one; it aggregates per token ("token-mean").
    `clip_frac` counts tokens whose weight was clipped.
    """
    ratio, clamped = _policy_ratio(batch)  # (B, T), (B, T)
    low, high = 1.0 - params.clip_low, 1.0 + params.clip_high
    weight = ratio.clamp(low, high).detach()  # (B, T)
    adv = token_advantages(batch)  # (B, 1) or (B, T)
    pg_per_token = -weight * adv * batch.logprobs  # (B, T)
    clipped = (ratio < low) | (ratio > high)  # (B, T)
    return _finish(_Terms(pg_per_token, ratio, clipped, clamped), batch, params)


def rloo_loss(batch: PolicyBatch, params: AlgoParams) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE with the leave-one-out baseline, per token, as a weighted sum.

    RLOO (Ahmadian et al. 2024, "Back to Basics", arXiv 2402.14740, the RLOO estimator):
    grad = 1/G * sum_i (r_i - 1/(G-1) * sum_{j != i} r_j) * grad log pi(y_i | x), over the G
    responses of a prompt. The advantages come from `batch.rewards` by `rloo_advantages`, whatever
    `batch.advantages` holds; the rest is `pg_loss` (KL term and TIS included). The paper's
    sequence-level sum corresponds to aggregation "seq-sum-norm" (each token weighs 1, the
    normaliser is a constant); "token-mean" and "seq-mean" reweigh responses by length.
    """
    rewards = _rewards_by_group(batch, "rloo")  # (N, G)
    advantages = rloo_advantages(rewards).flatten()  # (B,)
    return pg_loss(replace(batch, advantages=advantages), params)


def _rewards_by_group(batch: PolicyBatch, loss: str) -> Tensor:
    if batch.rewards is None or batch.group_ids is None:
        raise ValueError(f"{loss} needs rewards and group_ids, one per response; got None")
    ids, counts = torch.unique_consecutive(batch.group_ids, return_counts=True)  # (N,), (N,)
    if len(torch.unique(ids)) != len(ids) or (counts != counts[0]).any():
        raise ValueError(
            f"{loss} needs each group's responses in consecutive rows and groups of one size; "
            f"got group sizes {counts.tolist()} for groups {ids.tolist()}"
        )
    return batch.rewards.view(len(ids), int(counts[0]))  # (N, G)
