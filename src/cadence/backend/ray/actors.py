"""The rollout workers of a Ray pool as actors: what runs inside each (`RayWorker`: the worker
`build_worker` makes, its weights' receiver and its message loop) and the driver's handles on them
(`RayActors`: started with their resources, where each runs and its clock, replaced, killed).
The Pool's traffic (tasks, weights, results) is backend/ray/pool.py's. Ray is imported inside
functions only. docs/ray.md.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
import traceback
from typing import Any

import torch

from cadence.backend.pool import TaskResult
from cadence.backend.procs import WorkerDied, WorkerError
from cadence.backend.ray.cluster import missing
from cadence.backend.ray.weights import BroadcastReceiver, ObjectStoreReceiver
from cadence.backend.worker_loop import WorkerLoop
from cadence.rollout import WorkerSpec, build_worker

RESOURCE_KEYS = (
    "pipeline.num_cpus_per_worker, pipeline.num_gpus_per_worker, pipeline.ray_worker_resources"
)


class _Outbox:
    """The loop's outbox inside an actor: `put` by the loop, `drain` by the driver."""

    def __init__(self) -> None:
        self._items: list = []
        self._cond = threading.Condition()

    def put(self, item) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()

    def drain(self, wait_s: float) -> list:
        with self._cond:
            if not self._items:
                self._cond.wait(wait_s)
            items, self._items = self._items, []
        return items


