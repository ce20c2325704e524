"""The learner: log-probs, loss, backward, optimizer step."""

from cadence.learner.learner import BadStepsError, Collective, Learner, LearnerParams, frozen_copy
from cadence.learner.sums import StepSums, iteration_stats

__all__ = [
    "BadStepsError",
    "Collective",
    "Learner",
    "LearnerParams",
    "StepSums",
    "frozen_copy",
    "iteration_stats",
]
