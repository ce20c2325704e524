"""The learner: the Trainer seam, the Scorer, and the trainers behind the seam.

The driver is not imported here: it pulls in the rank transports (backend/), which the
one-process learner and the ranks' own processes never need.

Read on: docs/learner.md#how-it-is-built.
"""

from cadence.learner.fake import FakeTrainer
from cadence.learner.learner import Learner
from cadence.learner.params import Collective, LearnerParams
from cadence.learner.scorer import Scored, Scorer, reward_figures, score
from cadence.learner.steps import BadStepsError
from cadence.learner.sums import StepSums, iteration_stats
from cadence.learner.tensors import frozen_copy
from cadence.learner.trainer import TRAINER_KEYS, Trainer

__all__ = [
    "TRAINER_KEYS",
    "BadStepsError",
    "Collective",
    "FakeTrainer",
    "Learner",
    "LearnerParams",
    "Scored",
    "Scorer",
    "StepSums",
    "Trainer",
    "frozen_copy",
    "iteration_stats",
    "reward_figures",
    "score",
]