class RayWorker:
    """A worker actor (made remote by `RayPool`): `build_worker` plus `WorkerLoop`."""

    def __init__(
        self, wid: int, spec: WorkerSpec, broadcast: str | None, sys_path: list[str]
    ) -> None:
        """`broadcast`: the torch.distributed backend weights arrive by, or None (object store)."""
        import ray

        # The driver's import path, as a spawned local worker gets it (reward modules by path).
        sys.path.extend(p for p in sys_path if p not in sys.path)
        self.wid, self.spec = wid, spec
        self.inbox: queue.Queue = queue.Queue()
        self.outbox = _Outbox()
        self._pending: dict[int, tuple[str, Any, Any]] = {}
        self._next_seq = 0
        self._lock = threading.Lock()
        self.receiver: ObjectStoreReceiver | BroadcastReceiver | None = None
        self.group: BroadcastReceiver | None = None  # the receiver that joins the group
        try:
            torch.set_num_threads(spec.threads)
            weights, worker = build_worker(spec)
            weights.to("cuda" if ray.get_gpu_ids() else "cpu")
            if broadcast is None:
                self.receiver = ObjectStoreReceiver(weights)
            else:
                device = "cuda" if broadcast == "nccl" else "cpu"
                self.receiver = self.group = BroadcastReceiver(weights, device)
        except BaseException:
            self.outbox.put(("error", wid, traceback.format_exc()))
            return
        held = weights.held_fingerprint
        loop = WorkerLoop(
            wid, worker, self.receiver.load, self.inbox, self.outbox, held, spec.engine
        )
        threading.Thread(target=self._run, args=(loop,), name="cadence-worker", daemon=True).start()

    def _run(self, loop: WorkerLoop) -> None:
        try:
            torch.set_num_threads(self.spec.threads)  # with OpenMP the setting is per thread
            loop.run()
        except BaseException:
            self.outbox.put(("error", self.wid, traceback.format_exc()))

    def send(self, seq: int, kind: str, payload: Any, weights: Any = None) -> None:
        with self._lock:
            self._pending[seq] = (kind, payload, weights)
            while self._next_seq in self._pending:
                kind, payload, weights = self._pending.pop(self._next_seq)
                if kind == "sync" and self.receiver is not None:
                    self.receiver.stage(payload[0], weights)
                self.inbox.put((kind, payload))
                self._next_seq += 1

    def drain(self, wait_s: float) -> list:
        return self.outbox.drain(wait_s)

    def where(self) -> tuple[str, str, int, float]:
        """(node id, node address, pid, this process's clock): for messages and the timeline."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        return node, ray.util.get_node_ip_address(), os.getpid(), time.perf_counter()

    def join_group(self, *member) -> None:
        """`BroadcastReceiver.join(*member)`: this actor's place in the weights' group."""
        if self.group is None:
            raise RuntimeError(f"worker {self.wid} receives weights from the object store")
        self.group.join(*member)


class RayActors:
    """The driver's handles on a pool's worker actors, each with `resources`."""

    def __init__(self, spec: WorkerSpec, resources: dict, broadcast: str | None) -> None:
        import ray

        self.spec, self.resources, self.broadcast = spec, resources, broadcast
        self._remote = ray.remote(RayWorker).options(
            num_cpus=resources.get("CPU", 0),
            num_gpus=resources.get("GPU", 0),
            resources={k: v for k, v in resources.items() if k not in ("CPU", "GPU")},
            max_concurrency=4,
        )
        self.handles: list = []
        self.where: list[tuple[str, int]] = []  # (node address, pid) of each
        self.clock_offset: list[float] = []  # what places its spans on the driver's clock

    def __len__(self) -> int:
        return len(self.handles)

    def __getitem__(self, wid: int):
        return self.handles[wid]

    def start(self, wid: int, broadcast: str | None = None) -> None:
        """A new actor in slot `wid` (the next one, or in place of the actor there);
        `broadcast`: the backend it joins the weights' group with (a first start only)."""
        actor = self._remote.remote(wid, self.spec, broadcast, list(sys.path))
        if wid == len(self.handles):
            self.handles.append(actor)
            self.where.append(("?", -1))
            self.clock_offset.append(0.0)
        else:
            self.handles[wid] = actor

    def locate(self, wid: int) -> None:
        """Where actor `wid` runs, and its clock against the driver's (another machine's)."""
        import ray

        driver = ray.get_runtime_context().get_node_id()
        before = time.perf_counter()
        node, ip, pid, clock = ray.get(self.handles[wid].where.remote())
        self.where[wid] = (ip, pid)
        if node != driver:
            self.clock_offset[wid] = (before + time.perf_counter()) / 2 - clock

    def check_placeable(self, pending: set[int]) -> None:
        """Raise `WorkerError` when no live node has the resources: Ray would keep the actors
        pending for ever (a worker node lost with the only nodes that offered them)."""
        lack = missing(self.resources)
        if lack is not None:
            raise WorkerError(
                f"Ray workers {sorted(pending)} cannot start: each needs {self.resources} and "
                f"{lack} ({RESOURCE_KEYS}; `ray status`)"
            )

    def check_replaceable(self, wid: int) -> None:
        """Raise `WorkerDied` when actor `wid` cannot be replaced: a broadcast group takes no
        new member, and no live node may offer its resources any more."""
        if self.broadcast is not None:
            raise WorkerDied(
                f"worker {wid} cannot be replaced with pipeline.weight_sync = 'broadcast' (a new "
                "actor cannot join the running collective group); use 'object_store'",
                wid,
            )
        lack = missing(self.resources)
        if lack is not None:  # its node is gone, and with it the last that offered them
            ip, pid = self.where[wid]
            raise WorkerDied(
                f"worker {wid} (Ray actor, pid {pid} on {ip}) cannot be replaced: a worker needs "
                f"{self.resources} and {lack} ({RESOURCE_KEYS}; `ray status`)",
                wid,
            )

    def died(self, wid: int, error: Exception, in_flight: str) -> WorkerDied:
        """What the driver raises for actor `wid`'s death, with Ray's cause."""
        ip, pid = self.where[wid]
        # Ray's message: a headline, tab-indented details, then the cause on its last line.
        lines = [line for line in str(error).splitlines() if line.strip() and line[0] != "\t"]
        cause = lines[-1].rstrip(".") if lines else type(error).__name__
        return WorkerDied(
            f"worker {wid} (Ray actor, pid {pid} on {ip}) died: {cause}; "
            f"prompts in flight: {in_flight}",
            wid,
        )

    def to_driver_clock(self, result: TaskResult) -> None:
        offset = self.clock_offset[result.worker]
        if offset:
            result.start += offset
            result.end += offset
            result.occupancy = [(t + offset, n) for t, n in result.occupancy]
            result.spans = [(name, a + offset, b + offset) for name, a, b in result.spans]

    def kill(self, wid: int | None = None) -> None:
        """Kill actor `wid`, or every actor."""
        import ray

        for actor in self.handles if wid is None else [self.handles[wid]]:
            ray.kill(actor)
