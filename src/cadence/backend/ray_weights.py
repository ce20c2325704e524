"""Weight sync for the Ray backend: each version reaches every worker actor once.

The design in full: docs/internals.md, `cadence/backend/ray_weights.py`.
"""

from __future__ import annotations

import datetime
import os
import shutil
import socket
import tempfile
import warnings
from typing import Any, Protocol

import numpy as np
import torch

from cadence.backend.weights import WeightSync
from cadence.engine import EngineWeights


class RayWeights(WeightSync, Protocol):
    num_bytes: int  # what one version weighs

    def message(self, version: int) -> Any: ...

    def close(self) -> None: ...


def num_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def _from_numpy(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():  # the object store's arrays are read-only; we only read them
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(a)
    return t.view(dtype) if dtype == torch.bfloat16 else t


class ObjectStoreWeights:
    def __init__(self, model: torch.nn.Module) -> None:
        self.num_bytes = num_bytes(model)
        self._latest: tuple[int, Any] | None = None  # (version, ObjectRef)

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        import ray

        arrays = {name: _to_numpy(p) for name, p in model.named_parameters()}
        self._latest = (version, ray.put(arrays))  # the put copies: training may go on

    def message(self, version: int) -> Any:
        if self._latest is None or self._latest[0] != version:
            held = None if self._latest is None else self._latest[0]
            raise RuntimeError(f"sync of version {version} asked, the object store holds {held}")
        return [self._latest[1]]  # in a list, so that Ray passes the reference, not the value

    def close(self) -> None:
        self._latest = None


class ObjectStoreReceiver:
    def __init__(self, weights: EngineWeights) -> None:
        self.weights = weights
        self._refs: dict[int, Any] = {}

    def stage(self, version: int, message: Any) -> None:
        self._refs[version] = message[0]

    def load(self, version: int) -> None:
        import ray

        arrays = ray.get(self._refs[version])
        self._refs = {v: ref for v, ref in self._refs.items() if v > version}
        dtypes = {name: p.dtype for name, p in self.weights.named_parameters()}
        tensors = {name: _from_numpy(a, dtypes[name]) for name, a in arrays.items()}
        self.weights.load(tensors, version)


class _Flat:
    """One flat buffer per dtype on `device`, and a view of it shaped like each parameter."""

    def __init__(self, model: torch.nn.Module | EngineWeights, device: str) -> None:
        params = list(model.named_parameters())
        sizes: dict[torch.dtype, int] = {}
        for _, p in params:
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
        self.buffers = [torch.empty(n, dtype=dt, device=device) for dt, n in sizes.items()]
        by_dtype = dict(zip(sizes, self.buffers, strict=True))
        offsets = dict.fromkeys(sizes, 0)
        self.views: dict[str, torch.Tensor] = {}
        for name, p in params:
            start = offsets[p.dtype]
            self.views[name] = by_dtype[p.dtype][start : start + p.numel()].view_as(p)
            offsets[p.dtype] = start + p.numel()


def collective_backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


class BroadcastWeights:
    """The learner's side (rank 0); `join` forms the group once every actor is asked to."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.num_bytes = num_bytes(model)
        self.device = str(next(model.parameters()).device)
        self.backend = collective_backend(self.device)
        self._flat = _Flat(model, self.device)
        self._pending: list = []  # the broadcasts of the last version, until they are done
        self._dir: str | None = None  # the rendezvous file's folder, on one machine

    def rendezvous(self, host: str | None) -> tuple[str, dict[str, str]]:
        """Where the group meets (init_method) and the environment its members need: over TCP
        at `host` (the learner's node) across machines; on one machine (`host` None) through a
        file, with the group's own sockets on loopback."""
        if host is not None:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            return f"tcp://{host}:{port}", {}
        self._dir = tempfile.mkdtemp(prefix="cadence-group-")
        loopback = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
        return "file://" + os.path.join(self._dir, "store"), loopback

    def join(self, init_method: str, world_size: int, env: dict, timeout_s: float) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError(
                "pipeline.weight_sync = 'broadcast' needs its own torch.distributed group, and "
                "this process already has one: use pipeline.weight_sync = 'object_store'"
            )
        _init_group(self.backend, init_method, 0, world_size, env, timeout_s)

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        import torch.distributed as dist

        for work in self._pending:  # the barrier has every worker's ack: these are done
            work.wait()
        for name, p in model.named_parameters():
            self._flat.views[name].copy_(p)
        self._pending = [dist.broadcast(b, src=0, async_op=True) for b in self._flat.buffers]

    def message(self, version: int) -> Any:
        return None

    def close(self) -> None:
        import torch.distributed as dist

        self._pending = []
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _init_group(
    backend: str, init_method: str, rank: int, world_size: int, env: dict, timeout_s: float
) -> None:
    import torch.distributed as dist

    os.environ.update(env)  # read by gloo and NCCL when the group forms
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


class BroadcastReceiver:
    def __init__(self, weights: EngineWeights, device: str) -> None:
        self.weights = weights
        self._flat = _Flat(weights, device)

    def join(
        self,
        backend: str,
        init_method: str,
        rank: int,
        world_size: int,
        env: dict,
        timeout_s: float,
    ) -> None:
        _init_group(backend, init_method, rank, world_size, env, timeout_s)

    def stage(self, version: int, message: Any) -> None:
        pass

    @torch.no_grad()
    def load(self, version: int) -> None:
        import torch.distributed as dist

        for b in self._flat.buffers:
            dist.broadcast(b, src=0)
        self.weights.load(self._flat.views, version)
