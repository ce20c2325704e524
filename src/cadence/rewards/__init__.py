"""Reward functions: the `RewardFn` seam, the math-verify reward, test doubles, and the runner
that scores many rows at once (`RewardRunner`, `reward.concurrency`).

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
from cadence.rewards.concurrent import (
    DEFAULT_CONCURRENCY,
    RewardCall,
    RewardRunner,
    RewardScorer,
    as_runner,
    load_runner,
)
from cadence.rewards.math import MathReward, extract_prediction
from cadence.rewards.stage import BatchScorer, RewardSpec, build_batch_scorer, finite_scores
from cadence.rewards.timeout import RewardTimeout, TimedReward

__all__ = [
    "DEFAULT_CONCURRENCY",
    "BatchScorer",
    "ConstantReward",
    "MathReward",
    "RewardBudgetExceeded",
    "RewardCall",
    "RewardErrorBudget",
    "RewardFn",
    "RewardLoadError",
    "RewardResult",
    "RewardRunner",
    "RewardScorer",
    "RewardSpec",
    "RewardTimeout",
    "RowRewardFn",
    "TableReward",
    "TimedReward",
    "as_runner",
    "build_batch_scorer",
    "extract_prediction",
    "finite_scores",
    "load_reward",
    "load_runner",
    "safe_reward",
]
