"""A stage of worker processes fed from the sample store: a driver thread takes the rows its
store task has not consumed yet, sends each batch to a free worker and puts the answer back as
fields. The reward stage (reward_stage.py) and the teacher stage (teacher_stage.py) are two of it.

Failure is loud, as with rollout workers: a worker that cannot build what it needs, raises while
working or exits makes the driver stop with `WorkerError` (with the worker's traceback) or
`WorkerDied`, close the store (which wakes the learner, who re-raises it) and leave no process.
A dead stage worker is not replaced. This module must not import transformers at import time.

Read on: docs/pipeline.md#the-sample-store-and-the-reward-stage.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cadence.backend.procs import Processes, Sender, WorkerDied, owner_gone
from cadence.dataplane import Store, StoreClosed, record_depths
from cadence.metrics.trace import Span, Tracer
from cadence.types import SampleRow


def answer_messages(
    wid: int, inbox, outbox: Sender, answer: Callable[[str, int, Any], Any]
) -> None:
    """A stage worker's loop, once it is built: each (kind, (job, data)) of its inbox answered
    with ('scored', wid, answer(kind, job, data)) until ('stop', ...) or its owner is gone."""
    parent = os.getppid()
    while True:
        try:
            kind, payload = inbox.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent or owner_gone():  # the learner died
                return
            continue
        if kind == "stop":
            return
        job, data = payload
        outbox.put(("scored", wid, answer(kind, job, data)))


class JobClock:
    """Each message in flight to a stage worker, and when its answer is overdue."""

    def __init__(self, name: str = "reward worker", why: str = "") -> None:
        self.name, self.why = name, why  # the limit's keys, for the error
        self._due: dict[int, tuple[float, float, int, int]] = {}  # job -> (due, limit, wid, calls)

    def sent(self, job: int, wid: int, num_calls: int, limit_s: float) -> None:
        self._due[job] = (time.monotonic() + limit_s, limit_s, wid, num_calls)

    def answered(self, job: int) -> None:
        self._due.pop(job, None)

    def check(self) -> None:
        """Raise `TimeoutError` for the first message past its limit."""
        now = time.monotonic()
        for due, limit, wid, calls in self._due.values():
            if now > due:
                raise TimeoutError(
                    f"{self.name} {wid} did not answer a message of {calls} calls within "
                    f"{limit:.0f}s ({self.why or 'pipeline.worker_timeout_s'})"
                )


@dataclass(frozen=True)
class StageWork:
    """What a stage does: the store task it consumes as, the fields it reads, what a worker's
    answer writes (`written(answer)`: field -> one value per row), how long a message of n rows
    may take (`limit_s(n)`), and the span its workers' work is drawn as on their track."""

    task: str
    fields: tuple[str, ...]
    written: Callable[[Any], dict[str, list]]
    limit_s: Callable[[int], float]
    clock: JobClock
    span: str = "score"


class StoreStage:
    """`processes` (started: their workers built) and the driver thread that feeds them from
    `store`; `start()` starts the driver; `failure` holds what stopped it."""

    def __init__(
        self, work: StageWork, processes: Processes, store: Store, tracer: Tracer, batch_size: int
    ) -> None:
        self.work, self.processes, self.store, self.tracer = work, processes, store, tracer
        self.batch_size = batch_size
        self.rows_done = 0
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._jobs: dict[int, tuple[int, list[SampleRow]]] = {}  # job -> (worker, rows)
        self._free = list(range(len(processes)))

    @property
    def num_workers(self) -> int:
        return len(self.processes)

    def start(self) -> None:
        if self._thread is None:
            name = f"cadence-{self.work.task}"
            thread = threading.Thread(target=self._run, name=name, daemon=True)
            thread.start()  # kept once started: close() never joins a thread that never ran
            self._thread = thread

    # --- driver thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except StoreClosed:  # the run is closing, or another stage failed and said why
            return
        except BaseException as e:  # surfaces in the learner's thread
            self.failure = e
            self.store.close()

    def _loop(self) -> None:
        job, work = 0, self.work
        while not self._stop.is_set():
            if self._free:
                batch = self.store.get(
                    work.fields,
                    self.batch_size,
                    work.task,
                    timeout=0.02 if self._jobs else 0.5,
                    groups=False,
                    min_size=1,
                )
                if batch.rows:
                    wid = self._free.pop(0)
                    self.processes.send(wid, ("score", (job, batch.data)))
                    self._jobs[job] = (wid, batch.rows)
                    work.clock.sent(job, wid, len(batch.rows), work.limit_s(len(batch.rows)))
                    job += 1
                    self._record_depths()
            if self._jobs:
                self._collect(timeout_s=0.0 if self._free else 0.5)
            work.clock.check()

    def _collect(self, timeout_s: float) -> bool:
        """Put the answers to the messages finished within `timeout_s` into the store; False if
        none came. A worker that is gone raises `WorkerDied`."""
        messages = self.processes.receive(timeout_s)
        for kind, wid, payload in messages:
            if kind == "error":
                raise self.processes.failed(wid, payload)
            _, rows = self._jobs.pop(payload.job)
            self.work.clock.answered(payload.job)
            self.store.put(rows, self.work.written(payload))
            self.rows_done += len(rows)
            self._free.append(wid)
            origin = self.tracer.origin
            track = f"{self.processes.tag}-{wid}"
            self.tracer.add(
                Span(self.work.span, track, payload.start - origin, payload.end - origin)
            )
            self._record_depths()
        if (gone := self.processes.dead()) is not None:
            held = sum(len(rows) for w, rows in self._jobs.values() if w == gone)
            raise WorkerDied(f"{self.processes.exited(gone)}; rows in flight: {held}", gone)
        return bool(messages)

    def _record_depths(self) -> None:
        """Rows waiting for the learner and for this stage: "rows waiting" on the tracks
        queue-train and queue-TAG (the stage figures and the timeline read them)."""
        record_depths(self.store, self.tracer, reward_stage=False)
        waiting = self.store.depth(self.work.fields, self.work.task)
        queue = f"queue-{self.processes.tag}"
        self.tracer.add_samples("rows waiting", queue, [(time.perf_counter(), waiting)])

    def close(self) -> None:
        """Stop the driver, then every worker; terminate, then kill, any that lingers."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self.processes.close()
