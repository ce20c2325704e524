"""The learner: log-probs, loss, backward, optimizer step."""

from cadence.learner.learner import BadStepsError, Learner, LearnerParams, frozen_copy

__all__ = ["BadStepsError", "Learner", "LearnerParams", "frozen_copy"]
