"""The producer: a thread that hands each iteration's prompts to the workers and puts their groups
in the sample store, and the learner's side of it (`WorkerSource`, a `GroupSource`).

Versions and order. The learner publishes version v at the start of iteration v
(`start_iteration`) through the `WeightGate`, which writes the weights once every worker has
loaded the previous version and queues a `sync v` for the producer. The producer keeps one FIFO
of work items for the run: tasks of the iterations it has begun and, in between, each `sync v`,
which it sends to every worker once all tasks queued before it have been handed out. A worker
acts on its messages in order and loads weights only between requests, so every task is
generated with exactly the version synced before it.

Admission. The producer begins iteration k (takes its prompts and queues its tasks behind the
newest sync) only once version k - max_staleness is released, so nothing it starts can reach
the learner staler than that. max_staleness = 0 is periodic; 1 is one-step off-policy
(iteration k is generated with version k - 1 while the learner trains iteration k - 1).
With max_staleness = 0 the learner also waits in `start_iteration` until every worker has
loaded the version (the barrier). Dispatch hands a task to the worker with the most room, up to
`tasks_in_flight` each, and holds tasks back while `queue_size` groups wait for the learner.

The store. The producer puts each finished group's rows (`GENERATED`, and the reward when the
workers scored it; otherwise `reward_stage` writes it). `groups()` takes the iteration's whole
groups with every field for the task "learner", checked against the learner's version by the
store's staleness rule, as they become ready (stream) or all at once (`stream=False`, sync), and
clears the iteration once all are taken. A dead worker is replaced by `Recovery`. Any producer,
worker or reward-stage failure is re-raised in the learner's thread.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from cadence.backend import Pool, RewardStage, WeightGate, WorkerDied
from cadence.dataplane import (
    GENERATED,
    LEARNER,
    TRAIN,
    SampleStore,
    Store,
    StoreClosed,
    batch_groups,
    group_rows,
    record_depths,
)
from cadence.metrics.trace import Span, Tracer
from cadence.pipeline.recovery import Recovery
from cadence.types import Group, Prompt, SampleBatch, SourceStats


class WorkerSource:
    """Worker processes fed by one persistent producer thread, their groups streamed to the
    learner through a sample store; `stream` and `max_staleness` are the sync / periodic /
    offpolicy knobs (see the module docstring)."""

    def __init__(
        self,
        pool: Pool,
        model,
        tracer: Tracer,
        next_prompts: Callable[[], list[Prompt]],
        *,
        stream: bool,
        prompts_per_task: int,
        tasks_in_flight: int,
        max_staleness: int = 0,
        queue_size: int = 0,
        iterations: int | None = None,
        first_iteration: int = 0,
        max_worker_restarts: int = 0,
        store: Store | None = None,
        reward_stage: RewardStage | None = None,
        group_size: int = 1,
    ) -> None:
        if queue_size and (max_staleness > 0 or not stream):
            raise ValueError("pipeline.queue_size must be 0 (unbounded) unless mode is periodic")
        self.pool, self.model, self.tracer = pool, model, tracer
        self.next_prompts = next_prompts
        self.stream = stream
        self.prompts_per_task, self.tasks_in_flight = prompts_per_task, tasks_in_flight
        self.max_staleness = max_staleness
        self.queue_size = queue_size  # most groups waiting for the learner before tasks pause
        self.iterations = iterations  # None: begin iterations for as long as admission allows
        self.first_iteration = first_iteration  # a resumed run begins where it stopped
        self.store: Store = store if store is not None else SampleStore()
        self.reward_stage = reward_stage  # scores the rows when the workers do not
        self.group_size = group_size  # samples per prompt: the generation queue's depth in rows
        self.gate = WeightGate(pool.weights, pool.num_workers, pool.timeout_s, self._raise_failure)
        self.recovery = Recovery(pool, self.gate, max_worker_restarts)
        self.times = SourceStats()
        self._cond = threading.Condition()  # guards the iteration bookkeeping below
        self._sizes: dict[int, int] = {}  # iteration -> its groups, once begun
        self._current, self._version = -1, -1  # the learner's iteration and version
        self._next_group, self._next_row = 0, 0  # store ids, in arrival order
        self._rows_generated, self._gen_waiting = 0, 0  # rows put; rows begun, not yet put
        self._failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def restarts(self) -> list[int]:
        return self.recovery.restarts

    @property
    def duplicates(self) -> int:
        return self.recovery.duplicates

    def stats(self) -> SourceStats:
        stages = {"gen": (self.pool.num_workers, self._rows_generated)}
        if self.reward_stage is not None:
            stages["reward"] = (self.reward_stage.num_workers, self.reward_stage.rows_scored)
        return replace(
            self.times,
            queue_depths=list(self.times.queue_depths),
            worker_restarts=sum(self.restarts),
            stages=stages,
        )

    # --- learner thread ------------------------------------------------------------------

    def start_iteration(self, iteration: int, version: int) -> None:
        if self._thread is None:
            if self.reward_stage is not None:
                self.reward_stage.start()
            self._thread = threading.Thread(
                target=self._produce, name="cadence-producer", daemon=True
            )
            self._thread.start()
        self.times = SourceStats(start=self.tracer.now())
        with self.tracer.span("weight_sync", "learner"):
            self.barrier(version)
        self.times.weight_sync_s = self.tracer.now() - self.times.start
        self.gate.release(version)
        with self._cond:
            self._current, self._version = iteration, version
            self._cond.notify_all()

    def barrier(self, version: int) -> None:
        """Make `version` reach the workers; with max_staleness = 0, wait until all have it."""
        self.gate.publish(self.model, version, wait=self.max_staleness == 0)

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self.reward_stage is not None and self.reward_stage.failure is not None:
            raise self.reward_stage.failure

    def groups(self) -> Iterator[Group]:
        """The current iteration's groups: as they become ready (stream) or once all are."""
        k, version = self._current, self._version
        deadline = time.monotonic() + self.pool.timeout_s
        with self._cond:
            while k not in self._sizes:
                self._raise_failure()
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"workers did not begin iteration {k} within {self.pool.timeout_s:.0f}s"
                    )
                self._cond.wait(timeout=0.5)
            left = self._sizes[k]
        while left > 0:
            batch = self._take(k, version, left)
            self.times.dropped_groups += batch.num_dropped_units
            left -= batch.num_dropped_units
            for group in batch_groups(batch):
                left -= 1
                yield group
        self.store.clear(k)
        with self._cond:
            del self._sizes[k]

    def _take(self, iteration: int, version: int, left: int) -> SampleBatch:
        """The next group (stream) or all `left` (sync) of `iteration` from the store, waiting
        as long as they are generated and scored; raises whatever stopped a stage meanwhile."""
        n = 1 if self.stream else left
        start = self.tracer.now()
        ready = self.store.depth(TRAIN, LEARNER, groups=True, iteration=iteration, units=True)
        self.times.queue_depths.append(ready)
        try:
            while True:
                self._raise_failure()
                batch = self.store.get(
                    TRAIN,
                    n,
                    LEARNER,
                    timeout=0.5,
                    min_size=n,
                    iteration=iteration,
                    version=version,
                    max_staleness=self.max_staleness,
                )
                if batch.rows or batch.num_dropped:
                    self._raise_failure()  # a store closed by a failure hands out what it has
                    record_depths(self.store, self.tracer, self.reward_stage is not None)
                    return batch
                if self._thread is None or not self._thread.is_alive():
                    raise RuntimeError("producer thread ended without finishing")
        except StoreClosed:
            self._raise_failure()
            raise
        finally:
            self.times.learner_wait_s += self.tracer.now() - start

    def close(self) -> None:
        self._stop.set()
        self.gate.wake()
        with self._cond:
            self._cond.notify_all()
        self.store.close()  # wakes the reward stage's driver and any waiting get
        if self._thread is not None:  # first, so that it cannot mistake stopped workers for dead
            self._thread.join(timeout=10)
            self._thread = None
        try:
            if self.reward_stage is not None:
                self.reward_stage.close()
        finally:
            self.pool.close()

    # --- producer thread -----------------------------------------------------------------

    def _produce(self) -> None:
        try:
            self._produce_loop()
        except StoreClosed:  # closed by close() or by a failing reward stage, which says why
            return
        except BaseException as e:  # surfaces in the learner's thread
            self._failure = e
            self.gate.wake()
            with self._cond:
                self._cond.notify_all()
            self.store.close()

    def _produce_loop(self) -> None:
        dispatch = Dispatch(self.pool, self.tasks_in_flight, self._learner_backlog_full)
        begun, last_word = self.first_iteration, time.monotonic()
        while not self._stop.is_set():
            new_versions, admit = self.gate.take()
            for v in new_versions:
                dispatch.sync(v)
            while admit >= max(0, begun - self.max_staleness) and (
                self.iterations is None or begun < self.iterations
            ):
                dispatch.add(begun, self._begin(begun))
                begun += 1
            dispatch.run()
            try:
                message = self.pool.poll(0.05)
            except WorkerDied as e:
                if self._stop.is_set():
                    return
                self.recovery.replace(e)
                last_word = time.monotonic()
                continue
            if message is None:
                if self.pool.has_in_flight() and (
                    time.monotonic() - last_word > self.pool.timeout_s
                ):
                    raise TimeoutError(
                        f"no word from the workers for {self.pool.timeout_s:.0f}s "
                        "(pipeline.worker_timeout_s) with prompts in flight: a worker is stuck"
                    )
                continue
            last_word = time.monotonic()
            kind, wid, payload = message
            if kind == "ack":
                self.gate.acked(wid, payload)
                continue
            self._record(payload)
            for g in payload.groups:
                if self.recovery.fresh(g):  # a replaced worker's, sent twice: train it once
                    self._put(g)
            if payload.task_done and (k := dispatch.done(wid, payload.task_id)) is not None:
                self.recovery.finished(k)

    def _put(self, group: Group) -> None:
        """The group's rows into the store, scored or waiting for the reward stage."""
        scored = self.reward_stage is None
        rows, fields = group_rows(group, self._next_group, self._next_row, scored=scored)
        self.store.put(rows, fields)
        self._next_group += 1
        self._next_row += len(rows)
        self._rows_generated += len(rows)
        self._gen_waiting = max(self._gen_waiting - len(rows), 0)
        self._sample_gen_waiting()
        record_depths(self.store, self.tracer, not scored)

    def _sample_gen_waiting(self) -> None:
        self.tracer.add_samples(
            "rows waiting", "queue-gen", [(time.perf_counter(), self._gen_waiting)]
        )

    def _begin(self, iteration: int) -> list[list[Prompt]]:
        prompts = self.next_prompts()
        with self._cond:
            self._sizes[iteration] = len(prompts)
            self._cond.notify_all()
        self._gen_waiting += len(prompts) * self.group_size
        self._sample_gen_waiting()
        return [
            prompts[i : i + self.prompts_per_task]
            for i in range(0, len(prompts), self.prompts_per_task)
        ]

    def _learner_backlog_full(self) -> bool:
        if not self.queue_size:
            return False
        waiting = self.store.depth(GENERATED, LEARNER, groups=True, units=True)
        return waiting >= self.queue_size

    def _record(self, result) -> None:
        origin, track = self.tracer.origin, f"worker-{result.worker}"
        self.tracer.add(Span("generate", track, result.start - origin, result.end - origin))
        self.tracer.add_samples("slots", track, result.occupancy)
        now = self.tracer.now()
        if result.groups and all(g.iteration == self._current for g in result.groups):
            if math.isnan(self.times.first_group):
                self.times.first_group = now - self.times.start
            self.times.last_group = now - self.times.start


