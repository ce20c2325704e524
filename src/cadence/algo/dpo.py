"""Online DPO: a preference loss over each group's best and worst response, as a pure function.

The loss returns `(loss, metrics)` where `loss` is the SUM over the micro-batch's preference pairs;
the learner divides the summed gradients by the global batch's number of pairs (`num_pairs`).
It reads rewards, groups, log-probs and the reference's log-probs; no old log-probs, no
advantages, no token weights. This module must not know about models, optimisers or configs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from cadence.algo.losses import PolicyBatch, kl_penalty
from cadence.algo.params import AlgoParams


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


def online_dpo_loss(batch: PolicyBatch, params: AlgoParams) -> tuple[Tensor, dict[str, Tensor]]:
    """Online DPO over each group's best and worst response, as a sum over pairs.

    Pairs come from the policy's own samples (online DPO, Guo et al. 2024, arXiv 2402.04792), one
    per group by `preference_pairs`, ties skipped. With sequence log-ratios
    s(y) = sum_t (logprobs_t - ref_logprobs_t) over response tokens and h = s(chosen) - s(rejected):
      sigmoid: loss = -log sigmoid(beta * h)     DPO (Rafailov et al. 2023, arXiv 2305.18290, eq. 7)
      ipo:     loss = (h - 1 / (2 * beta))**2    IPO (Azar et al. 2023, arXiv 2310.12036, eq. 17)
      ipo_token_mean: the IPO loss with s(y) the MEAN of the response's token log-ratios instead
                      of their sum (the IPO of TRL's DPOTrainer, which normalises per token); an
                      empty response has s(y) = 0.
    with beta = `dpo_beta`. "ipo" keeps the paper's summed sequence log-ratios (as TRL's
    OnlineDPOTrainer does), so its h grows with response length and the target 1 / (2 beta) is a
    target on whole-sequence log-ratios.
    The objective holds for pairs drawn from any distribution (offline DPO trains on a fixed data
    set), so stale samples need no importance correction: old_logprobs, behaviour_logprobs,
    advantages and token_weights are not read.

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
    if params.kl_coef > 0 or params.corrects:
        raise ValueError(
            f"online_dpo takes no kl_coef or tis_cap, nor a rollout correction (beta regularises "
            f"towards the reference and there is no importance ratio); got "
            f"kl_coef={params.kl_coef}, rollout_correction={params.rollout_correction!r}, "
            f"correction_proximal={params.correction_proximal!r}"
        )
    if batch.rewards is None or batch.group_ids is None:
        raise ValueError("online_dpo needs rewards and group_ids, one per response; got None")
    mask = batch.loss_mask != 0  # (B, T)
    log_ratio = torch.where(mask, batch.logprobs - batch.ref_logprobs, 0.0)  # (B, T)
    lengths = mask.sum(-1).to(log_ratio.dtype)  # (B,)
    seq = log_ratio.sum(-1)  # (B,)
    if params.dpo_loss == "ipo_token_mean":
        seq = seq / lengths.clamp(min=1.0)  # (B,) mean over the response's tokens
    chosen, rejected, ties = preference_pairs(batch.rewards, batch.group_ids)  # (P,), (P,)
    h = seq[chosen] - seq[rejected]  # (P,)
    if params.dpo_loss == "sigmoid":
        per_pair = -F.logsigmoid(params.dpo_beta * h)  # (P,)
    else:
        per_pair = (h - 1.0 / (2.0 * params.dpo_beta)) ** 2  # (P,)
    zeros = torch.zeros_like(log_ratio)  # (B, T)
    kl = kl_penalty(log_ratio.detach(), zeros, params.kl_estimator, params.kl_clamp)  # (B, T)
    kl = torch.where(mask, kl, 0.0).sum(-1)  # (B,)
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
