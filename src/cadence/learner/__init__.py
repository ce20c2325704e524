"""The learner: the Trainer seam, the Scorer, and the trainers behind the seam.

- `trainer.py`: the `Trainer` Protocol the run loop, checkpoints and recipes use; `fake.py` its
  deterministic fake.
- `scorer.py`: the `Scorer` (reward shaping, advantages, the `reinforce` baseline), applied once
  between the staleness check and the trainer.
- `learner.py`: the one-process trainer (log-probs, loss, backward, optimizer step), with
  `batch.py` (a micro-batch's tensors), `packing.py` (shared-prompt layouts), `sums.py` (step sums
  and an iteration's figures).
- `driver.py` and `rank.py`: the sharded trainer, a driver and its torch.distributed ranks
  (`sharded_state.py`: their state on disk).
- `sft.py`: the supervised warm start.

The driver is not imported here: it pulls in the rank transports (backend/), which the
one-process learner and the ranks' own processes never need.
"""

from cadence.learner.fake import FakeTrainer
from cadence.learner.learner import Collective, Learner, LearnerParams
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
