"""The Trainer seam: all the run loop, checkpoints and recipes know of a learner.

Two trainers satisfy it: `Learner` (one process, learner/learner.py) and `RankedLearner`
(`learner.ranks` torch.distributed ranks behind a driver, learner/driver.py); `FakeTrainer`
(learner/fake.py) is the deterministic test double. Only the builder (pipeline/build.py) knows
which one it made; nothing else asks.

- `version`: the policy version, iterations trained. A group made by a newer version is a bug.
- `model`: the whole, unsharded policy in this process: what the weight transports publish to
  the rollout workers, what held-out evaluation and colocated generation run, and what
  checkpoints (`policy/`) and the run's `final/` save. A trainer keeps it current after each
  iteration (a sharded one gathers its ranks' shards into it). Checkpoints write and load its
  weights themselves, so they stay loadable by `cadence eval` whatever trained them.
- `train_iteration(scored, num_groups)`: one iteration on `num_groups` scored groups
  (learner/scorer.py) as they come, fewer if the iterable ends early; its figures.
- `state(directory)` / `load_state(directory, state)`: everything a checkpoint keeps besides the
  policy's weights (optimizer, schedule, version, bad-step count). The state holds tensors and
  plain values only (checkpoints load it without unpickling objects) and at least
  `TRAINER_KEYS`: `ranks` (how many processes wrote it: 1, or a sharded trainer's N, which
  tells a trainer whether it can read the rest), `version`, `bad_steps_in_a_row`. A trainer may
  also write files under `directory` (a sharded one writes its shards there); the checkpoint's
  manifest then covers them.
- `close()`: release what it holds (rank processes); idempotent enough to run while an error
  propagates.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from cadence.learner.scorer import Scored

TRAINER_KEYS = ("ranks", "version", "bad_steps_in_a_row")  # in every trainer's state


@runtime_checkable
class Trainer(Protocol):
    version: int
    model: torch.nn.Module

    def train_iteration(self, scored: Iterable[Scored], num_groups: int) -> dict[str, Any]:
        """Train one iteration on the scored groups as they come; its figures."""
        ...

    def state(self, directory: Path) -> dict[str, Any]:
        """What a checkpoint written to `directory` keeps of this trainer (see the module)."""
        ...

    def load_state(self, directory: Path, state: dict[str, Any]) -> None:
        """Continue from `state` (and the files under `directory`), as `state` returned it."""
        ...

    def close(self) -> None: ...
