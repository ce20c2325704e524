"""Advantage estimators: one scalar advantage per sampled response, from its group's rewards.

Every function maps rewards of shape (N, G), N prompts with G responses each, to advantages of
the same shape. They are pure tensor functions: no model, no config, no state across calls, and
no normalisation across groups (a group is the unit the estimators are defined on).
"""

from __future__ import annotations

from torch import Tensor


def _check_groups(rewards: Tensor) -> None:
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards must have shape (num_groups, group_size); got shape {tuple(rewards.shape)}"
        )


def grpo_advantages(rewards: Tensor, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages.

    GRPO, outcome supervision (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300, Sec. 4.1.2):
    A_i = (r_i - mean(r)) / (std(r) + eps), with mean and std over the G responses of one prompt.
    The std is the population std (correction=0, divide by G), so [1, 0, 0, 1] maps to
    [1, -1, -1, 1]. A group whose rewards are all equal gets zero advantages, not NaN.

    With `scale_by_std=False` this is Dr. GRPO (Liu et al. 2025, arXiv 2503.20783):
    A_i = r_i - mean(r), dropping the std division that over-weights too-easy and too-hard prompts.
    """
    _check_groups(rewards)
    centered = rewards - rewards.mean(dim=1, keepdim=True)  # (N, G)
    if not scale_by_std:
        return centered
    std = rewards.std(dim=1, keepdim=True, correction=0)  # (N, 1)
    return centered / (std + eps)  # (N, G)


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
