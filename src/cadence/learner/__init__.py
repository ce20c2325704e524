"""The learner: log-probs, loss, backward, optimizer step."""

from cadence.learner.batch import Scored, reward_figures
from cadence.learner.learner import (
    BadStepsError,
    Collective,
    Learner,
    LearnerParams,
    frozen_copy,
    reward_shaping,
    score_groups,
)
from cadence.learner.sums import StepSums, iteration_stats

__all__ = [
    "BadStepsError",
    "Collective",
    "Learner",
    "LearnerParams",
    "Scored",
    "StepSums",
    "frozen_copy",
    "iteration_stats",
    "reward_figures",
    "reward_shaping",
    "score_groups",
]
