"""The deterministic test double of a `Pool`: worker threads in this process.

Each slot is a thread running the real `WorkerLoop` over in-process queues, so the producer,
the weight barrier, admission and recovery are exercised exactly as with processes, without
spawning anything. `make_worker(wid)` builds a slot's worker and the function that loads a
published version into it (called again for a replacement). A worker "dies" when its engine or
reward raises `WorkerKilled`: its thread ends without a word, as a killed process would, and
the next `poll` that finds nothing raises `WorkerDied` for it.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import traceback
from collections.abc import Callable
from typing import Any

from cadence.backend.pool import InFlight, Lost
from cadence.backend.procs import WorkerDied, WorkerError
from cadence.backend.weights import WeightSync
from cadence.backend.worker_loop import WorkerLoop
from cadence.models.fingerprint import Fingerprints
from cadence.types import Prompt

# a slot's worker, what loads a version into it and, optionally, the fingerprints of what its
# engine holds (WorkerLoop's `held`)
MakeWorker = Callable[[int], tuple]


class WorkerKilled(BaseException):
    """Raised inside a fake worker: its thread ends as a killed process would."""


class ThreadPool:
    """`Pool` over `num_workers` worker threads; `resent` lists the uids of prompts sent again
    to replacements, in order."""

    def __init__(
        self,
        make_worker: MakeWorker,
        num_workers: int,
        weights: WeightSync,
        timeout_s: float = 30.0,
    ) -> None:
        self.make_worker, self.weights, self.timeout_s = make_worker, weights, timeout_s
        self.results: queue.Queue = queue.Queue()
        self.pending: list = []  # received while waiting for a ready, not yet polled
        self.resent: list[str] = []
        self.inboxes: list[queue.Queue] = [queue.Queue() for _ in range(num_workers)]
        self.threads: list[threading.Thread] = [threading.Thread() for _ in range(num_workers)]
        self.in_flight = [InFlight() for _ in range(num_workers)]
        for wid in range(num_workers):
            self._start(wid)
        self._await_ready(set(range(num_workers)))

    def _start(self, wid: int) -> None:
        worker, load_weights, *rest = self.make_worker(wid)  # and what its engine holds, if told
        inbox: queue.Queue = queue.Queue()
        held = rest[0] if rest else None
        loop = WorkerLoop(wid, worker, load_weights, inbox, self.results, held, "fake")

        def run() -> None:
            try:
                loop.run()
            except WorkerKilled:
                pass
            except BaseException:
                self.results.put(("error", wid, traceback.format_exc()))

        thread = threading.Thread(target=run, name=f"cadence-fake-worker-{wid}", daemon=True)
        thread.start()
        self.inboxes[wid], self.threads[wid] = inbox, thread

    def _await_ready(self, wids: set[int]) -> None:
        while wids:
            message = self.results.get(timeout=self.timeout_s)
            if message[0] == "ready" and message[1] in wids:
                wids.discard(message[1])
            else:
                self._note(message)
                self.pending.append(message)

    def _note(self, message: tuple[str, int, Any]) -> None:
        kind, wid, payload = message
        if kind == "error":
            raise WorkerError(f"worker {wid} failed:\n{payload}")
        if kind == "groups":
            self.in_flight[wid].returned(payload)

    @property
    def num_workers(self) -> int:
        return len(self.threads)

    def submit(self, wid: int, task_id: int, prompts: list[Prompt], iteration: int) -> None:
        self.in_flight[wid].add(task_id, prompts, iteration)
        self.inboxes[wid].put(("rollout", (task_id, prompts, iteration)))

    def send_sync_to(self, wid: int, version: int, expected: Fingerprints | None = None) -> None:
        self.inboxes[wid].put(("sync", (version, expected)))

    def has_in_flight(self) -> bool:
        return any(self.in_flight)

    def poll(self, timeout_s: float) -> tuple[str, int, Any] | None:
        if self.pending:
            return self.pending.pop(0)
        try:
            message = self.results.get(timeout=timeout_s)
        except queue.Empty:  # a dead thread's messages are all in the queue by now
            for wid, thread in enumerate(self.threads):
                if not thread.is_alive():
                    raise WorkerDied(f"worker {wid} died", wid) from None
            return None
        self._note(message)
        return message

    def replace(self, wid: int) -> Lost:
        self.pending = [m for m in self.pending if not (m[0] == "ack" and m[1] == wid)]
        lost, self.in_flight[wid] = self.in_flight[wid].tasks, InFlight()
        self.resent.extend(p.uid for prompts, _ in lost.values() for p in prompts)
        self._start(wid)
        self._await_ready({wid})
        return lost

    def close(self) -> None:
        for inbox in self.inboxes:
            with contextlib.suppress(Exception):
                inbox.put(("stop", None))
        for t in self.threads:
            t.join(timeout=10)
