"""Where the learner's groups come from: the seam between generation and training.

A `GroupSource` is told to start an iteration (with the learner's policy version) and then yields
that iteration's groups; it takes each iteration's prompts from `next_prompts` itself, since with
off-policy asynchrony it begins iterations before the learner reaches them. The colocated source
generates everything in the learner's thread first, so `sync` is the only mode it can offer;
the producer (`producer.WorkerSource`) streams groups from workers as they finish. The learner
consumes any of them the same way, and the run loop reads what each measured from `stats()`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Protocol

from cadence.backend import RolloutWorker
from cadence.metrics.trace import Tracer
from cadence.types import Group, Prompt, SourceStats


class GroupSource(Protocol):
    def start_iteration(self, iteration: int, version: int) -> None: ...

    def groups(self) -> Iterator[Group]:
        """The started iteration's groups, each complete, in the order they are ready."""
        ...

    def stats(self) -> SourceStats:
        """What the current iteration measured so far, and the run's counts."""
        ...

    def close(self) -> None: ...


class ColocatedSource:
    """Generation in the learner's thread, with the learner's own (current) weights."""

    def __init__(
        self, worker: RolloutWorker, tracer: Tracer, next_prompts: Callable[[], list[Prompt]]
    ) -> None:
        self.worker = worker
        self.tracer = tracer
        self.next_prompts = next_prompts
        self.times = SourceStats()
        self._pending: list[Group] = []
        self._rows = 0

    def stats(self) -> SourceStats:
        return replace(self.times, stages={"gen": (1, self._rows)})

    def start_iteration(self, iteration: int, version: int) -> None:
        self.times = SourceStats(start=self.tracer.now())
        prompts = self.next_prompts()
        with self.tracer.span("generate", "worker-0"):
            self._pending = self.worker.rollout(prompts, iteration, version)
        self._rows += sum(g.group_size for g in self._pending)
        self.tracer.add_samples("slots", "worker-0", self.worker.take_occupancy())
        self.times.first_group = self.times.last_group = self.tracer.now() - self.times.start

    def groups(self) -> Iterator[Group]:
        pending, self._pending = self._pending, []
        yield from pending

    def close(self) -> None:
        self._pending = []
