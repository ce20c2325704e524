"""Ray backend: the same inference workers as Ray actors, on this machine or across a cluster.

The design in full: docs/internals.md, `cadence/backend/ray/pool.py`.
"""

from __future__ import annotations

import collections
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from cadence.backend.pool import InFlight, Lost, TaskResult
from cadence.backend.procs import WorkerDied, WorkerError
from cadence.backend.ray.cluster import missing, ray_request, shutdown_ray, start_ray
from cadence.backend.ray.weights import (
    BroadcastReceiver,
    BroadcastWeights,
    ObjectStoreReceiver,
    ObjectStoreWeights,
    RayWeights,
)
from cadence.backend.worker_loop import WorkerLoop
from cadence.rollout import WorkerSpec, build_worker
from cadence.types import Prompt

_DRAIN_S = 1.0  # longest a `drain` call waits for a message before returning none
_RESOURCE_KEYS = (
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
        loop = WorkerLoop(wid, worker, self.receiver.load, self.inbox, self.outbox)
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
                    self.receiver.stage(payload, weights)
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


class RayPool:
    """`Pool` over `num_workers` worker actors; see the module docstring."""

    def __init__(
        self,
        spec: WorkerSpec,
        model: torch.nn.Module,
        num_workers: int,
        *,
        timeout_s: float = 300.0,
        address: str | None = None,
        num_cpus: int = 0,
        num_cpus_per_worker: float = 1.0,
        num_gpus_per_worker: float = 0.0,
        custom_resources: dict[str, float] | None = None,
        weight_sync: str = "object_store",
    ) -> None:
        """`custom_resources`: Ray resources each actor reserves besides its CPUs and GPUs
        (`pipeline.ray_worker_resources`), which pin workers to the nodes that offer them."""
        self.timeout_s = timeout_s
        self.weights: RayWeights
        broadcast: str | None = None  # the collective's backend, if weights are broadcast
        group: BroadcastWeights | None = None
        if weight_sync == "broadcast":
            self.weights = group = BroadcastWeights(model)
            broadcast = group.backend
        else:
            self.weights = ObjectStoreWeights(model)
        self._actors: list = []
        self._closed = False
        self._started = start_ray(address, num_cpus)
        try:
            custom = custom_resources or {}
            resources = ray_request(num_cpus_per_worker, num_gpus_per_worker, custom)
            self._start_actors(spec, num_workers, resources, broadcast)
            if group is not None:
                self._form_group(group, address)
        except BaseException:
            self.close()
            raise

    def _start_actors(
        self, spec: WorkerSpec, num_workers: int, resources: dict, broadcast: str | None
    ) -> None:
        import ray

        self._spec, self._resources, self._broadcast = spec, resources, broadcast
        self._remote = ray.remote(RayWorker).options(
            num_cpus=resources.get("CPU", 0),
            num_gpus=resources.get("GPU", 0),
            resources={k: v for k, v in resources.items() if k not in ("CPU", "GPU")},
            max_concurrency=4,
        )
        self._actors = [
            self._remote.remote(wid, spec, broadcast, list(sys.path)) for wid in range(num_workers)
        ]
        self._seq = [0] * num_workers
        self._in_flight = [InFlight() for _ in range(num_workers)]
        self._drains = {wid: a.drain.remote(_DRAIN_S) for wid, a in enumerate(self._actors)}
        self._received: collections.deque = collections.deque()
        self._where: list[tuple[str, int]] = [("?", -1)] * num_workers
        self._clock_offset = [0.0] * num_workers
        self._await_ready(resources, set(range(num_workers)))

    def _await_ready(self, resources: dict, pending: set[int]) -> None:
        """Wait for 'ready' from the actors in `pending`; other messages are kept for `poll`.
        Actors that no live node can hold stop the wait at once (`_check_placeable`)."""
        import ray

        others: list = []
        deadline = time.monotonic() + self.timeout_s
        while pending:
            self._check_placeable(resources, pending)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Ray workers {sorted(pending)} did not start within {self.timeout_s:.0f}s: "
                    f"does the cluster have {resources} free for each ({_RESOURCE_KEYS}; "
                    "`ray status`)?"
                )
            message = self._next(min(1.0, self.timeout_s))
            if message is None:
                continue
            kind, wid, _ = message
            if kind == "ready" and wid in pending:
                pending.discard(wid)
            elif wid in pending:
                raise WorkerError(f"worker {wid} sent '{kind}' while starting")
            else:
                others.append(message)
        self._received.extendleft(reversed(others))
        driver = ray.get_runtime_context().get_node_id()
        for wid, actor in enumerate(self._actors):
            before = time.perf_counter()
            node, ip, pid, clock = ray.get(actor.where.remote())
            self._where[wid] = (ip, pid)
            if node != driver:  # another machine's clock: place its spans on ours
                self._clock_offset[wid] = (before + time.perf_counter()) / 2 - clock

    def _check_placeable(self, resources: dict, pending: set[int]) -> None:
        """Raise `WorkerError` when no live node has `resources`: Ray would keep the actors
        pending for ever (a worker node lost with the only nodes that offered them)."""
        lack = missing(resources)
        if lack is not None:
            raise WorkerError(
                f"Ray workers {sorted(pending)} cannot start: each needs {resources} and {lack} "
                f"({_RESOURCE_KEYS}; `ray status`)"
            )

    def _form_group(self, weights: BroadcastWeights, address: str | None) -> None:
        import ray

        host = ray.util.get_node_ip_address() if address else None
        init_method, env = weights.rendezvous(host)
        world_size = self.num_workers + 1
        joins = [
            a.join_group.remote(
                weights.backend, init_method, wid + 1, world_size, env, self.timeout_s
            )
            for wid, a in enumerate(self._actors)
        ]
        _await_group(
            lambda: weights.join(init_method, world_size, env, self.timeout_s),
            joins,
            self.timeout_s,
        )

    @property
    def num_workers(self) -> int:
        return len(self._actors)

    def submit(self, wid: int, task_id: int, prompts: list[Prompt], iteration: int) -> None:
        self._in_flight[wid].add(task_id, prompts, iteration)
        self._send(wid, "rollout", (task_id, prompts, iteration))

    def send_sync_to(self, wid: int, version: int) -> None:
        self._send(wid, "sync", version, self.weights.message(version))

    def _send(self, wid: int, kind: str, payload: Any, weights: Any = None) -> None:
        self._actors[wid].send.remote(self._seq[wid], kind, payload, weights)
        self._seq[wid] += 1

    def has_in_flight(self) -> bool:
        return any(self._in_flight)

    def replace(self, wid: int) -> Lost:
        """A fresh actor in slot `wid` (same resources); the old one's unreturned tasks."""
        import ray

        if self._broadcast is not None:
            raise WorkerDied(
                f"worker {wid} cannot be replaced with pipeline.weight_sync = 'broadcast' (a new "
                "actor cannot join the running collective group); use 'object_store'",
                wid,
            )
        lack = missing(self._resources)
        if lack is not None:  # its node is gone, and with it the last that offered them
            ip, pid = self._where[wid]
            raise WorkerDied(
                f"worker {wid} (Ray actor, pid {pid} on {ip}) cannot be replaced: a worker needs "
                f"{self._resources} and {lack} ({_RESOURCE_KEYS}; `ray status`)",
                wid,
            )
        ray.kill(self._actors[wid])
        self._received = collections.deque(  # a dead worker's acknowledgements mean nothing
            m for m in self._received if not (m[0] == "ack" and m[1] == wid)
        )
        lost, self._in_flight[wid] = self._in_flight[wid].tasks, InFlight()
        self._actors[wid] = self._remote.remote(wid, self._spec, None, list(sys.path))
        self._seq[wid] = 0
        self._drains[wid] = self._actors[wid].drain.remote(_DRAIN_S)
        self._await_ready(self._resources, {wid})
        return lost

    def poll(self, timeout_s: float) -> tuple[str, int, Any] | None:
        """The next ('groups', wid, TaskResult) or ('ack', wid, version), or None after
        `timeout_s`; raises if a worker failed or died."""
        message = self._next(timeout_s)
        if message is None:
            return None
        kind, wid, _ = message
        if kind not in ("groups", "ack"):
            raise WorkerError(f"worker {wid} sent '{kind}' while tasks were running")
        return message

    def _next(self, timeout_s: float) -> tuple[str, int, Any] | None:
        """One message from any actor, fetching what their pending `drain`s brought back."""
        import ray

        deadline = time.monotonic() + timeout_s
        while not self._received and not self._closed:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            by_ref = {ref: wid for wid, ref in self._drains.items()}
            ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=left)
            for ref in ready:
                wid = by_ref[ref]
                try:
                    messages = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    raise self._died(wid, e) from None
                self._drains[wid] = self._actors[wid].drain.remote(_DRAIN_S)
                for kind, sender, payload in messages:
                    if kind == "groups":  # struck off now: a replacement is not sent them again
                        self._in_flight[sender].returned(payload)
                        self._to_driver_clock(payload)
                self._received.extend(messages)
        if not self._received:
            return None
        kind, wid, payload = self._received.popleft()
        if kind == "error":
            raise WorkerError(f"worker {wid} failed:\n{payload}")
        return kind, wid, payload

    def _died(self, wid: int, error: Exception) -> WorkerDied:
        ip, pid = self._where[wid]
        # Ray's message: a headline, tab-indented details, then the cause on its last line.
        lines = [line for line in str(error).splitlines() if line.strip() and line[0] != "\t"]
        cause = lines[-1].rstrip(".") if lines else type(error).__name__
        return WorkerDied(
            f"worker {wid} (Ray actor, pid {pid} on {ip}) died: {cause}; "
            f"prompts in flight: {self._in_flight[wid].shown()}",
            wid,
        )

    def _to_driver_clock(self, result: TaskResult) -> None:
        offset = self._clock_offset[result.worker]
        if offset:
            result.start += offset
            result.end += offset
            result.occupancy = [(t + offset, n) for t, n in result.occupancy]
            result.spans = [(name, a + offset, b + offset) for name, a, b in result.spans]

    def close(self) -> None:
        """Kill the actors, leave the weights' group, and shut down a Ray this pool started."""
        if self._closed:
            return
        self._closed = True
        import ray

        for actor in self._actors:
            ray.kill(actor)
        self.weights.close()
        if self._started:
            shutdown_ray()


def _await_group(join_learner: Callable[[], None], joins: list, timeout_s: float) -> None:
    """The learner joins the weights' group (`join_learner`) while the actors' `joins` run: in a
    thread, so that an actor that fails to join is reported at once, not after the group's
    timeout."""
    import ray

    failed: list[BaseException] = []

    def join() -> None:
        try:
            join_learner()
        except BaseException as e:
            failed.append(e)

    learner = threading.Thread(target=join, name="cadence-join-weights", daemon=True)
    learner.start()
    deadline, pending = time.monotonic() + timeout_s, list(joins)
    while pending or learner.is_alive():
        if failed:
            raise failed[0]
        if pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.2)
            ray.get(done)  # an actor's own error, now
        else:
            learner.join(timeout=0.2)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the weights' broadcast group did not form within {timeout_s:.0f}s")
    if failed:
        raise failed[0]
