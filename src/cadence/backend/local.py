"""The local backend: rollout workers as spawned processes on this machine.

Each worker process builds its worker from a `WorkerSpec` and runs `WorkerLoop` in its main
thread (so math-verify keeps its signal-based timeouts), loading weights out of the shared-memory
copy (`SharedWeights`) handed to it once at spawn. `LocalPool` implements `Pool` over the slots
of `procs.Processes`: it never lets a failure hang (every wait has a timeout and checks that
workers are alive), a worker's exception comes back with its traceback, and a dead worker can be
`replace`d in its slot.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import torch

from cadence.backend.pool import InFlight, Lost
from cadence.backend.procs import Processes, Sender, WorkerDied, WorkerError
from cadence.backend.weights import SharedReceiver, SharedWeights
from cadence.backend.worker_loop import WorkerLoop
from cadence.models.fingerprint import Fingerprints
from cadence.rollout import WorkerSpec, build_worker
from cadence.types import Prompt


def worker_main(wid: int, spec: WorkerSpec, tensors: dict, inbox, results) -> None:
    """A worker process: build, then loop; `results` is the write end of its own pipe."""
    from cadence.models import ModelLoadError

    outbox = Sender(results)
    try:
        torch.set_num_threads(spec.threads)
        target, worker = build_worker(spec)
    except ModelLoadError as e:  # the model, not the worker, is at fault: the run exits 2
        outbox.put(("refused", wid, str(e)))
        return
    except BaseException:
        outbox.report_error(wid)
        return
    try:
        receiver = SharedReceiver(tensors, target)
        held = target.held_fingerprint
        WorkerLoop(wid, worker, receiver.load, inbox, outbox, held, spec.engine).run()
    except BaseException:
        outbox.report_error(wid)


class LocalPool:
    """`num_workers` spawned worker processes in fixed slots; a dead one can be `replace`d."""

    def __init__(
        self,
        spec: WorkerSpec,
        weights: SharedWeights,
        num_workers: int,
        timeout_s: float = 300.0,
        env: Callable[[int], dict[str, str]] | None = None,
    ) -> None:
        """`env(wid)`: what worker `wid`'s environment adds (its GPUs: placement.py)."""
        self.spec = spec
        self.weights = weights
        self.timeout_s = timeout_s
        self._pending: collections.deque = collections.deque()  # received, not yet handed out
        self.processes = Processes("worker", worker_main, self._args, timeout_s, env=env)
        self._in_flight = [InFlight() for _ in range(num_workers)]
        self._keep(self.processes.start(num_workers))

    @property
    def num_workers(self) -> int:
        return len(self.processes)

    def _args(self, wid: int) -> tuple:
        return (self.spec, self.weights.tensors)

    def submit(self, wid: int, task_id: int, prompts: list[Prompt], iteration: int) -> None:
        self._in_flight[wid].add(task_id, prompts, iteration)
        self.processes.send(wid, ("rollout", (task_id, prompts, iteration)))

    def send_sync_to(self, wid: int, version: int, expected: Fingerprints | None = None) -> None:
        self.processes.send(wid, ("sync", (version, expected)))

    def has_in_flight(self) -> bool:
        return any(self._in_flight)

    def poll(self, timeout_s: float) -> tuple[str, int, Any] | None:
        """The next ('groups', wid, TaskResult) or ('ack', wid, version), or None after
        `timeout_s`; raises if a worker failed or died."""
        deadline = time.monotonic() + timeout_s
        while not self._pending:
            if not self._receive(min(0.5, timeout_s)):
                self._check_alive()
                if time.monotonic() > deadline:
                    return None
        kind, wid, payload = self._pending.popleft()
        if kind == "error":
            raise self.processes.failed(wid, payload)
        if kind not in ("groups", "ack"):
            raise WorkerError(f"worker {wid} sent '{kind}' while tasks were running")
        return kind, wid, payload

    def replace(self, wid: int) -> Lost:
        """Start a fresh worker in slot `wid` (it loads no version until sent a sync); return
        the tasks the old one still held, by id, with only the prompts it had not returned."""
        self.processes.stop(wid)
        while self._receive(0.0):  # whatever the old worker sent before it died is here now
            pass
        self._pending = collections.deque(  # a dead worker's acknowledgements mean nothing
            m for m in self._pending if not (m[0] == "ack" and m[1] == wid)
        )
        lost, self._in_flight[wid] = self._in_flight[wid].tasks, InFlight()
        self.processes.respawn(wid)
        self._keep(self.processes.await_ready({wid}))
        return lost

    def _receive(self, timeout_s: float) -> bool:
        """Keep every message that arrives within `timeout_s`; False if none."""
        messages = self.processes.receive(timeout_s)
        self._keep(messages)
        return bool(messages)

    def _keep(self, messages: list) -> None:
        for message in messages:
            kind, wid, payload = message
            if kind == "groups":  # struck off now: a replacement is not sent them again
                self._in_flight[wid].returned(payload)
            self._pending.append(message)

    def _check_alive(self) -> None:
        wid = self.processes.dead()
        if wid is None:
            return
        while self._receive(0.0):  # its last results are in flight no more
            pass
        raise WorkerDied(
            f"{self.processes.exited(wid)}; prompts in flight: {self._in_flight[wid].shown()}", wid
        )

    def close(self) -> None:
        """Stop every worker; terminate, then kill, any that does not exit in time."""
        self.processes.close()
