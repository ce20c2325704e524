"""Where the learner's groups come from: the seam between generation and training.

A `GroupSource` is told to start an iteration (with the policy version whose weights must generate
it) and then yields that iteration's groups. The colocated source generates everything in the
learner's thread first, so `sync` is the only mode it can offer; sources with worker processes
stream groups as they finish. The learner consumes any of them the same way.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from cadence.metrics.trace import Span, Tracer
from cadence.pipeline.worker import RolloutWorker
from cadence.pipeline.workers import WorkerPool
from cadence.types import Group, Prompt


class GroupSource(Protocol):
    times: IterationTimes  # what the current iteration measured

    def start_iteration(self, prompts: list[Prompt], iteration: int, version: int) -> None: ...

    def groups(self) -> Iterator[Group]:
        """The started iteration's groups, each complete, in the order they are ready."""
        ...

    def close(self) -> None: ...


_DONE = object()


@dataclass
class _Failure:
    error: BaseException


@dataclass
class IterationTimes:
    """What the producer and consumer measured in one iteration (seconds, tracer clock)."""

    start: float = 0.0
    weight_sync_s: float = 0.0
    first_group: float = float("nan")
    last_group: float = float("nan")
    learner_wait_s: float = 0.0
    queue_depths: list[int] = field(default_factory=list)


class ColocatedSource:
    """Generation in the learner's thread, with the learner's own (current) weights."""

    def __init__(self, worker: RolloutWorker, tracer: Tracer) -> None:
        self.worker = worker
        self.tracer = tracer
        self.times = IterationTimes()
        self._pending: list[Group] = []

    def start_iteration(self, prompts: list[Prompt], iteration: int, version: int) -> None:
        self.times = IterationTimes(start=self.tracer.now())
        with self.tracer.span("generate", "worker-0"):
            self._pending = self.worker.rollout(prompts, iteration, version)
        self.tracer.add_samples("slots", "worker-0", self.worker.take_occupancy())
        self.times.first_group = self.times.last_group = self.tracer.now() - self.times.start

    def groups(self) -> Iterator[Group]:
        pending, self._pending = self._pending, []
        yield from pending

    def close(self) -> None:
        self._pending = []


class WorkerSource:
    """Worker processes fed by a producer thread; `stream` is the sync/periodic knob.

    start_iteration (learner thread): the barrier (publish version k; every worker loads it and
    acknowledges), then the producer thread starts sending the iteration's tasks, at most
    `tasks_in_flight` per worker, and puts each finished group on a bounded queue. `groups()`
    yields them as they arrive (stream=True, periodic) or only once all are in (stream=False,
    sync). Any producer or worker failure is re-raised in the learner's thread.
    """

    def __init__(
        self,
        pool: WorkerPool,
        model,
        tracer: Tracer,
        *,
        stream: bool,
        prompts_per_task: int,
        tasks_in_flight: int,
        queue_size: int = 0,
    ) -> None:
        self.pool = pool
        self.model = model
        self.tracer = tracer
        self.stream = stream
        self.prompts_per_task = prompts_per_task
        self.tasks_in_flight = tasks_in_flight
        self.queue_size = queue_size
        self.times = IterationTimes()
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start_iteration(self, prompts: list[Prompt], iteration: int, version: int) -> None:
        self._join()
        self.times = IterationTimes(start=self.tracer.now())
        with self.tracer.span("weight_sync", "learner"):
            self.barrier(version)
        self.times.weight_sync_s = self.tracer.now() - self.times.start
        self._queue = queue.Queue(maxsize=self.queue_size or len(prompts))
        self._thread = threading.Thread(
            target=self._produce, args=(prompts, iteration), name="cadence-producer", daemon=True
        )
        self._thread.start()

    def barrier(self, version: int) -> None:
        self.pool.sync(self.model, version)

    def _produce(self, prompts: list[Prompt], iteration: int) -> None:
        try:
            tasks = [
                prompts[i : i + self.prompts_per_task]
                for i in range(0, len(prompts), self.prompts_per_task)
            ]
            pending = list(enumerate(tasks))[::-1]  # popped from the end: task 0 first
            for _ in range(self.tasks_in_flight):
                for wid in range(self.pool.num_workers):
                    if pending:
                        self.pool.submit(wid, *pending.pop(), iteration)
            done = 0
            while done < len(tasks):
                result = self.pool.next_result()
                if self._stop.is_set():
                    return
                self._record(result)
                if result.task_done:
                    done += 1
                    if pending:
                        self.pool.submit(result.worker, *pending.pop(), iteration)
                for g in result.groups:
                    self._put(g)
            self._put(_DONE)
        except BaseException as e:  # surfaces in the learner's thread via groups()
            self._put(_Failure(e))

    def _record(self, result) -> None:
        origin, track = self.tracer.origin, f"worker-{result.worker}"
        self.tracer.add(Span("generate", track, result.start - origin, result.end - origin))
        self.tracer.add_samples("slots", track, result.occupancy)
        now = self.tracer.now()
        if math.isnan(self.times.first_group):
            self.times.first_group = now - self.times.start
        self.times.last_group = now - self.times.start

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def groups(self) -> Iterator[Group]:
        items = self._drain() if not self.stream else None
        while True:
            item = items.pop(0) if items is not None else self._next()
            if item is _DONE:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item

    def _next(self):
        start = self.tracer.now()
        self.times.queue_depths.append(self._queue.qsize())
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if self._thread is None or not self._thread.is_alive():
                    item = _Failure(RuntimeError("producer thread ended without finishing"))
                    break
        self.times.learner_wait_s += self.tracer.now() - start
        return item

    def _drain(self) -> list:
        items = []
        while True:
            items.append(self._next())
            if items[-1] is _DONE or isinstance(items[-1], _Failure):
                return items

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def close(self) -> None:
        self._stop.set()
        self.pool.close()
        self._join()
