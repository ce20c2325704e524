"""The learner: log-probs, loss, backward, optimizer step."""

from cadence.learner.learner import Learner, LearnerParams

__all__ = ["Learner", "LearnerParams"]
