"""Fingerprints of weights: what proves that an engine holds the version it is labelled with.

A tensor's fingerprint is its dtype, its shape and a CRC-32 of the bytes of a fixed sample of its
elements (`BLOCKS` runs of `BLOCK` consecutive elements spread evenly over it, from its first to
its last), so it costs a gather of 64 elements per tensor, on whatever device the tensor lives,
not a pass over the weights. The learner fingerprints what it publishes; an engine with its own
copy fingerprints what it holds after a load, each element first cast to the dtype the learner
published (an engine may keep another dtype), and only the tensors it holds under the published
name and shape (vLLM's packed ones are split back first: engine/vllm_weights.py). A difference
is a load that did nothing, the wrong version, or lost weights: `WeightMismatch`, never a
warning. It must stay cheap (about 6 us a tensor): no pass over the weights, nothing kept alive.
docs/reliability.md#weights-you-can-prove.
"""

from __future__ import annotations

import functools
import itertools
import os
import weakref
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

BLOCKS, BLOCK = 4, 16  # runs of consecutive elements sampled per tensor, and their length
Fingerprint = tuple[str, tuple[int, ...], int]  # dtype, shape, hash of the sampled elements
Fingerprints = dict[str, Fingerprint]
Named = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class WeightMismatch(RuntimeError):
    """An engine holds other weights than the version it was told it has."""


