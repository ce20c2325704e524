"""Policy losses, the online DPO pair loss, the KL penalty and loss aggregation, as pure functions.

A loss returns `(loss, metrics)` where `loss` is the weighted SUM of per-token losses over one
micro-batch, not a mean (online DPO: the sum over its preference pairs, see `online_dpo_loss`).
Aggregation is split in two: `token_weights` is known per micro-batch, `normaliser` only once
the whole global batch is in. The learner sums micro-batch gradients and divides by the
normaliser at step time, so streaming micro-batches gives the same update as one
big batch. Metrics are weighted sums with the same weights, to be normalised the same way.

Padding is masked by selection (`torch.where`), never by multiplying with zero, so a padded
position holding a huge or infinite log-prob cannot turn the loss or its gradient into NaN.
Policy-gradient losses may read `behaviour_logprobs` (what the inference engine recorded when it
sampled) for truncated importance sampling; `rloo_loss` and `online_dpo_loss` read each response's
reward and group. This module must not know about models, optimisers or configs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from cadence.algo.advantages import rloo_advantages

AGG_MODES = ("token-mean", "seq-mean", "seq-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
DPO_LOSSES = ("sigmoid", "ipo")
# Metrics that are counts, summed over a step; every other metric is a weighted sum that is
# divided by the same normaliser as the loss.
COUNT_METRICS = ("num_pairs", "dpo_ties")


@dataclass(frozen=True)
class LossParams:
    """Hyper-parameters of the losses; each loss reads the ones it uses."""

    clip_low: float = 0.2  # ratio floor is 1 - clip_low
    clip_high: float = 0.2  # ratio ceiling is 1 + clip_high (DAPO's clip-higher raises it alone)
    kl_coef: float = 0.0  # weight of the per-token KL(pi || ref) penalty; 0 turns it off
    kl_estimator: str = "k3"  # one of KL_ESTIMATORS
    tis_cap: float = 0.0  # truncated importance sampling cap (>= 1); 0 turns it off
    dpo_beta: float = 0.1  # DPO's beta (IPO's tau): strength of the pull towards the reference
    dpo_loss: str = "sigmoid"  # one of DPO_LOSSES

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"clip_low must be in [0, 1); got {self.clip_low}")
        if self.clip_high < 0.0:
            raise ValueError(f"clip_high must be >= 0; got {self.clip_high}")
        if self.kl_coef < 0.0:
            raise ValueError(f"kl_coef must be >= 0; got {self.kl_coef}")
        _check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        if self.tis_cap != 0.0 and not self.tis_cap >= 1.0:
            raise ValueError(
                f"tis_cap must be 0 (off) or >= 1 (a cap below 1 would shrink the weight of "
                f"on-policy tokens); got {self.tis_cap}"
            )
        if not self.dpo_beta > 0.0:
            raise ValueError(f"dpo_beta must be > 0; got {self.dpo_beta}")
        _check_choice("dpo_loss", self.dpo_loss, DPO_LOSSES)


@dataclass
class PolicyBatch:
    """One micro-batch of B responses padded to T tokens, as the losses see it."""

    logprobs: Tensor  # (B, T) under the policy being trained, with grad
    old_logprobs: Tensor  # (B, T) the ratio's denominator: the sampling (or, TIS, proximal) policy
    advantages: Tensor  # (B,) one per sequence
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
        for name in ("advantages", "rewards", "group_ids"):
            value = getattr(self, name)
            if value is not None and value.shape != shape[:1]:
                raise ValueError(
                    f"{name} must have shape ({shape[0]},), one per sequence; "
                    f"got {tuple(value.shape)}"
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


def tis_weights(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, loss_mask: Tensor, cap: float
) -> tuple[Tensor, Tensor]:
    """Truncated importance weights min(pi_old / pi_behaviour, cap) per token, and where they cut.

    pi_old is the policy at the iteration's start as the learner computes it, pi_behaviour the
    policy the inference engine sampled with (an older version for stale data, and even for fresh
    data not bit-identical: other kernels, batch shapes, precision). Truncating the ratio from
    above (Ionides 2008) bounds the variance at the cost of a small bias. Weights are detached:
    they rescale the gradient, they are not trained through. 1 on padding.
    """
    mask = loss_mask != 0  # (B, T)
    raw = torch.exp(_masked_log_ratio(old_logprobs.detach(), behaviour_logprobs, mask))  # (B, T)
    return raw.clamp(max=cap), raw > cap  # (B, T), (B, T)


def _truncated_is(
    pg_per_token: Tensor, batch: PolicyBatch, params: LossParams
) -> tuple[Tensor, dict[str, Tensor]]:
    """Multiplies the policy-gradient term by the TIS weights when `tis_cap` > 0."""
    if params.tis_cap == 0:
        return pg_per_token, {}
    if batch.behaviour_logprobs is None:
        raise ValueError(f"tis_cap={params.tis_cap} > 0 needs behaviour_logprobs; got None")
    mask = batch.loss_mask != 0  # (B, T)
    weights = batch.token_weights * batch.loss_mask  # (B, T)
    w, cut = tis_weights(batch.old_logprobs, batch.behaviour_logprobs, mask, params.tis_cap)
    metrics = {
        "tis_weight": _weighted_sum(w, weights, mask),
        "tis_trunc_frac": _weighted_sum(cut.to(weights.dtype), weights, mask),
    }
    return w * pg_per_token, metrics  # (B, T)


def _finish(
    pg_per_token: Tensor, ratio: Tensor, is_clipped: Tensor, batch: PolicyBatch, params: LossParams
) -> tuple[Tensor, dict[str, Tensor]]:
    """Applies TIS, adds the optional KL term, reduces to weighted sums and builds the metrics."""
    mask = batch.loss_mask != 0  # (B, T)
    weights = batch.token_weights * batch.loss_mask  # (B, T)
    pg_per_token, tis_metrics = _truncated_is(pg_per_token, batch, params)  # (B, T)
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
    } | tis_metrics
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

    With `tis_cap` > 0 each token's clipped term is multiplied by the truncated importance weight
    w_t = min(pi_old_t / pi_behaviour_t, tis_cap) (`tis_weights`): old_logprobs are then the
    *proximal* policy (the policy at the iteration's start) that the trust region is drawn around,
    and w_t corrects for the samples having come from pi_behaviour. This is the TIS form of Yao et
    al. 2025 ("Your Efficient RL Framework Secretly Brings You Off-Policy RL Training", blog,
    PPO with min(pi_old / pi_sampler, C)), which is also the decoupled PPO objective of AReaL (Fu
    et al. 2025, arXiv 2505.24298) with its behaviour weight truncated at C.
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
    plus kl_coef * KL_t when kl_coef > 0. Only valid on-policy (old == current policy) unless
    `tis_cap` > 0, which multiplies each term by w_t = min(pi_old_t / pi_behaviour_t, tis_cap),
    the truncated importance weight of the sampled token (see `ppo_clip_loss`). Same return
    convention as `ppo_clip_loss`; `clip_frac` is 0 and `ratio` reports
    exp(logprobs - old_logprobs) to show how off-policy the batch was.
    """
    mask = batch.loss_mask != 0  # (B, T)
    ratio = torch.exp(_masked_log_ratio(batch.logprobs, batch.old_logprobs, mask))  # (B, T)
    adv = batch.advantages.unsqueeze(-1)  # (B, 1)
    pg_per_token = -adv * batch.logprobs  # (B, T)
    return _finish(pg_per_token, ratio, torch.zeros_like(mask), batch, params)


