"""The reward stage: reward worker processes that score responses as they reach the sample store.

Failure is loud, as with rollout workers: a reward worker that cannot build its scorer, raises
while scoring or exits makes the driver stop with `WorkerError` (with the worker's traceback) or
`WorkerDied`, close the store (which wakes the learner, who re-raises it) and leave no process.
A dead reward worker is not replaced. This module must not import transformers at import time.

Read on: docs/pipeline.md#the-sample-store-and-the-reward-stage.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from dataclasses import dataclass

import torch

from cadence.backend.procs import Processes, Sender, WorkerDied, owner_gone
from cadence.dataplane import SCORER, Store, StoreClosed, record_depths
from cadence.metrics.trace import Span, Tracer
from cadence.rewards import RewardSpec, build_batch_scorer
from cadence.types import SampleRow


@dataclass
class ScoreResult:
    job: int
    rewards: list[float]
    errors: list[str | None]
    start: float  # time.perf_counter() in the worker (comparable across processes)
    end: float


GRACE_S = 60.0  # beyond the calls' own worst case: starting, scheduling, the reply's trip


def work_limit_s(spec: RewardSpec, num_calls: int, floor_s: float) -> float:
    """How long a reward worker may take over a message of `num_calls` calls before it is
    taken for hung: `floor_s` (pipeline.worker_timeout_s), or where longer the message's own
    worst case, every call running to its deadline (reward.timeout_s), reward.concurrency at a
    time (one where unset: a reward's own default is never more parallel than the key), plus
    `GRACE_S`. 32 calls of 10 s one at a time may take 320 s: a fixed 300 s failed them."""
    if spec.kind != "rule" or spec.timeout_s <= 0:  # no deadline per call to derive one from
        return floor_s
    waves = math.ceil(num_calls / max(spec.concurrency or 1, 1))
    return max(floor_s, waves * spec.timeout_s + GRACE_S)


class JobClock:
    """Each message in flight to a reward worker, and when its answer is overdue."""

    def __init__(self) -> None:
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
                    f"reward worker {wid} did not answer a message of {calls} calls within "
                    f"{limit:.0f}s (pipeline.worker_timeout_s, or the calls' own worst case: "
                    "reward.timeout_s per call, reward.concurrency at a time)"
                )


def reward_worker_main(wid: int, spec: RewardSpec, inbox, results) -> None:
    """A reward worker process: ('score', (job, data)) or, rule rewards only, ('calls', (job,
    reward calls)) in, ('scored', wid, ScoreResult) out of `results`, the write end of its own
    pipe."""
    outbox = Sender(results)
    try:
        torch.set_num_threads(spec.threads)
        scorer = build_batch_scorer(spec)
        outbox.put(("ready", wid, None))
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
            start = time.perf_counter()
            # "calls": a rollout worker's reward calls (reward_procs.py); "score": store rows
            rewards, errors = scorer.score_calls(data) if kind == "calls" else scorer(data)
            result = ScoreResult(job, rewards, errors, start, time.perf_counter())
            outbox.put(("scored", wid, result))
    except BaseException:
        outbox.report_error(wid)


class RewardStage:
    """`num_workers` reward worker processes and the driver thread that feeds them from `store`.

    Built (processes started, scorers loaded) at construction, so a broken reward fails before
    training starts; `start()` starts the driver; `failure` holds what stopped it.
    """

    def __init__(
        self,
        spec: RewardSpec,
        num_workers: int,
        store: Store,
        tracer: Tracer,
        *,
        batch_size: int = 32,
        timeout_s: float = 300.0,
    ) -> None:
        self.spec, self.store, self.tracer = spec, store, tracer
        self.batch_size, self.timeout_s = batch_size, timeout_s
        self.rows_scored = 0
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._jobs: dict[int, tuple[int, list[SampleRow]]] = {}  # job -> (worker, rows)
        self._clock = JobClock()
        self.processes = Processes(
            "reward worker", reward_worker_main, lambda wid: (spec,), timeout_s, tag="reward"
        )
        self.processes.start(num_workers)
        self._free = list(range(num_workers))

    @property
    def num_workers(self) -> int:
        return len(self.processes)

    def start(self) -> None:
        if self._thread is None:
            thread = threading.Thread(target=self._run, name="cadence-reward", daemon=True)
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
        job = 0
        while not self._stop.is_set():
            if self._free:
                batch = self.store.get(
                    self.spec.fields,
                    self.batch_size,
                    SCORER,
                    timeout=0.02 if self._jobs else 0.5,
                    groups=False,
                    min_size=1,
                )
                if batch.rows:
                    wid = self._free.pop(0)
                    self.processes.send(wid, ("score", (job, batch.data)))
                    self._jobs[job] = (wid, batch.rows)
                    limit = work_limit_s(self.spec, len(batch.rows), self.timeout_s)
                    self._clock.sent(job, wid, len(batch.rows), limit)
                    job += 1
                    record_depths(self.store, self.tracer, reward_stage=True)
            if self._jobs:
                self._collect(timeout_s=0.0 if self._free else 0.5)
            self._clock.check()

    def _collect(self, timeout_s: float) -> bool:
        """Put the scores of the micro-batches finished within `timeout_s` into the store;
        False if none came. A reward worker that is gone raises `WorkerDied`."""
        messages = self.processes.receive(timeout_s)
        for kind, wid, payload in messages:
            if kind == "error":
                raise self.processes.failed(wid, payload)
            result: ScoreResult = payload
            _, rows = self._jobs.pop(result.job)
            self._clock.answered(result.job)
            self.store.put(rows, {"reward": result.rewards, "reward_error": result.errors})
            self.rows_scored += len(rows)
            self._free.append(wid)
            origin = self.tracer.origin
            start, end = result.start - origin, result.end - origin
            self.tracer.add(Span("score", f"reward-{wid}", start, end))
            record_depths(self.store, self.tracer, reward_stage=True)
        if (gone := self.processes.dead()) is not None:
            held = sum(len(rows) for w, rows in self._jobs.values() if w == gone)
            raise WorkerDied(f"{self.processes.exited(gone)}; rows in flight: {held}", gone)
        return bool(messages)

    def close(self) -> None:
        """Stop the driver, then every reward worker; terminate, then kill, any that lingers."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self.processes.close()
