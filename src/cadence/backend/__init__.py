"""How work reaches processes and machines, and how weights travel to them.

Rollout workers (`cadence.rollout`, each run by a `WorkerLoop`) in slots of a `Pool`: spawned
processes (`LocalPool`), Ray actors (`RayPool`, `backend.ray.pool`) or threads
(`backend.fake.ThreadPool`, the test double); reward workers (`RewardStage`) on the same process
machinery (`procs`); weight transports behind `WeightSync` (shared memory, Ray's object store, a
torch.distributed broadcast; `InMemoryWeights` the fake), each with its receiving half, and
`learner_sync` for an engine with its own copy in the learner's process. It must
not know what an iteration is, which engine or reward a worker holds, nor read the config: the
run builder passes plain values. Ray is imported only inside the Ray modules' functions, when
asked for.
"""

from __future__ import annotations

from typing import Any

import torch

from cadence.backend.local import LocalPool
from cadence.backend.placement import Placement, PlacementError, place, visible_gpus
from cadence.backend.pool import InFlight, Lost, Pool, TaskResult
from cadence.backend.procs import Processes, WorkerDied, WorkerError
from cadence.backend.reward_procs import RewardProcesses
from cadence.backend.reward_stage import RewardStage
from cadence.backend.weights import (
    InMemoryWeights,
    LearnerAdapter,
    LearnerWeights,
    Receiver,
    SharedReceiver,
    SharedWeights,
    WeightSync,
    learner_sync,
)
from cadence.backend.worker_loop import WorkerLoop
from cadence.dataplane import SampleStore, Store
from cadence.rollout import WorkerSpec


def make_pool(
    backend: str,
    spec: WorkerSpec,
    model: torch.nn.Module,
    num_workers: int,
    *,
    timeout_s: float = 300.0,
    placement: Placement | None = None,
    **ray_options: Any,
) -> tuple[Pool, Store]:
    """`num_workers` rollout workers on `backend` ("local" or "ray"), started and ready, and the
    run's sample store beside them (in this process, or in a Ray actor). `placement`: the GPUs
    each local worker sees (None: this process's). `ray_options` are `RayPool`'s keyword
    arguments (address, num_cpus, per-worker resources, weight_sync)."""
    if backend == "local":
        if ray_options:
            raise ValueError(f"the local backend takes no Ray options; got {sorted(ray_options)}")
        env = placement.worker_env if placement is not None else None
        pool = LocalPool(spec, SharedWeights(model), num_workers, timeout_s=timeout_s, env=env)
        return pool, SampleStore()
    if backend != "ray":
        raise ValueError(f"unknown backend {backend!r}; choose 'local' or 'ray'")
    from cadence.backend.ray.pool import RayPool
    from cadence.backend.ray.store import ActorStore

    ray_pool = RayPool(spec, model, num_workers, timeout_s=timeout_s, **ray_options)
    try:
        return ray_pool, ActorStore()
    except BaseException:
        ray_pool.close()
        raise


__all__ = [
    "InFlight",
    "InMemoryWeights",
    "LearnerAdapter",
    "LearnerWeights",
    "LocalPool",
    "Lost",
    "Placement",
    "PlacementError",
    "Pool",
    "Processes",
    "Receiver",
    "RewardProcesses",
    "RewardStage",
    "SharedReceiver",
    "SharedWeights",
    "TaskResult",
    "WeightSync",
    "WorkerDied",
    "WorkerError",
    "WorkerLoop",
    "learner_sync",
    "make_pool",
    "place",
    "visible_gpus",
]
