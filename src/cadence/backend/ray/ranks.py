"""Rank processes as Ray actors, one per bundle of a placement group, so ranks span machines.

Read on: docs/ray.md.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

from cadence.backend.procs import WorkerDied, WorkerError
from cadence.backend.ranks import BUILD, Calls, Factory
from cadence.backend.ray.cluster import missing, shutdown_ray, start_ray

_KEYS = "learner.num_cpus_per_rank, learner.num_gpus_per_rank, learner.ray_rank_resources"


class RankActor:
    """One rank (made remote by `RayRanks`): the factory's object, and the calls it answers."""

    def __init__(self, rank: int, factory: Factory, spawn_args: tuple, sys_path: list[str]):
        sys.path.extend(p for p in sys_path if p not in sys.path)  # reward modules by path
        self.rank, self.factory, self.spawn_args = rank, factory, spawn_args
        self.obj: Any = None

    def where(self) -> tuple[str, str, int, float]:
        """(node id, node address, pid, this process's clock)."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        return node, ray.util.get_node_ip_address(), os.getpid(), time.perf_counter()

    def free_port(self) -> int:
        """A port free on this actor's node right now (for rank 0's rendezvous)."""
        import ray

        with socket.socket() as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            return s.getsockname()[1]

    def call(self, method: str, args: tuple) -> Any:
        if method == BUILD:
            self.obj = self.factory(self.rank, *self.spawn_args, *args)
            return None
        return getattr(self.obj, method)(*args)


class RayRanks:
    """`num_ranks` rank actors in one placement group (see the module docstring)."""

    def __init__(
        self,
        factory: Factory,
        num_ranks: int,
        spawn_args: tuple = (),
        *,
        resources: dict[str, float] | None = None,
        address: str | None = None,
        num_cpus: int = 0,
        timeout_s: float = 300.0,
        name: str = "learner rank",
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.num_ranks, self.timeout_s, self.name = num_ranks, timeout_s, name
        self.calls = Calls(num_ranks, name)
        self.refs: list[list] = [[] for _ in range(num_ranks)]
        self._actors: list = []
        self._group = None
        self._started = start_ray(address, num_cpus)
        bundle = {"CPU": 1.0} | {k: v for k, v in (resources or {}).items() if v}
        try:
            lack = missing(bundle)
            if lack is not None:  # Ray would wait for such a node for ever
                raise WorkerError(f"{name}s cannot start: each needs {bundle} and {lack} ({_KEYS})")
            self._group = placement_group([dict(bundle) for _ in range(num_ranks)], "PACK")
            if not self._group.wait(timeout_seconds=timeout_s):
                raise TimeoutError(
                    f"{num_ranks} {name}s of {bundle} each did not fit the Ray cluster within "
                    f"{timeout_s:.0f}s ({_KEYS}; `ray status`)"
                )
            remote = ray.remote(RankActor)
            self._actors = [
                remote.options(
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, r),
                ).remote(r, factory, spawn_args, list(sys.path))
                for r in range(num_ranks)
            ]
            self.where = ray.get([a.where.remote() for a in self._actors], timeout=timeout_s)
        except BaseException:
            self.close()
            raise

    def clock_offsets(self) -> list[float]:
        """Per rank: what to add to its clock to read ours (0 on the driver's node)."""
        import ray

        driver = ray.get_runtime_context().get_node_id()
        offsets = []
        for actor, (node, *_rest) in zip(self._actors, self.where, strict=True):
            before = time.perf_counter()
            clock = ray.get(actor.where.remote(), timeout=self.timeout_s)[3]
            offsets.append(0.0 if node == driver else (before + time.perf_counter()) / 2 - clock)
        return offsets

    def rendezvous_address(self) -> tuple[str, int]:
        """(rank 0's node address, a port free there)."""
        import ray

        port = ray.get(self._actors[0].free_port.remote(), timeout=self.timeout_s)
        return self.where[0][1], port

    def call(self, rank: int, method: str, *args: Any) -> None:
        self.calls.sent(rank, method)
        self.refs[rank].append(self._actors[rank].call.remote(method, args))

    def poll(self) -> None:
        self._fetch(0.0)

    def wait(self, timeout_s: float | None = None) -> list[list[Any]]:
        """Every reply due; a rank silent for `timeout_s` (default: the transport's) is late
        (`backend.ranks`)."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        while not self.calls.done():
            left = self.calls.time_left(limit)
            if left <= 0:
                raise self.calls.timeout(limit)
            self._fetch(min(left, 1.0))
        return self.calls.take()

    def _fetch(self, timeout_s: float) -> None:
        """Take in every finished call, in each rank's order, waiting up to `timeout_s` for the
        first one when none has finished."""
        import ray

        wait_s = timeout_s
        while not self.calls.done():
            heads = {refs[0]: rank for rank, refs in enumerate(self.refs) if refs}
            ready, _ = ray.wait(list(heads), num_returns=1, timeout=wait_s)
            if not ready:
                return
            for ref in ready:
                rank = heads[ref]
                self.refs[rank].pop(0)
                self.calls.answered(rank, self._get(rank, ref))
            wait_s = 0.0

    def _get(self, rank: int, ref) -> Any:
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            _, ip, pid, _ = self.where[rank]
            lines = [x for x in str(e).splitlines() if x.strip() and x[0] != "\t"]
            cause = lines[-1].rstrip(".") if lines else type(e).__name__
            raise WorkerDied(
                f"{self.name} {rank} (Ray actor, pid {pid} on {ip}) died: {cause}", rank
            ) from None
        except ray.exceptions.RayTaskError as e:
            raise WorkerError(f"{self.name} {rank} failed:\n{e}") from None

    def close(self) -> None:
        """Kill the actors, remove the placement group, and shut down a Ray this started."""
        import ray

        if not ray.is_initialized():
            return
        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._group)
            self._group = None
        if self._started:
            shutdown_ray()  # and its reaper
