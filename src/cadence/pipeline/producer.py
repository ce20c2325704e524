"""The producer: a thread that hands each iteration's prompts to the workers and puts their groups
in the sample store. The learner's side of it is `source.WorkerSource`, a `GroupSource`.

Read on: docs/pipeline.md#how-it-is-built.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from cadence.backend import Pool, TaskResult, WorkerDied
from cadence.dataplane import GENERATED, LEARNER, Store, StoreClosed, group_rows, record_depths
from cadence.metrics.trace import Span, Tracer
from cadence.models.fingerprint import Fingerprints
from cadence.pipeline.gate import WeightGate
from cadence.pipeline.recovery import Recovery
from cadence.types import Group, Prompt


@dataclass(frozen=True)
class ProducerParams:
    """How the producer feeds the workers (made by `build.producer_params`)."""

    prompts_per_task: int  # prompts sent to a worker as one task
    tasks_in_flight: int  # tasks queued at each worker at once
    max_staleness: int = 0  # versions generation may run ahead of the learner (0: on-policy)
    queue_size: int = 0  # most groups waiting for the learner before tasks pause (0: no bound)
    iterations: int | None = None  # None: begin iterations for as long as admission allows
    first_iteration: int = 0  # a resumed run begins where it stopped
    group_size: int = 1  # samples per prompt: the generation queue's depth in rows
    max_worker_restarts: int = 0  # replacements per worker slot over the run

    def __post_init__(self) -> None:
        least = {"prompts_per_task": 1, "tasks_in_flight": 1}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and value < least.get(f.name, 0):
                raise ValueError(
                    f"producer {f.name} = {value}: must be at least {least.get(f.name, 0)}"
                )

    def admitting_version(self, iteration: int) -> int:
        """The version whose release lets the producer begin `iteration` (and generates it)."""
        return max(iteration - self.max_staleness, 0)

    def ends_before(self, iteration: int) -> bool:
        """True when the run has no iteration `iteration`."""
        return self.iterations is not None and iteration >= self.iterations


class Producer:
    """The producer thread (see the module docstring). The learner's side (`WorkerSource`) waits
    for an iteration to begin (`wait_begun`), asks for extra prompts (`want`), says when it is
    done with one (`iteration_done`), and re-raises `failure`."""

    def __init__(
        self,
        pool: Pool,
        store: Store,
        tracer: Tracer,
        gate: WeightGate,
        params: ProducerParams,
        next_prompts: Callable[[], list[Prompt]],
        next_extra: Callable[[int], Prompt] | None = None,
        *,
        scored: bool = True,
        on_result: Callable[[TaskResult], None] = lambda result: None,
    ) -> None:
        self.pool, self.store, self.tracer = pool, store, tracer
        self.gate, self.params = gate, params
        self.recovery = Recovery(pool, gate, params.max_worker_restarts)
        self.next_prompts, self.next_extra = next_prompts, next_extra
        self.scored = scored  # the workers score; else a reward stage writes the rewards
        self.on_result = on_result  # told of every worker result, as it arrives
        self.failure: BaseException | None = None
        self.rows_generated = 0  # rows put in the store, over the run
        self._cond = threading.Condition()  # guards `_sizes` and `_wanted`
        self._sizes: dict[int, int] = {}  # iteration -> its prompts, once begun, until done
        self._wanted: list[tuple[int, int]] = []  # (iteration, position) of extra prompts
        self._due: collections.deque[tuple[int, int]] = collections.deque()  # taken, not drawn
        self._next_iteration = params.first_iteration  # the next to begin
        self._next_group, self._next_row = 0, 0  # store ids, in arrival order
        self._gen_waiting = 0  # rows begun, not yet put
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread, once. It is kept only once started: a Ctrl-C inside `start()` leaves
        nothing that `stop()` could not join."""
        if self._thread is None:
            thread = threading.Thread(target=self._produce, name="cadence-producer", daemon=True)
            thread.start()
            self._thread = thread

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_begun(self, iteration: int, check: Callable[[], None]) -> int:
        """Wait until `iteration` has begun; its number of prompts. `check` raises whatever
        stopped the pipeline meanwhile; no beginning within the workers' timeout raises."""
        deadline = time.monotonic() + self.pool.timeout_s
        with self._cond:
            while iteration not in self._sizes:
                check()
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"workers did not begin iteration {iteration} within "
                        f"{self.pool.timeout_s:.0f}s (pipeline.worker_timeout_s)"
                    )
                self._cond.wait(timeout=0.5)
            return self._sizes[iteration]

    def want(self, iteration: int, position: int) -> None:
        """One more prompt for `iteration`, at `position` in it (dynamic sampling)."""
        with self._cond:
            self._wanted.append((iteration, position))
            self._cond.notify_all()

    def iteration_done(self, iteration: int) -> None:
        """The learner has taken all of `iteration`: it wants nothing more of it."""
        with self._cond:
            del self._sizes[iteration]

    def stop(self) -> None:
        """Stop the thread (before the workers, so that it cannot mistake stopped ones for dead)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _produce(self) -> None:
        try:
            self._produce_loop()
        except StoreClosed:  # closed by close() or by a failing reward stage, which says why
            return
        except BaseException as e:  # surfaces in the learner's thread
            self.failure = e
            self.gate.wake()
            with self._cond:
                self._cond.notify_all()
            self.store.close()

    def _produce_loop(self) -> None:
        dispatch = Dispatch(self.pool, self.params.tasks_in_flight, self._learner_backlog_full)
        last_word = time.monotonic()
        while not self._stop.is_set():
            self._feed(dispatch)
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
            self._receive(dispatch, message)

    def _feed(self, dispatch: Dispatch) -> None:
        """Queue the new versions' syncs, then draw what is due in the draw order (module
        docstring): extra prompts go to the workers ahead of new batches, for the learner is
        waiting on them."""
        new_versions, released = self.gate.take()
        for v in new_versions:
            dispatch.sync(v, self.gate.expected(v))
        # Wants taken after the gate: a release seen above follows every want of the iterations
        # before it, so none of those can be missed while a batch the release admits is drawn.
        with self._cond:
            self._due.extend(self._wanted)
            self._wanted = []
        extras, batches = [], []
        p = self.params
        k = self._next_iteration
        while not p.ends_before(k) and p.admitting_version(k) <= released:
            extras += self._draw_due(released)
            batches.append((k, self._begin(k)))
            self._next_iteration = k = k + 1
        extras += self._draw_due(released)
        for iteration, prompt in extras:
            dispatch.add(iteration, [[prompt]])
        for iteration, tasks in batches:
            dispatch.add(iteration, tasks)

    def _draw_due(self, released: int) -> list[tuple[int, Prompt]]:
        """The extra prompts due before the next batch: those of iterations whose sync is queued
        and whose release admits no batch not yet drawn. Wants come in iteration order."""
        p, upcoming = self.params, self._next_iteration
        drawn = []
        while self._due:
            iteration, position = self._due[0]
            later = not p.ends_before(upcoming) and p.admitting_version(upcoming) <= iteration
            if iteration > released or later:
                break
            self._due.popleft()
            drawn.append((iteration, self._draw_extra(position)))
        return drawn

    def _receive(self, dispatch: Dispatch, message: tuple) -> None:
        kind, wid, payload = message
        if kind == "ack":
            self.gate.acked(wid, payload)
            return
        self._record(payload)
        for g in payload.groups:
            if self.recovery.fresh(g):  # a replaced worker's, sent twice: train it once
                self._put(g)
        if payload.task_done and (k := dispatch.done(wid, payload.task_id)) is not None:
            self.recovery.finished(k)

    def _draw_extra(self, position: int) -> Prompt:
        assert self.next_extra is not None
        self._gen_waiting += self.params.group_size
        self._sample_gen_waiting()
        return self.next_extra(position)

    def _put(self, group: Group) -> None:
        """The group's rows into the store, scored or waiting for the reward stage."""
        rows, fields = group_rows(group, self._next_group, self._next_row, scored=self.scored)
        self.store.put(rows, fields)
        self._next_group += 1
        self._next_row += len(rows)
        self.rows_generated += len(rows)
        self._gen_waiting = max(self._gen_waiting - len(rows), 0)
        self._sample_gen_waiting()
        record_depths(self.store, self.tracer, not self.scored)

    def _sample_gen_waiting(self) -> None:
        self.tracer.add_samples(
            "rows waiting", "queue-gen", [(time.perf_counter(), self._gen_waiting)]
        )

    def _begin(self, iteration: int) -> list[list[Prompt]]:
        prompts = self.next_prompts()
        with self._cond:
            self._sizes[iteration] = len(prompts)
            self._cond.notify_all()
        self._gen_waiting += len(prompts) * self.params.group_size
        self._sample_gen_waiting()
        per_task = self.params.prompts_per_task
        return [prompts[i : i + per_task] for i in range(0, len(prompts), per_task)]

    def _learner_backlog_full(self) -> bool:
        if not self.params.queue_size:
            return False
        waiting = self.store.depth(GENERATED, LEARNER, groups=True, units=True)
        return waiting >= self.params.queue_size

    def _record(self, result: TaskResult) -> None:
        origin, track = self.tracer.origin, f"worker-{result.worker}"
        self.tracer.add(Span("generate", track, result.start - origin, result.end - origin))
        self.tracer.add_samples("slots", track, result.occupancy)
        for name, t0, t1 in result.spans:  # tool calls: where episodes waited on their tools
            self.tracer.add(Span(name, f"{track} tools", t0 - origin, t1 - origin))
        self.on_result(result)


