"""Advantage estimators: one scalar advantage per sampled response, from its group's rewards.

Read on: docs/algorithms.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cadence.choices import STD_MODES

STD_EPS = 1e-4


def _check_groups(rewards: Tensor) -> None:
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards must have shape (num_groups, group_size); got shape {tuple(rewards.shape)}"
        )


def _check_std(std: str) -> None:
    if std not in STD_MODES:
        raise ValueError(f"unknown std {std!r}; allowed: {', '.join(STD_MODES)}")


def grpo_advantages(
    rewards: Tensor, scale_by_std: bool = True, eps: float = STD_EPS, std: str = "unbiased"
) -> Tensor:
    """Group-relative advantages.

    GRPO, outcome supervision (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300, Sec. 4.1.2):
    A_i = (r_i - mean(r)) / (std(r) + eps), with mean and std over the G responses of one prompt.
    With the unbiased std (the default, verl's and TRL's), [1, 0, 0, 1] maps to +-0.866; with the
    population std to +-1, sqrt(G / (G - 1)) larger. A group whose rewards are all equal, or a
    group of one, gets zero advantages, not NaN.

    With `scale_by_std=False` this is Dr. GRPO (Liu et al. 2025, arXiv 2503.20783):
    A_i = r_i - mean(r), dropping the std division that over-weights too-easy and too-hard prompts.
    """
    _check_groups(rewards)
    _check_std(std)
    centered = rewards - rewards.mean(dim=1, keepdim=True)  # (N, G)
    if not scale_by_std or rewards.shape[1] < 2:  # a group of one is centred to 0 already
        return centered
    correction = 1 if std == "unbiased" else 0
    spread = rewards.std(dim=1, keepdim=True, correction=correction)  # (N, 1)
    return centered / (spread + eps)  # (N, G)


def rloo_advantages(rewards: Tensor) -> Tensor:
    """REINFORCE leave-one-out advantages.

    RLOO (Ahmadian et al. 2024, "Back to Basics", arXiv 2402.14740, the RLOO estimator):
    A_i = r_i - 1/(G-1) * sum_{j != i} r_j, the baseline of each sample being the mean reward of
    the other G-1 samples of its group, which keeps the gradient estimate unbiased.
    """
    _check_groups(rewards)
    group_size = rewards.shape[1]
    if group_size < 2:
        raise ValueError(
            f"rloo needs group_size >= 2 to leave one out; got group_size={group_size}"
        )
    others_sum = rewards.sum(dim=1, keepdim=True) - rewards  # (N, G)
    return rewards - others_sum / (group_size - 1)  # (N, G)


def reinforce_advantages(rewards: Tensor, baseline: float = 0.0) -> Tensor:
    """REINFORCE with a constant baseline.

    REINFORCE (Williams 1992), update Delta w = alpha * (r - b) * grad log pi: here A_i = r_i - b,
    where b is a scalar the caller supplies (e.g. the previous iteration's mean reward). It does
    not depend on the group, which is what keeps the estimate unbiased.
    """
    _check_groups(rewards)
    return rewards - baseline  # (N, G)


def reinforce_pp_advantages(
    rewards: Tensor,
    lengths: Tensor,
    group_baseline: bool = False,
    eps: float = STD_EPS,
    std: str = "unbiased",
) -> Tensor:
    """REINFORCE++ advantages, normalised over the whole batch.

    REINFORCE++ (Hu 2025, arXiv 2501.03262, Sec. 3, outcome reward, no discount, KL kept in the
    loss): every token of response i carries the return r_i, and the advantages are normalised
    with the mean and std over all the batch's response tokens, A_i = (r_i - mu) / (sigma + eps),
    so a response counts once per token in mu and sigma (`lengths`, (N, G), are the tokens each
    response trains; as verl's and OpenRLHF's whitening over the response mask). With
    `group_baseline` (REINFORCE++-baseline, the same paper's variant for group sampling) each
    group's mean reward is subtracted first, as in GRPO, and the result is normalised over the
    batch the same way. The batch must be the whole global batch: the statistics are not those
    of a single group. With fewer than two tokens in the batch the advantages are 0.
    """
    _check_groups(rewards)
    _check_std(std)
    if lengths.shape != rewards.shape:
        raise ValueError(
            f"lengths must have the shape of rewards {tuple(rewards.shape)}; "
            f"got {tuple(lengths.shape)}"
        )
    scores = rewards - rewards.mean(dim=1, keepdim=True) if group_baseline else rewards  # (N, G)
    tokens = lengths.to(scores.dtype)  # (N, G)
    num_tokens = tokens.sum()  # ()
    if num_tokens < 2:
        return torch.zeros_like(scores)
    mean = (scores * tokens).sum() / num_tokens  # ()
    squares = ((scores - mean) ** 2 * tokens).sum()  # ()
    var = squares / (num_tokens - 1 if std == "unbiased" else num_tokens)  # ()
    return (scores - mean) / (var.sqrt() + eps)  # (N, G)
