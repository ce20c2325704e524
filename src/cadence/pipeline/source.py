"""Where the learner's groups come from: the seam between generation and training.

A `GroupSource` is told to start an iteration (with the learner's policy version) and then yields
that iteration's groups; it takes each iteration's prompts from `next_prompts` itself, since with
off-policy asynchrony it begins iterations before the learner reaches them. The colocated source
generates everything in the learner's thread first, so `sync` is the only mode it can offer;
sources with worker processes stream groups as they finish. The learner consumes any of them the
same way.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from cadence.metrics.trace import Span, Tracer
from cadence.pipeline.samples import (
    GENERATED,
    LEARNER,
    TRAIN,
    batch_groups,
    group_rows,
    record_depths,
)
from cadence.pipeline.store import SampleStore, StoreClosed
from cadence.pipeline.worker import RolloutWorker
from cadence.pipeline.workers import Pool, WorkerDied
from cadence.types import Group, Prompt, SampleBatch

if TYPE_CHECKING:
    from cadence.pipeline.reward_stage import RewardStage


class GroupSource(Protocol):
    times: IterationTimes  # what the current iteration measured
    restarts: list[int]  # worker replacements so far, per worker slot

    def stages(self) -> dict[str, tuple[int, int]]:
        """(workers, samples finished so far in the run) of each stage before the learner:
        "gen", and "reward" when a reward stage scores. For the per-stage figures."""
        ...

    def start_iteration(self, iteration: int, version: int) -> None: ...

    def groups(self) -> Iterator[Group]:
        """The started iteration's groups, each complete, in the order they are ready."""
        ...

    def close(self) -> None: ...


log = logging.getLogger(__name__)


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
    queue_depths: list[int] = field(
        default_factory=list
    )  # groups ready, each time the learner asks
    dropped_groups: int = 0  # refused by the store as staler than allowed


class ColocatedSource:
    """Generation in the learner's thread, with the learner's own (current) weights."""

    def __init__(
        self,
        worker: RolloutWorker,
        tracer: Tracer,
        next_prompts: Callable[[], list[Prompt]],
        sync: Callable[[int], None] | None = None,
    ) -> None:
        """`sync(version)`: loads the learner's weights into an engine that keeps its own copy
        (vLLM) before each iteration's generation; None when the engine uses the learner's."""
        self.worker = worker
        self.tracer = tracer
        self.next_prompts = next_prompts
        self.sync = sync
        self.times = IterationTimes()
        self.restarts: list[int] = []
        self._pending: list[Group] = []
        self._rows = 0

    def stages(self) -> dict[str, tuple[int, int]]:
        return {"gen": (1, self._rows)}

    def start_iteration(self, iteration: int, version: int) -> None:
        self.times = IterationTimes(start=self.tracer.now())
        prompts = self.next_prompts()
        if self.sync is not None:
            with self.tracer.span("weight_sync", "worker-0"):
                self.sync(version)
            self.times.weight_sync_s = self.tracer.now() - self.times.start
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