def rloo_loss(batch: PolicyBatch, params: LossParams) -> tuple[Tensor, dict[str, Tensor]]:
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


def preference_pairs(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, int]:
    """One (chosen, rejected) pair per group: its highest- and lowest-reward responses.

    Returns the row indices of the chosen (P,) and rejected (P,) responses and the number of
    groups skipped because all their rewards are equal (a tie has no preference to learn). On
    equal rewards the first row of the group wins (torch.argmax/argmin pick the first).
    """
    chosen: list[int] = []
    rejected: list[int] = []
    ties = 0
    for group in torch.unique(group_ids):
        rows = (group_ids == group).nonzero().flatten()  # (G,)
        r = rewards[rows]  # (G,)
        if r.max() == r.min():
            ties += 1
            continue
        chosen.append(int(rows[r.argmax()]))
        rejected.append(int(rows[r.argmin()]))
    device = rewards.device
    chosen_rows = torch.tensor(chosen, dtype=torch.long, device=device)  # (P,)
    rejected_rows = torch.tensor(rejected, dtype=torch.long, device=device)  # (P,)
    return chosen_rows, rejected_rows, ties


def online_dpo_loss(batch: PolicyBatch, params: LossParams) -> tuple[Tensor, dict[str, Tensor]]:
    """Online DPO over each group's best and worst response, as a sum over pairs.

    Pairs come from the policy's own samples (online DPO, Guo et al. 2024, arXiv 2402.04792), one
    per group by `preference_pairs`, ties skipped. With sequence log-ratios
    s(y) = sum_t (logprobs_t - ref_logprobs_t) over response tokens and h = s(chosen) - s(rejected):
      sigmoid: loss = -log sigmoid(beta * h)     DPO (Rafailov et al. 2023, arXiv 2305.18290, eq. 7)
      ipo:     loss = (h - 1 / (2 * beta))**2    IPO (Azar et al. 2023, arXiv 2310.12036, eq. 17)
    with beta = `dpo_beta`. The objective holds for pairs drawn from any distribution (offline DPO
    trains on a fixed data set), so stale samples need no importance correction: old_logprobs,
    behaviour_logprobs, advantages and token_weights are not read.

    Normalisation: the return is the SUM over the micro-batch's pairs. A micro-batch holds whole
    groups, so every pair lies inside one micro-batch; `num_pairs` counts them, and the learner
    divides the summed gradients by the global batch's `num_pairs` (instead of the token or
    sequence normaliser of `loss_agg`), so the update is the mean over pairs however the groups
    are split. Metrics, divided the same way: `dpo_margin` (beta * h, the implicit reward margin),
    `dpo_accuracy` (chosen implicit reward above the rejected one's), `kl` (per-token KL to the
    reference, averaged over each pair's two responses); `dpo_ties` and `num_pairs` are counts.
    """
    if batch.ref_logprobs is None:
        raise ValueError("online_dpo needs ref_logprobs from a frozen reference model; got None")
    if params.kl_coef > 0 or params.tis_cap > 0:
        raise ValueError(
            f"online_dpo takes no kl_coef or tis_cap (beta regularises towards the reference and "
            f"there is no importance ratio); got kl_coef={params.kl_coef}, tis_cap={params.tis_cap}"
        )
    if batch.rewards is None or batch.group_ids is None:
        raise ValueError("online_dpo needs rewards and group_ids, one per response; got None")
    mask = batch.loss_mask != 0  # (B, T)
    log_ratio = _masked_log_ratio(batch.logprobs, batch.ref_logprobs, mask)  # (B, T)
    seq = log_ratio.sum(-1)  # (B,)
    chosen, rejected, ties = preference_pairs(batch.rewards, batch.group_ids)  # (P,), (P,)
    h = seq[chosen] - seq[rejected]  # (P,)
    if params.dpo_loss == "sigmoid":
        per_pair = -F.logsigmoid(params.dpo_beta * h)  # (P,)
    else:
        per_pair = (h - 1.0 / (2.0 * params.dpo_beta)) ** 2  # (P,)
    kl = _kl_from_log_ratio(log_ratio.detach(), params.kl_estimator).sum(-1)  # (B,) 0 on padding
    lengths = mask.sum(-1).to(kl.dtype)  # (B,)
    pair_kl = (kl[chosen] + kl[rejected]) / (lengths[chosen] + lengths[rejected]).clamp(min=1)
    margin = params.dpo_beta * h.detach()  # (P,)
    metrics = {
        "dpo_margin": margin.sum(),
        "dpo_accuracy": (margin > 0).to(margin.dtype).sum(),
        "kl": pair_kl.sum(),
        "num_pairs": torch.tensor(float(len(h))),
        "dpo_ties": torch.tensor(float(ties)),
    }
    return per_pair.sum(), metrics


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
