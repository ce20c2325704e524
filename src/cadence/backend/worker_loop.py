"""A rollout worker's life in any process: its message loop (the worker itself is built from a
`WorkerSpec` by `cadence.rollout.build_worker`, before the loop starts).

Read on: docs/pipeline.md#how-it-is-built.
"""

from __future__ import annotations

import collections
import os
import queue
import time
from collections.abc import Callable

from cadence.backend.pool import TaskResult
from cadence.backend.procs import owner_gone
from cadence.models.fingerprint import Fingerprints, check
from cadence.types import Group


class WorkerLoop:
    """A worker's message loop, whatever carries its messages (`inbox.get`, `outbox.put`) and
    its weights (`load_weights(version)` puts that version into the worker's model).

    A sync carries the version and, where the learner checks them, the fingerprints of what it
    published (`pipeline.verify_weights`): once loaded, `held(expected)` fingerprints what the
    engine now decodes with, and a difference stops the worker (`WeightMismatch`, naming the
    worker, its engine, the version and the tensors) before it samples anything with them."""

    def __init__(
        self,
        wid: int,
        worker,
        load_weights: Callable[[int], None],
        inbox,
        outbox,
        held: Callable[[Fingerprints], Fingerprints] | None = None,
        engine: str = "engine",
    ) -> None:
        self.wid, self.worker, self.load_weights = wid, worker, load_weights
        self.held, self.engine = held, engine
        self.inbox, self.outbox = inbox, outbox
        self.version = -1
        self.backlog: collections.deque = collections.deque()  # messages not yet acted on
        self.busy_since = 0.0
        self.occupancy: list[tuple[float, int]] = []
        self.spans: list[tuple[str, float, float]] = []  # tool calls not yet reported

    def run(self) -> None:
        try:
            self._run()
        finally:
            self.worker.close()  # what its episodes hold: threads, an environment's servers

    def _run(self) -> None:
        parent = os.getppid()
        self.outbox.put(("ready", self.wid, None))
        while True:
            self._receive(block=not self.worker.busy and not self.backlog)
            if os.getppid() != parent or owner_gone():  # the learner died without stopping us
                return
            if not self._act():
                return
            if self.worker.busy:
                self._step()

    def _receive(self, block: bool) -> None:
        try:
            self.backlog.append(self.inbox.get(timeout=1.0) if block else self.inbox.get_nowait())
            while True:
                self.backlog.append(self.inbox.get_nowait())
        except queue.Empty:
            pass

    def _act(self) -> bool:
        """Act on messages in order; a sync waits (with all behind it) until the engine drains."""
        while self.backlog:
            kind, payload = self.backlog[0]
            if kind == "stop":
                return False
            if kind == "sync":
                version, expected = payload
                if not self.worker.may_load(version):
                    return True
                if version > self.version:  # a version already loaded is acknowledged, not reread
                    self.load_weights(version)
                    self.version = version
                    self.worker.weights_loaded(version)
                if expected is not None and self.held is not None:  # before anything samples
                    who = f"worker {self.wid} ({self.engine} engine)"
                    check(expected, self.held(expected), who, version)
                self.outbox.put(("ack", self.wid, self.version))
            elif kind == "rollout":
                task_id, prompts, iteration = payload
                if not self.worker.busy:
                    self.busy_since = time.perf_counter()
                self.worker.submit(task_id, prompts, iteration, self.version)
            self.backlog.popleft()
        return True

    def _step(self) -> None:
        by_task: dict[int, list[Group]] = {}
        for task_id, group in self.worker.poll():
            by_task.setdefault(task_id, []).append(group)
        self.occupancy.extend(self.worker.take_occupancy())
        self.spans.extend(self.worker.take_spans())
        for task_id, groups in by_task.items():
            now = time.perf_counter()
            result = TaskResult(
                self.wid,
                task_id,
                groups,
                self.busy_since,
                now,
                task_done=self.worker.task_done(task_id),
                occupancy=self.occupancy,
                spans=self.spans,
            )
            self.outbox.put(("groups", self.wid, result))
            self.busy_since, self.occupancy, self.spans = now, [], []
