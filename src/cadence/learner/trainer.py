"""The Trainer seam: all the run loop, checkpoints and recipes know of a learner.

Read on: docs/learner.md#how-it-is-built.
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
