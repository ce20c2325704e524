"""Reward processes for one rollout worker: its groups scored off the engine's thread.

A colocated run with `reward.stage = "separate"` (the default with vLLM on a GPU) hands each
finished group's reward calls here instead of scoring them between decode steps: an in-process
vLLM engine shares one GIL with whatever else runs in its process, so a reward computed there
(math-verify: milliseconds to seconds a response) stalls the GPU. Each batch of calls goes to a
free reward worker (`reward_worker_main`, the reward stage's processes) and comes back as a
future, as `RewardRunner.submit` gives. A worker that fails or dies fails every future in
flight and every later call, with its traceback or exit code: never a silent zero.

Read on: docs/pipeline.md#how-it-is-built.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections import deque
from collections.abc import Sequence

from cadence.backend.procs import Processes, WorkerDied
from cadence.backend.reward_stage import REWARD_LIMIT, ScoreResult, reward_worker_main, work_limit_s
from cadence.backend.store_stage import JobClock
from cadence.metrics.trace import Span, Tracer
from cadence.rewards import RewardCall, RewardResult, RewardSpec

_Batch = tuple[list[RewardCall], "cf.Future[list[RewardResult]]"]  # one submit's calls


class RewardProcesses:
    """`num_workers` reward worker processes behind `submit(calls)` and `score(calls)`.

    Started and their scorers built at construction (a reward that cannot load fails before any
    generation); `close()` stops them. `tracer`, when given, gets a "score" span per batch."""

    def __init__(
        self,
        spec: RewardSpec,
        num_workers: int,
        *,
        batch_size: int = 32,
        timeout_s: float = 300.0,
        tracer: Tracer | None = None,
    ) -> None:
        if spec.kind != "rule":
            raise ValueError("reward processes beside a rollout worker score rule rewards only")
        self.batch_size, self.timeout_s, self.tracer = batch_size, timeout_s, tracer
        self.failure: BaseException | None = None
        self.processes = Processes(
            "reward worker", reward_worker_main, lambda wid: (spec,), timeout_s, tag="reward"
        )
        self.processes.start(num_workers)
        self._free = list(range(num_workers))
        self._waiting: deque[_Batch] = deque()
        self._jobs: dict[int, tuple[int, list[_Batch]]] = {}  # job -> (worker, its batches)
        self._next_job = 0
        self._clock = JobClock("reward worker", REWARD_LIMIT)
        self._spec = spec
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cadence-reward-procs", daemon=True)
        self._thread.start()

    def submit(self, calls: Sequence[RewardCall]) -> cf.Future[list[RewardResult]]:
        """Start `calls` in a reward worker (the next free one, with whatever else waits for
        one, up to `batch_size` calls); a future of their results, in order."""
        future: cf.Future[list[RewardResult]] = cf.Future()
        with self._lock:
            if self.failure is not None:
                future.set_exception(self.failure)
                return future
            self._waiting.append((list(calls), future))
            self._dispatch()
        return future

    def score(self, calls: Sequence[RewardCall]) -> list[RewardResult]:
        return self.submit(calls).result()

    def close(self) -> None:
        """Stop the receiving thread, then every reward worker."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self.processes.close()
        self._fail(RuntimeError("the reward processes were closed"))

    def _dispatch(self) -> None:
        """Under the lock: the waiting batches to free workers, as many to each as fit in
        `batch_size` calls (at least one): a worker scores one message at a time, and its
        runner keeps `reward.concurrency` calls of it in flight."""
        while self._free and self._waiting:
            batches = [self._waiting.popleft()]
            size = len(batches[0][0])
            while self._waiting and size + len(self._waiting[0][0]) <= self.batch_size:
                batches.append(self._waiting.popleft())
                size += len(batches[-1][0])
            wid = self._free.pop(0)
            calls = [call for batch, _ in batches for call in batch]
            self.processes.send(wid, ("calls", (self._next_job, calls)))
            self._jobs[self._next_job] = (wid, batches)
            limit = work_limit_s(self._spec, len(calls), self.timeout_s)
            self._clock.sent(self._next_job, wid, len(calls), limit)
            self._next_job += 1

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._collect(timeout_s=0.05)
                with self._lock:
                    self._clock.check()
        except BaseException as e:
            self._fail(e)

    def _collect(self, timeout_s: float) -> bool:
        messages = self.processes.receive(timeout_s)
        for kind, wid, payload in messages:
            if kind == "error":
                raise self.processes.failed(wid, payload)
            result: ScoreResult = payload
            with self._lock:
                _, batches = self._jobs.pop(result.job)
                self._clock.answered(result.job)
                self._free.append(wid)
                self._dispatch()
            scores = [
                RewardResult(v, e) for v, e in zip(result.rewards, result.errors, strict=True)
            ]
            for calls, future in batches:
                future.set_result(scores[: len(calls)])
                scores = scores[len(calls) :]
            if self.tracer is not None:
                origin = self.tracer.origin
                span = Span("score", f"reward-{wid}", result.start - origin, result.end - origin)
                self.tracer.add(span)
        if (gone := self.processes.dead()) is not None:
            held = len(self._jobs)
            raise WorkerDied(f"{self.processes.exited(gone)}; batches in flight: {held}", gone)
        return bool(messages)

    def _fail(self, error: BaseException) -> None:
        """Every future in flight or waiting, and every later call, fails with `error`."""
        with self._lock:
            if self.failure is None:
                self.failure = error
            batches = [b for _, held in self._jobs.values() for b in held] + list(self._waiting)
            futures = [future for _, future in batches]
            self._jobs.clear()
            self._waiting.clear()
        for future in futures:
            if not future.done():
                future.set_exception(self.failure)