class Dispatch:
    """The producer's FIFO of work items for the run (`sync v` notices and tasks) and who has
    room: `run` hands out the head while a worker has a free task slot (the one with the most),
    a sync going to every worker; tasks wait while `hold()` says the learner is backed up."""

    def __init__(self, pool: Pool, tasks_in_flight: int, hold: Callable[[], bool]) -> None:
        self.pool, self.hold = pool, hold
        # ("sync", v, fingerprints) | ("task", k, id, prompts)
        self.fifo: collections.deque = collections.deque()
        self.free = [tasks_in_flight] * pool.num_workers
        self.remaining: dict[int, int] = {}  # iteration -> its tasks not finished
        self.iteration_of: dict[int, int] = {}  # task id handed out -> its iteration
        self.next_id = 0

    def sync(self, version: int, expected: Fingerprints | None = None) -> None:
        self.fifo.append(("sync", version, expected))

    def add(self, iteration: int, tasks: list[list[Prompt]]) -> None:
        self.remaining[iteration] = self.remaining.get(iteration, 0) + len(tasks)
        for prompts in tasks:
            self.fifo.append(("task", iteration, self.next_id, prompts))
            self.next_id += 1

    def run(self) -> None:
        while self.fifo:
            item = self.fifo[0]
            if item[0] == "sync":
                for wid in range(self.pool.num_workers):
                    self.pool.send_sync_to(wid, item[1], item[2])
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
