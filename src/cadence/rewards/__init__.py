"""Reward functions: the `RewardFn` seam, the math-verify reward and test doubles.

Rewards are pure functions of text; nothing here imports torch or holds model state. The learned
reward (`cadence.rewards.model`, a sequence classifier) is imported on its own.
"""

from cadence.rewards.base import (
    ConstantReward,
    RewardBudgetExceeded,
    RewardErrorBudget,
    RewardFn,
    RewardLoadError,
    RewardResult,
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
    "TableReward",
    "TimedReward",
    "extract_prediction",
    "load_reward",
    "safe_reward",
]