class WorkerSource:
    """Worker processes fed by one persistent producer thread, their groups streamed to the
    learner through a `SampleStore`; `stream` and `max_staleness` are the sync / periodic /
    offpolicy knobs.

    Versions and order. The learner publishes version v at the start of iteration v
    (`start_iteration`): it writes the shared weights (once every worker has loaded the previous
    version, so no worker ever reads a half-written copy) and lets the producer know. The
    producer keeps one FIFO per run of work items: tasks of the iterations it has begun and, in
    between, a `sync v` item that it sends to every worker once all tasks queued before it have
    been handed out. A worker acts on its messages in order and loads weights only between
    requests, so every task is generated with exactly the version synced before it.

    Admission. The producer begins iteration k (takes its prompts and queues its tasks behind the
    newest sync) only once version k - max_staleness is published, so nothing it starts can reach
    the learner staler than that. max_staleness = 0 is periodic; 1 is one-step off-policy
    (iteration k is generated with version k - 1 while the learner trains iteration k - 1).
    With max_staleness = 0 the learner also waits in `start_iteration` until every worker has
    loaded the version (the barrier).

    The store. The producer puts each finished group's rows (`samples.GENERATED`, and the reward
    when the workers scored it; otherwise `reward_stage` writes it). `groups()` takes the
    iteration's whole groups with every field for the task "learner", checked against the
    learner's version by the store's staleness rule, as they become ready (stream) or all at
    once (`stream=False`, sync), and clears the iteration once all are taken. Any producer,
    worker or reward-stage failure is re-raised in the learner's thread.
    """

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
        store: SampleStore | None = None,
        reward_stage: RewardStage | None = None,
        group_size: int = 1,
    ) -> None:
        if queue_size and (max_staleness > 0 or not stream):
            raise ValueError("pipeline.queue_size must be 0 (unbounded) unless mode is periodic")
        self.pool = pool
        self.model = model
        self.tracer = tracer
        self.next_prompts = next_prompts
        self.stream = stream
        self.prompts_per_task = prompts_per_task
        self.tasks_in_flight = tasks_in_flight
        self.max_staleness = max_staleness
        self.queue_size = queue_size  # most groups waiting for the learner before tasks pause
        self.iterations = iterations  # None: begin iterations for as long as admission allows
        self.first_iteration = first_iteration  # a resumed run begins where it stopped
        self.max_worker_restarts = max_worker_restarts  # per worker slot, over the run
        self.store = store if store is not None else SampleStore()
        self.reward_stage = reward_stage  # scores the rows when the workers do not
        self.group_size = group_size  # samples per prompt: the generation queue's depth in rows
        self.restarts = [0] * pool.num_workers
        self.duplicates = 0  # groups received twice and dropped (only after a worker is replaced)
        self._weights_version = -1  # the version the published weights hold
        self._delivered: dict[int, set[str]] = {}  # iteration -> prompt uids put in the store
        self.times = IterationTimes()
        self._cond = threading.Condition()
        self._published = -1  # newest version the learner has released to the producer
        self._new_versions: list[int] = []  # released, not yet queued as sync items
        self._acked = [-1] * pool.num_workers  # newest version each worker has loaded
        self._sizes: dict[int, int] = {}  # iteration -> its groups, once begun
        self._current, self._version = -1, -1  # the learner's iteration and version
        self._task_iteration: dict[int, int] = {}  # task id -> its iteration
        self._next_group, self._next_row = 0, 0  # store ids, in arrival order
        self._rows_generated, self._gen_waiting = 0, 0  # rows put; rows begun, not yet put
        self._failure: _Failure | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def stages(self) -> dict[str, tuple[int, int]]:
        done = {"gen": (self.pool.num_workers, self._rows_generated)}
        if self.reward_stage is not None:
            done["reward"] = (self.reward_stage.num_workers, self.reward_stage.rows_scored)
        return done

    # --- learner thread ------------------------------------------------------------------

    def start_iteration(self, iteration: int, version: int) -> None:
        if self._thread is None:
            if self.reward_stage is not None:
                self.reward_stage.start()
            self._thread = threading.Thread(
                target=self._produce, name="cadence-producer", daemon=True
            )
            self._thread.start()
        self.times = IterationTimes(start=self.tracer.now())
        with self.tracer.span("weight_sync", "learner"):
            self.barrier(version)
        self.times.weight_sync_s = self.tracer.now() - self.times.start
        with self._cond:
            self._published = max(self._published, version)
            self._current, self._version = iteration, version
            self._cond.notify_all()

    def barrier(self, version: int) -> None:
        """Make `version` reach the workers; with max_staleness = 0, wait until all have it."""
        if version <= self._published:
            return
        with self._cond:  # held while writing: a worker replaced meanwhile reads whole weights
            self._wait(lambda: min(self._acked) >= self._published, "load the previous weights")
            self.pool.weights.publish(self.model, version)
            self._weights_version = version
            self._new_versions.append(version)
            self._cond.notify_all()
        if self.max_staleness == 0:
            with self._cond:
                self._wait(lambda: min(self._acked) >= version, f"load version {version}")

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        """Wait (holding `_cond`) until `ready()`; raise a stage's failure or a timeout."""
        deadline = time.monotonic() + self.pool.timeout_s
        while not ready():
            self._raise_failure()
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers did not {what} within {self.pool.timeout_s:.0f}s")
            self._cond.wait(timeout=0.5)

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure.error
        if self.reward_stage is not None and self.reward_stage.failure is not None:
            raise self.reward_stage.failure

    def groups(self) -> Iterator[Group]:
        """The current iteration's groups: as they become ready (stream) or once all are."""
        k, version = self._current, self._version
        with self._cond:
            self._wait(lambda: k in self._sizes, f"begin iteration {k}")
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
            self._failure = _Failure(e)
            with self._cond:
                self._cond.notify_all()
            self.store.close()

    def _produce_loop(self) -> None:
        fifo: collections.deque = collections.deque()  # ("sync", v) | ("task", k, id, prompts)
        free = [self.tasks_in_flight] * self.pool.num_workers
        remaining: dict[int, int] = {}  # iteration -> tasks not finished
        begun, task_id, last_word = self.first_iteration, 0, time.monotonic()
        while not self._stop.is_set():
            with self._cond:
                fifo.extend(("sync", v) for v in self._new_versions)
                self._new_versions = []
                admit = self._published
            while admit >= max(0, begun - self.max_staleness) and (
                self.iterations is None or begun < self.iterations
            ):
                tasks = self._begin(begun)
                remaining[begun] = len(tasks)
                for prompts in tasks:
                    fifo.append(("task", begun, task_id, prompts))
                    task_id += 1
                begun += 1
            self._dispatch(fifo, free)
            try:
                message = self.pool.poll(0.05)
            except WorkerDied as e:
                if self._stop.is_set():
                    return
                self._replace(e)
                last_word = time.monotonic()
                continue
            if message is None:
                if self.pool.has_in_flight() and (
                    time.monotonic() - last_word > self.pool.timeout_s
                ):
                    raise TimeoutError(f"no word from the workers for {self.pool.timeout_s:.0f}s")
                continue
            last_word = time.monotonic()
            kind, wid, payload = message
            if kind == "ack":
                with self._cond:
                    self._acked[wid] = payload
                    self._cond.notify_all()
                continue
            self._record(payload)
            if payload.task_done:
                free[wid] += 1
            for g in payload.groups:
                delivered = self._delivered.setdefault(g.iteration, set())
                if g.prompt.uid in delivered:  # a replaced worker's, sent twice: train it once
                    self.duplicates += 1
                    continue
                delivered.add(g.prompt.uid)
                self._put(g)
            if payload.task_done:
                k = self._task_iteration.pop(payload.task_id)
                remaining[k] -= 1
                if remaining[k] == 0:
                    self._delivered.pop(k, None)

    def _put(self, group: Group) -> None:
        """The group's rows into the store, scored or waiting for the reward stage."""
        scored = self.reward_stage is None
        rows, fields = group_rows(group, self._next_group, self._next_row, scored=scored)
        self.store.put(rows, fields)
        self._next_group += 1
        self._next_row += len(rows)
        self._rows_generated += len(rows)
        self._gen_waiting = max(self._gen_waiting - len(rows), 0)
        self.tracer.add_samples(
            "rows waiting", "queue-gen", [(time.perf_counter(), self._gen_waiting)]
        )
        record_depths(self.store, self.tracer, not scored)

    def _replace(self, died: WorkerDied) -> None:
        """Start a new worker in a dead one's slot, give it the newest published weights and
        send it again the prompts the dead one had not returned (same task ids)."""
        wid = died.wid
        if self.restarts[wid] >= self.max_worker_restarts:
            raise WorkerDied(
                f"{died}; restarted {self.restarts[wid]} time(s) already "
                f"(pipeline.max_worker_restarts = {self.max_worker_restarts})",
                wid,
            ) from died
        self.restarts[wid] += 1
        start = time.monotonic()
        with self._cond:  # no version can be published until the new worker acknowledges one
            self._acked[wid] = -1
            version = self._weights_version
        lost = self.pool.replace(wid)
        if version >= 0:
            self.pool.send_sync_to(wid, version)
        for task_id, (prompts, iteration) in sorted(lost.items()):
            self.pool.submit(wid, task_id, prompts, iteration)
        log.warning(
            "%s; replaced in %.1fs (restart %d of %d), %d prompts sent again",
            died,
            time.monotonic() - start,
            self.restarts[wid],
            self.max_worker_restarts,
            sum(len(prompts) for prompts, _ in lost.values()),
        )

    def _begin(self, iteration: int) -> list[list[Prompt]]:
        prompts = self.next_prompts()
        with self._cond:
            self._sizes[iteration] = len(prompts)
            self._cond.notify_all()
        self._gen_waiting += len(prompts) * self.group_size
        self.tracer.add_samples(
            "rows waiting", "queue-gen", [(time.perf_counter(), self._gen_waiting)]
        )
        return [
            prompts[i : i + self.prompts_per_task]
            for i in range(0, len(prompts), self.prompts_per_task)
        ]

    def _dispatch(self, fifo: collections.deque, free: list[int]) -> None:
        """Hand out the FIFO's head while workers have room; a sync goes to every worker. Tasks
        wait while `queue_size` groups wait for the learner."""
        while fifo:
            item = fifo[0]
            if item[0] == "sync":
                for wid in range(self.pool.num_workers):
                    self.pool.send_sync_to(wid, item[1])
            else:
                wid = max(range(len(free)), key=lambda w: free[w])
                if free[wid] == 0 or self._learner_backlog_full():
                    return
                _, k, task_id, prompts = item
                self.pool.submit(wid, task_id, prompts, k)
                self._task_iteration[task_id] = k
                free[wid] -= 1
            fifo.popleft()

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
