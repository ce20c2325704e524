"""The Trainer seam's deterministic fake: what the run loop and checkpoints see of a trainer,
without a loss, a backward pass or an optimizer.

`FakeTrainer` records the scored groups of every iteration and moves each parameter of its model
by a fixed amount per iteration (`step * version`, before the version advances), so a test can
tell which iterations ran and in what state a checkpoint left it. Its state is plain values, as a
real trainer's must be.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from cadence.learner.scorer import Scored


class FakeTrainer:
    """A `Trainer` that trains nothing (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, step: float = 1e-3) -> None:
        self.model, self.step = model, step
        self.version = 0
        self.trained: list[list[Scored]] = []  # per iteration, the scored groups in order
        self.closed = False

    def train_iteration(self, scored: Iterable[Scored], num_groups: int) -> dict[str, Any]:
        got = list(scored)
        if not got:
            raise RuntimeError(f"trainer got no groups (expected {num_groups})")
        for s in got:
            if s.group.policy_version > self.version:
                raise ValueError(
                    f"group {s.group.prompt.uid} has policy_version {s.group.policy_version}, "
                    f"newer than the trainer's version {self.version}"
                )
        self.version += 1
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(self.step * self.version)
        self.trained.append(got)
        advantages = torch.cat([s.advantages for s in got])  # (num samples,)
        return {
            "num_tokens": float(sum(s.num_tokens for s in got)),
            "loss": float(advantages.abs().mean()),
            "optimizer_steps": 1.0,
            "learner_ranks": 1,
        }

    def state(self, directory: Path) -> dict[str, Any]:
        return {"ranks": 1, "version": self.version, "bad_steps_in_a_row": 0}

    def load_state(self, directory: Path, state: dict[str, Any]) -> None:
        self.version = state["version"]

    def close(self) -> None:
        self.closed = True
