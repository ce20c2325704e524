"""Weight sync for the Ray backend: each version reaches every worker actor once, through Ray's
object store or as a broadcast in buckets over a process group of its own (never the default
group, which a vLLM worker already holds): one bucket of extra memory on each worker, a snapshot
of the version on the learner (which trains on meanwhile).

Read on: docs/ray.md.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import socket
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
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


BUCKET_BYTES = 64 << 20  # a broadcast's unit: the most extra memory a version takes per process


@dataclass(frozen=True)
class Bucket:
    """Consecutive parameters of one dtype, broadcast as one flat tensor: (name, shape, offset,
    numel) each, `numel` elements in all."""

    dtype: torch.dtype
    entries: tuple[tuple[str, torch.Size, int, int], ...]
    numel: int


def plan_buckets(model, bucket_bytes: int = BUCKET_BYTES) -> list[Bucket]:
    """The parameters of `model` (a model, or `EngineWeights`) in order, cut into buckets of at
    most `bucket_bytes` (a larger parameter is a bucket of its own)."""
    buckets: list[Bucket] = []
    entries: list[tuple[str, torch.Size, int, int]] = []
    dtype, numel = None, 0

    def close() -> None:
        if entries:
            buckets.append(Bucket(dtype, tuple(entries), numel))

    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if entries and (p.dtype != dtype or (numel * p.element_size() + size) > bucket_bytes):
            close()
            entries, numel = [], 0
        dtype = p.dtype
        entries.append((name, p.shape, numel, p.numel()))
        numel += p.numel()
    close()
    return buckets


class _Buffers:
    """One flat buffer per dtype on `device`, as large as the largest bucket of that dtype;
    `bytes` what they hold in all."""

    def __init__(self, buckets: list[Bucket], device: str) -> None:
        largest: dict[torch.dtype, int] = {}
        for b in buckets:
            largest[b.dtype] = max(largest.get(b.dtype, 0), b.numel)
        self.by_dtype = {dt: torch.empty(n, dtype=dt, device=device) for dt, n in largest.items()}
        self.bytes = sum(n * dt.itemsize for dt, n in largest.items())

    def flat(self, bucket: Bucket) -> torch.Tensor:
        return self.by_dtype[bucket.dtype][: bucket.numel]


def collective_backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def open_group(
    backend: str, init_method: str, rank: int, world_size: int, env: dict, timeout_s: float
):
    """A process group of the weights' own, built on a store of its own: never
    torch.distributed's default group, which a vLLM worker (or a learner rank) already holds."""
    import torch.distributed as dist

    os.environ.update(env)  # read by gloo and NCCL when the group forms
    timeout = datetime.timedelta(seconds=timeout_s)
    if init_method.startswith("file://"):
        store = dist.FileStore(init_method.removeprefix("file://"), world_size)
    else:
        host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
        store = dist.TCPStore(host, int(port), world_size, rank == 0, timeout=timeout)
    store = dist.PrefixStore("cadence-weights", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def _broadcast(group, tensor: torch.Tensor):
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


def _close_group(group) -> None:
    for method in ("shutdown", "abort"):  # NCCL's, to free its communicator now
        if hasattr(group, method):
            with contextlib.suppress(Exception):
                getattr(group, method)()
            return


class BroadcastWeights:
    """The learner's side (rank 0) of a broadcast in buckets. Publishing packs each bucket into a
    snapshot of the version and queues its broadcast at once, so the next bucket is packed while
    this one travels and the learner goes on training without waiting for the workers, who take
    the buckets when their loops act on the sync (one bucket of memory each). `join` forms the
    group once every actor is asked to."""

    def __init__(self, model: torch.nn.Module, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.num_bytes = num_bytes(model)
        self.device = str(next(model.parameters()).device)
        self.backend = collective_backend(self.device)
        self.buckets = plan_buckets(model, bucket_bytes)
        # the version in flight, bucket by bucket: the learner may train on while the workers
        # are still to take it (off-policy), so it cannot be read from the live parameters
        self._snapshot = [
            torch.empty(b.numel, dtype=b.dtype, device=self.device) for b in self.buckets
        ]
        self._pending: list = []  # the broadcasts of the last version, until they are done
        self._group = None
        self._dir: str | None = None  # the rendezvous file's folder, on one machine

    @property
    def buffer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._snapshot)

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
        self._group = open_group(self.backend, init_method, 0, world_size, env, timeout_s)

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        for work in self._pending:  # the barrier has every worker's ack: these are done
            work.wait()
        params = dict(model.named_parameters())
        self._pending = []
        for bucket, flat in zip(self.buckets, self._snapshot, strict=True):
            for name, shape, offset, numel in bucket.entries:
                flat[offset : offset + numel].view(shape).copy_(params[name])
            self._pending.append(_broadcast(self._group, flat))  # travels while the next packs

    def message(self, version: int) -> Any:
        return None

    def close(self) -> None:
        for work in self._pending:
            with contextlib.suppress(Exception):  # a member gone: nothing left to deliver to
                work.wait()
        self._pending = []
        if self._group is not None:
            _close_group(self._group)
            self._group = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


class BroadcastReceiver:
    """A worker's side: each bucket lands in one buffer and its parameters go straight into the
    engine (`EngineWeights.load_stream`) before the next bucket overwrites it: one bucket of
    extra memory, whatever the model's size."""

    def __init__(self, weights: EngineWeights, device: str, bucket_bytes: int = BUCKET_BYTES):
        self.weights = weights
        self.buckets = plan_buckets(weights, bucket_bytes)
        self._buffers = _Buffers(self.buckets, device)
        self._group = None

    @property
    def buffer_bytes(self) -> int:
        return self._buffers.bytes

    def join(
        self,
        backend: str,
        init_method: str,
        rank: int,
        world_size: int,
        env: dict,
        timeout_s: float,
    ) -> None:
        self._group = open_group(backend, init_method, rank, world_size, env, timeout_s)

    def stage(self, version: int, message: Any) -> None:
        pass

    @torch.no_grad()
    def load(self, version: int) -> None:
        self.weights.load_stream(self._received(), version)

    def _received(self) -> Iterator[tuple[str, torch.Tensor]]:
        # an engine with its own copy (vLLM) consumes the tensors in code that is not ours and
        # may hold one across a bucket's end: it gets each bucket as a tensor of its own
        own = self.weights.engine.owns_weights
        for bucket in self.buckets:
            flat = self._buffers.flat(bucket)
            _broadcast(self._group, flat).wait()
            flat = flat.clone() if own else flat
            for name, shape, offset, numel in bucket.entries:
                yield name, flat[offset : offset + numel].view(shape)

    def close(self) -> None:
        if self._group is not None:
            _close_group(self._group)
            self._group = None
