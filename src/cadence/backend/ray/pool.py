"""Ray backend: the same inference workers as Ray actors, on this machine or across a cluster.

Read on: docs/ray.md.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from cadence.backend.pool import InFlight, Lost
from cadence.backend.procs import WorkerError
from cadence.backend.ray.actors import RESOURCE_KEYS, RayActors
from cadence.backend.ray.cluster import ray_request, shutdown_ray, start_ray
from cadence.backend.ray.weights import (
    BroadcastWeights,
    ObjectStoreWeights,
    RayWeights,
)
from cadence.models.fingerprint import Fingerprints
from cadence.rollout import WorkerSpec
from cadence.types import Prompt

_DRAIN_S = 1.0  # longest a `drain` call waits for a message before returning none


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
        self._actors: RayActors | None = None
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
        self._actors = actors = RayActors(spec, resources, broadcast)
        for wid in range(num_workers):
            actors.start(wid, broadcast)
        self._seq = [0] * num_workers
        self._in_flight = [InFlight() for _ in range(num_workers)]
        self._drains = {wid: actors[wid].drain.remote(_DRAIN_S) for wid in range(num_workers)}
        self._received: collections.deque = collections.deque()
        self._await_ready(set(range(num_workers)))

    @property
    def actors(self) -> RayActors:
        assert self._actors is not None, "started in __init__"
        return self._actors

    def _await_ready(self, pending: set[int]) -> None:
        """Wait for 'ready' from the actors in `pending`; other messages are kept for `poll`.
        Actors that no live node can hold stop the wait at once."""
        others: list = []
        deadline = time.monotonic() + self.timeout_s
        waiting = set(pending)
        while waiting:
            self.actors.check_placeable(waiting)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Ray workers {sorted(waiting)} did not start within {self.timeout_s:.0f}s: "
                    f"does the cluster have {self.actors.resources} free for each "
                    f"({RESOURCE_KEYS}; `ray status`)?"
                )
            message = self._next(min(1.0, self.timeout_s))
            if message is None:
                continue
            kind, wid, _ = message
            if kind == "ready" and wid in waiting:
                waiting.discard(wid)
            elif wid in waiting:
                raise WorkerError(f"worker {wid} sent '{kind}' while starting")
            else:
                others.append(message)
        self._received.extendleft(reversed(others))
        for wid in pending:
            self.actors.locate(wid)

    def _form_group(self, weights: BroadcastWeights, address: str | None) -> None:
        import ray

        host = ray.util.get_node_ip_address() if address else None
        init_method, env = weights.rendezvous(host)
        world_size = self.num_workers + 1
        joins = [
            a.join_group.remote(
                weights.backend, init_method, wid + 1, world_size, env, self.timeout_s
            )
            for wid, a in enumerate(self.actors.handles)
        ]
        _await_group(
            lambda: weights.join(init_method, world_size, env, self.timeout_s),
            joins,
            self.timeout_s,
        )

    @property
    def num_workers(self) -> int:
        return len(self.actors)

    def submit(self, wid: int, task_id: int, prompts: list[Prompt], iteration: int) -> None:
        self._in_flight[wid].add(task_id, prompts, iteration)
        self._send(wid, "rollout", (task_id, prompts, iteration))

    def send_sync_to(self, wid: int, version: int, expected: Fingerprints | None = None) -> None:
        self._send(wid, "sync", (version, expected), self.weights.message(version))

    def _send(self, wid: int, kind: str, payload: Any, weights: Any = None) -> None:
        self.actors[wid].send.remote(self._seq[wid], kind, payload, weights)
        self._seq[wid] += 1

    def has_in_flight(self) -> bool:
        return any(self._in_flight)

    def replace(self, wid: int) -> Lost:
        """A fresh actor in slot `wid` (same resources); the old one's unreturned tasks."""
        self.actors.check_replaceable(wid)
        self.actors.kill(wid)
        self._received = collections.deque(  # a dead worker's acknowledgements mean nothing
            m for m in self._received if not (m[0] == "ack" and m[1] == wid)
        )
        lost, self._in_flight[wid] = self._in_flight[wid].tasks, InFlight()
        self.actors.start(wid)
        self._seq[wid] = 0
        self._drains[wid] = self.actors[wid].drain.remote(_DRAIN_S)
        self._await_ready({wid})
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
                    raise self.actors.died(wid, e, self._in_flight[wid].shown()) from None
                self._drains[wid] = self.actors[wid].drain.remote(_DRAIN_S)
                for kind, sender, payload in messages:
                    if kind == "groups":  # struck off now: a replacement is not sent them again
                        self._in_flight[sender].returned(payload)
                        self.actors.to_driver_clock(payload)
                self._received.extend(messages)
        if not self._received:
            return None
        kind, wid, payload = self._received.popleft()
        if kind == "error":
            raise WorkerError(f"worker {wid} failed:\n{payload}")
        return kind, wid, payload

    def close(self) -> None:
        """Kill the actors, leave the weights' group, and shut down a Ray this pool started."""
        if self._closed:
            return
        self._closed = True
        if self._actors is not None:
            self._actors.kill()
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
