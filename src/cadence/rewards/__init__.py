"""Reward functions: the `RewardFn` seam, the math-verify reward and test doubles.

Rewards are pure functions of text (and of a row's metadata, for those that take it); nothing
here imports torch or holds model state. The learned reward (`cadence.rewards.model`, a sequence
classifier) and reasoning-gym's graders (`cadence.rewards.reasoning_gym`) are imported on their
own.
"""

from cadence.rewards.base import (
    ConstantReward,
    RewardBudgetExceeded,
    RewardErrorBudget,
    RewardFn,
    RewardLoadError,
    RewardResult,
    RowRewardFn,
    TableReward,
    load_reward,
    safe_reward,
)
from cadence.rewards.math import MathReward, extract_prediction
from cadence.rewards.timeout import RewardTimeout, TimedReward

__all__ = [
    "ConstantReward",
    "MathReward",
    "RewardBudgetExceeded",
    "RewardErrorBudget",
    "RewardFn",
    "RewardLoadError",
    "RewardResult",
    "RewardTimeout",
    "RowRewardFn",
    "TableReward",
    "TimedReward",
    "extract_prediction",
    "load_reward",
    "safe_reward",
]
