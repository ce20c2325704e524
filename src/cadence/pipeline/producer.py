"""The producer: a thread that hands each iteration's prompts to the workers and puts their groups
in the sample store. The learner's side of it is `source.WorkerSource`, a `GroupSource`.

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
import threading
import time
from collections.abc import Callable

from cadence.backend import Pool, TaskResult, WeightGate, WorkerDied
from cadence.dataplane import GENERATED, LEARNER, Store, StoreClosed, group_rows, record_depths
from cadence.metrics.trace import Span, Tracer
from cadence.pipeline.recovery import Recovery
from cadence.types import Group, Prompt


class Producer:
    """The producer thread (see the module docstring); the learner's side is
    `source.WorkerSource`, which reads `sizes` (iteration -> its prompts, once begun) under
    `cond`, asks for extra prompts (`want`), and re-raises `failure`."""

    def __init__(
        self,
        pool: Pool,
        store: Store,
        tracer: Tracer,
        gate: WeightGate,
        recovery: Recovery,
        next_prompts: Callable[[], list[Prompt]],
        *,
        prompts_per_task: int,
        tasks_in_flight: int,
        max_staleness: int = 0,
        queue_size: int = 0,
        iterations: int | None = None,
        first_iteration: int = 0,
        group_size: int = 1,
        scored: bool = True,
        next_extra: Callable[[int], Prompt] | None = None,
        on_result: Callable[[TaskResult], None] = lambda result: None,
    ) -> None:
        self.pool, self.store, self.tracer = pool, store, tracer
        self.gate, self.recovery = gate, recovery
        self.next_prompts, self.next_extra = next_prompts, next_extra
        self.prompts_per_task, self.tasks_in_flight = prompts_per_task, tasks_in_flight
        self.max_staleness = max_staleness
        self.queue_size = queue_size  # most groups waiting for the learner before tasks pause
        self.iterations = iterations  # None: begin iterations for as long as admission allows
        self.first_iteration = first_iteration  # a resumed run begins where it stopped
        self.group_size = group_size  # samples per prompt: the generation queue's depth in rows
        self.scored = scored  # the workers score; else a reward stage writes the rewards
        self.on_result = on_result  # told of every worker result, as it arrives
        self.cond = threading.Condition()  # guards `sizes` and `_wanted`
        self.sizes: dict[int, int] = {}  # iteration -> its prompts, once begun
        self.failure: BaseException | None = None
        self.rows_generated = 0  # rows put in the store, over the run
        self._wanted: list[tuple[int, int]] = []  # (iteration, position) of extra prompts
        self._next_group, self._next_row = 0, 0  # store ids, in arrival order
        self._gen_waiting = 0  # rows begun, not yet put
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread, once."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._produce, name="cadence-producer", daemon=True
            )
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def want(self, iteration: int, position: int) -> None:
        """One more prompt for `iteration`, at `position` in it (dynamic sampling)."""
        with self.cond:
            self._wanted.append((iteration, position))
            self.cond.notify_all()

    def stop(self) -> None:
        """Stop the thread (before the workers, so that it cannot mistake stopped ones for dead)."""
        self._stop.set()
        with self.cond:
            self.cond.notify_all()
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
            with self.cond:
                self.cond.notify_all()
            self.store.close()

    def _produce_loop(self) -> None:
        dispatch = Dispatch(self.pool, self.tasks_in_flight, self._learner_backlog_full)
        begun, last_word = self.first_iteration, time.monotonic()
        while not self._stop.is_set():
            new_versions, admit = self.gate.take()
            for v in new_versions:
                dispatch.sync(v)
            for iteration, position in self._take_wanted():
                dispatch.add(iteration, [[self._draw_extra(position)]])
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

    def _take_wanted(self) -> list[tuple[int, int]]:
        with self.cond:
            wanted, self._wanted = self._wanted, []
        return wanted

    def _draw_extra(self, position: int) -> Prompt:
        assert self.next_extra is not None
        self._gen_waiting += self.group_size
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
        with self.cond:
            self.sizes[iteration] = len(prompts)
            self.cond.notify_all()
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
        self.fifo: collections.deque = collections.deque()  # ("sync", v) | ("task", k, id, ps)
        self.free = [tasks_in_flight] * pool.num_workers
        self.remaining: dict[int, int] = {}  # iteration -> its tasks not finished
        self.iteration_of: dict[int, int] = {}  # task id handed out -> its iteration
        self.next_id = 0

    def sync(self, version: int) -> None:
        self.fifo.append(("sync", version))

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
