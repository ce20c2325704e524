"""Where the learner's groups come from: the seam between generation and training.

A `GroupSource` is told to start an iteration (with the policy version whose weights must generate
it) and then yields that iteration's groups. The colocated source generates everything in the
learner's thread first, so `sync` is the only mode it can offer; sources with worker processes
stream groups as they finish. The learner consumes any of them the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from cadence.metrics.trace import Tracer
from cadence.pipeline.worker import RolloutWorker
from cadence.types import Group, Prompt


class GroupSource(Protocol):
    def start_iteration(self, prompts: list[Prompt], iteration: int, version: int) -> None: ...

    def groups(self) -> Iterator[Group]:
        """The started iteration's groups, each complete, in the order they are ready."""
        ...

    def close(self) -> None: ...


class ColocatedSource:
    """Generation in the learner's thread, with the learner's own (current) weights."""

    def __init__(self, worker: RolloutWorker, tracer: Tracer) -> None:
        self.worker = worker
        self.tracer = tracer
        self._pending: list[Group] = []

    def start_iteration(self, prompts: list[Prompt], iteration: int, version: int) -> None:
        with self.tracer.span("generate", "worker-0"):
            self._pending = self.worker.rollout(prompts, iteration, version)

    def groups(self) -> Iterator[Group]:
        pending, self._pending = self._pending, []
        yield from pending

    def close(self) -> None:
        self._pending = []