class Dispatch:
    """The producer's FIFO of work items for the run (`sync v` notices and tasks) and who has
    room: `run` hands out the head while a worker has a free task slot (the one with the most),
    a sync going to every worker; tasks wait while `hold()` says the learner is backed up."""

    def __init__(self, pool: Pool, tasks_in_flight: int, hold: Callable[[], bool]) -> None:
        self.pool, self.hold = pool, hold
        self.fifo: collections.deque = collections.deque()  # ("sync", v) | ("task", k, id, ps)
        self.free = [tasks_in_flight] * pool.num_workers
        self.remaining: dict[int, int] = {}  # iteration -> its tasks not finished
        self.iteration_of: dict[int, int] = {}  # task id handed out -> its iteration
        self.next_id = 0

    def sync(self, version: int) -> None:
        self.fifo.append(("sync", version))

    def add(self, iteration: int, tasks: list[list[Prompt]]) -> None:
        self.remaining[iteration] = len(tasks)
        for prompts in tasks:
            self.fifo.append(("task", iteration, self.next_id, prompts))
            self.next_id += 1

    def run(self) -> None:
        while self.fifo:
            item = self.fifo[0]
            if item[0] == "sync":
                for wid in range(self.pool.num_workers):
                    self.pool.send_sync_to(wid, item[1])
            else:
                wid = max(range(len(self.free)), key=lambda w: self.free[w])
                if self.free[wid] == 0 or self.hold():
                    return
                _, k, task_id, prompts = item
                self.pool.submit(wid, task_id, prompts, k)
                self.iteration_of[task_id] = k
                self.free[wid] -= 1
            self.fifo.popleft()

    def done(self, wid: int, task_id: int) -> int | None:
        """Worker `wid` finished task `task_id`; its iteration if that was the last task of it."""
        self.free[wid] += 1
        k = self.iteration_of.pop(task_id)
        self.remaining[k] -= 1
        if self.remaining[k] == 0:
            del self.remaining[k]
            return k
        return None