@functools.lru_cache(maxsize=4096)
def _positions(numel: int) -> np.ndarray:
    """The sampled elements of a tensor of `numel` (integer arithmetic: a float linspace rounds
    past the end of a large tensor)."""
    if numel <= BLOCKS * BLOCK:
        return np.arange(numel, dtype=np.int64)
    last = numel - BLOCK  # the start of the last run: it ends at the last element
    starts = [i * last // (BLOCKS - 1) for i in range(BLOCKS)]
    return np.array([s + j for s in starts for j in range(BLOCK)], dtype=np.int64)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # numpy has no bf16
_NP_BITS = {1: "<u1", 2: "<i2", 4: "<i4", 8: "<i8"}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_fingerprint(t: torch.Tensor, dtype: torch.dtype | None = None) -> Fingerprint:
    """(dtype, shape, hash) of `t`, its sampled elements cast to `dtype` first (default its own)."""
    dtype = dtype or t.dtype
    if t.is_cpu and t.dtype == dtype and t.is_contiguous() and t.numel():  # read in place
        span = np.asarray(_Span(t.data_ptr(), t.numel(), _NP_BITS[t.element_size()]))
        return _name(dtype), tuple(t.shape), zlib.crc32(span[_positions(t.numel())].tobytes())
    return _Plan([("", t, dtype)]).run([t])[""]


class _Span:
    """The process's memory from `base` on, as numpy sees it: indexing reads only the elements
    indexed, all inside tensors the caller holds."""

    def __init__(self, base: int, count: int, typestr: str) -> None:
        self.__array_interface__ = {
            "data": (base, True), "shape": (count,), "typestr": typestr, "version": 3,
        }  # fmt: skip


class _Plan:
    """How to fingerprint a list of (name, tensor, dtype to hash in): the contiguous CPU tensors
    hashed in their own dtype are read from their memory in one gather per element size (where
    their sampled elements lie is worked out once), the others gathered where they live, one
    transfer per device. `run` reads tensors at the same addresses, shapes and dtypes."""

    def __init__(self, chosen: list[tuple[str, torch.Tensor, torch.dtype]]) -> None:
        self.names = [name for name, _, _ in chosen]
        self.meta = [(_name(dtype), tuple(t.shape)) for _, t, dtype in chosen]
        self.spans: list[tuple[int, str, np.ndarray, int, list[tuple[int, int]]]] = []
        self.gathered: dict[torch.device, list[tuple[int, torch.dtype]]] = defaultdict(list)
        in_place: dict[int, list[int]] = defaultdict(list)
        for i, (_, t, dtype) in enumerate(chosen):
            if t.is_cpu and t.dtype == dtype and t.is_contiguous() and t.numel():
                in_place[t.element_size()].append(i)
            else:
                self.gathered[t.device].append((i, dtype))
        for size, members in in_place.items():
            ptrs = [chosen[i][1].data_ptr() for i in members]
            base = min(ptrs)
            runs = [
                _positions(chosen[i][1].numel()) + (ptr - base) // size
                for i, ptr in zip(members, ptrs, strict=True)
            ]
            where, at, slices = np.concatenate(runs), 0, []
            for i, run in zip(members, runs, strict=True):
                slices.append((i, at))
                at += len(run) * size
            slices.append((-1, at))
            self.spans.append((base, _NP_BITS[size], where, int(where.max()) + 1, slices))

    def run(self, tensors: list[torch.Tensor]) -> Fingerprints:
        hashes: dict[int, int] = {}
        for base, typestr, where, count, slices in self.spans:
            span = np.asarray(_Span(base, count, typestr))
            sampled = span[where].tobytes()
            for (i, at), (_, end) in itertools.pairwise(slices):
                hashes[i] = zlib.crc32(sampled[at:end])
        for device, members in self.gathered.items():
            picked = []
            with torch.no_grad():
                for i, dtype in members:
                    t = tensors[i]
                    index = torch.from_numpy(_positions(t.numel())).to(device)
                    picked.append(t.detach().reshape(-1)[index].to(dtype))
            for (i, _), sample in zip(members, _to_cpu(picked), strict=True):
                raw = sample.view(_BITS[sample.element_size()]).numpy().tobytes()
                hashes[i] = zlib.crc32(raw)
        return {
            n: (*m, hashes[i]) for i, (n, m) in enumerate(zip(self.names, self.meta, strict=True))
        }


def _to_cpu(picked: list[torch.Tensor]) -> list[torch.Tensor]:
    """`picked` on the host: one transfer, split again (one per tensor would wait on each)."""
    if not picked or picked[0].is_cpu:
        return picked
    by_size: dict[int, list[int]] = defaultdict(list)  # cat needs one dtype: view as bits
    for i, t in enumerate(picked):
        by_size[t.element_size()].append(i)
    out: list[torch.Tensor] = [picked[0]] * len(picked)
    for size, members in by_size.items():
        bits = [picked[i].view(_BITS[size]) for i in members]
        whole = torch.cat(bits).cpu().split([b.numel() for b in bits])
        for i, part in zip(members, whole, strict=True):
            out[i] = part.view(picked[i].dtype)
    return out


class _Layout:
    """A model's parameters by name, and the plan to fingerprint them: the walk over its modules
    and the plan are kept while every module and parameter is the same object, at the same
    address with the same shape and dtype; a sync checked at every version would otherwise redo
    the walk each time."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.edges = [  # (a module, a child's name there, the child)
            (parent, key, child)
            for _, parent in model.named_modules(remove_duplicate=False)
            for key, child in parent._modules.items()
        ]
        self.slots = []  # (the module holding a parameter, its key there, its name)
        for name, _ in model.named_parameters():
            owner, _, key = name.rpartition(".")
            self.slots.append((model.get_submodule(owner), key, name))
        self.key: tuple = ()
        self.plan: _Plan | None = None

    def tensors(self) -> list[torch.Tensor] | None:
        """The parameters now, in order; None if a module or a parameter was replaced or removed
        (walk again)."""
        if any(parent._modules.get(key) is not child for parent, key, child in self.edges):
            return None
        out = [m._parameters.get(key) for m, key, _ in self.slots]
        return None if any(t is None for t in out) else out

    def fingerprints(self, tensors: list[torch.Tensor]) -> Fingerprints:
        key = tuple((t.data_ptr(), t.shape, t.dtype) for t in tensors)
        if self.plan is None or key != self.key:
            named = zip((name for _, _, name in self.slots), tensors, strict=True)
            self.key, self.plan = key, _Plan([(name, t, t.dtype) for name, t in named])
        return self.plan.run(tensors)


_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _layout(model: torch.nn.Module) -> tuple[_Layout, list[torch.Tensor]]:
    """`model`'s kept layout (walked again if it changed), and its parameters now."""
    layout = _LAYOUTS.get(model)
    tensors = layout.tensors() if layout is not None else None
    if layout is None or tensors is None:
        layout = _LAYOUTS[model] = _Layout(model)
        tensors = layout.tensors()
        assert tensors is not None
    return layout, tensors


def fingerprint(tensors: Named | torch.nn.Module) -> Fingerprints:
    """Every tensor's fingerprint, by name: what a learner published. A model's parameters are
    fingerprinted as `named_parameters` names them, their layout kept between calls."""
    own = getattr(tensors, "weight_fingerprints", None)
    if own is not None:  # a view whose tensors are computed (a LoRA policy's merged weights)
        return own()
    if isinstance(tensors, torch.nn.Module):
        if type(tensors).named_parameters is not torch.nn.Module.named_parameters:
            return fingerprint(tensors.named_parameters())
        layout, now = _layout(tensors)
        return layout.fingerprints(now)
    items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
    return _Plan([(name, t, t.dtype) for name, t in items]).run([t for _, t in items])


def published(model: torch.nn.Module, publish: Callable[[], object]) -> Fingerprints:
    """`publish()` (a transport writing `model` out), and the fingerprints of what it wrote:
    computed beside the copy, in a thread, where the model's tensors are its own (both only read
    them, and the copy leaves the interpreter free), or after it where they are computed as the
    transport reads them (a LoRA policy's merged weights record them then)."""
    if getattr(model, "weight_fingerprints", None) is not None:
        publish()
        return fingerprint(model)
    expected = _beside().submit(fingerprint, model)
    publish()
    return expected.result()


_BESIDE: tuple[int, ThreadPoolExecutor] | None = None


def _beside() -> ThreadPoolExecutor:
    """This process's thread for fingerprints beside a copy (one made before a fork is not the
    child's: its thread did not come along)."""
    global _BESIDE
    if _BESIDE is None or _BESIDE[0] != os.getpid():
        _BESIDE = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="fingerprint"))
    return _BESIDE[1]


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def held(tensors: Named | torch.nn.Module, expected: Fingerprints) -> Fingerprints:
    """The fingerprints of the tensors an engine holds that `expected` names with their shape,
    each cast to the expected dtype: what is compared with what the learner published."""
    if isinstance(tensors, torch.nn.Module):
        if type(tensors).named_parameters is not torch.nn.Module.named_parameters:
            return held(tensors.named_parameters(), expected)
        layout, now = _layout(tensors)
        own = layout.fingerprints(now)
        if all(own[n][0] == want[0] for n, want in expected.items() if n in own):
            return {n: own[n] for n, want in expected.items() if n in own and own[n][1] == want[1]}
        tensors = zip((name for _, _, name in layout.slots), now, strict=True)
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    chosen = []
    for name, t in items:
        want = expected.get(name)
        if want is not None and tuple(t.shape) == want[1]:
            chosen.append((name, t, DTYPES.get(want[0], t.dtype)))
    return _Plan(chosen).run([t for _, t, _ in chosen])


def differing(expected: Fingerprints, got: Fingerprints) -> tuple[list[str], int]:
    """(the compared tensors whose fingerprints differ, how many were compared): a tensor the
    engine does not hold under the published name and shape is not compared."""
    compared = [name for name in expected if name in got]
    return [name for name in compared if got[name] != expected[name]], len(compared)


def check(expected: Fingerprints, got: Fingerprints, who: str, version: int) -> int:
    """Raise `WeightMismatch` naming `who`, `version` and the tensors that differ (or that no
    published tensor could be compared); the number compared otherwise."""
    bad, compared = differing(expected, got)
    if compared == 0:
        raise WeightMismatch(
            f"{who}: none of the {len(expected)} tensors of version {version} could be compared "
            "with what it holds (no published name and shape among its own)"
        )
    if bad:
        shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise WeightMismatch(
            f"{who} does not hold the weights of version {version}: {len(bad)} of the "
            f"{compared} tensors compared differ from what the learner published ({shown}); "
            "a load that did nothing, an older version or weights lost: nothing is sampled "
            "or trained with them (pipeline.verify_weights)"
        )
    return compared
