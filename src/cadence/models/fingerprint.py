"""Fingerprints of weights: what proves that an engine holds the version it is labelled with.

A tensor's fingerprint is a hash of its dtype, its shape and the bytes of a fixed sample of its
elements (`SAMPLE` positions spread evenly over it, the first and the last among them), so it
costs a gather of a few elements per tensor, on whatever device the tensor lives, not a pass over
the weights. The learner fingerprints what it publishes; an engine with its own copy fingerprints
what it holds after a load, each element first cast to the dtype the learner published (an
engine may keep another dtype), and only the tensors it holds under the published name and
shape (vLLM fuses q, k and v, and gate and up: those are not compared). A difference is a load
that did nothing, the wrong version, or lost weights: `WeightMismatch`, never a warning.
docs/reliability.md#weights-you-can-prove.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch

SAMPLE = 64  # elements per tensor
Fingerprint = tuple[str, tuple[int, ...], int]  # dtype, shape, hash of the sampled elements
Fingerprints = dict[str, Fingerprint]


class WeightMismatch(RuntimeError):
    """An engine holds other weights than the version it was told it has."""


def positions(numel: int, device: torch.device) -> torch.Tensor:
    """The sampled positions of a tensor of `numel` elements: evenly spread, ends included."""
    count = min(numel, SAMPLE)
    return torch.linspace(0, numel - 1, count, device=device).round().long()


@torch.no_grad()
def tensor_fingerprint(t: torch.Tensor, dtype: torch.dtype | None = None) -> Fingerprint:
    """(dtype, shape, hash) of `t`, its sampled elements cast to `dtype` first (default its own)."""
    dtype = dtype or t.dtype
    flat = t.detach().reshape(-1)
    picked = flat.index_select(0, positions(flat.numel(), flat.device)) if flat.numel() else flat
    data = picked.to(dtype).cpu().contiguous().view(torch.uint8).numpy().tobytes()
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return str(dtype).removeprefix("torch."), tuple(t.shape), int.from_bytes(digest, "little")


def fingerprint(
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> Fingerprints:
    """Every tensor's fingerprint, by name: what a learner published."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    return {name: tensor_fingerprint(t) for name, t in items}


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def held(
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    expected: Fingerprints,
) -> Fingerprints:
    """The fingerprints of the tensors an engine holds that `expected` names with their shape,
    each cast to the expected dtype: what is compared with what the learner published."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    out: Fingerprints = {}
    for name, t in items:
        want = expected.get(name)
        if want is not None and tuple(t.shape) == want[1]:
            out[name] = tensor_fingerprint(t, DTYPES.get(want[0]))
    return out


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
