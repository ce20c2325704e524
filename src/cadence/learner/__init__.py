"""The learner: log-probs, loss, backward, optimizer step."""

from cadence.learner.learner import Learner, LearnerParams, frozen_copy

__all__ = ["Learner", "LearnerParams", "frozen_copy"]
