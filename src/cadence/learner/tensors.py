"""Tensors as the learner holds them, sharded or not: a DTensor's local shard, the bytes a model
takes in this process, a frozen copy for passes without gradients."""

from __future__ import annotations

import copy
import sys

import torch


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether `t` is a sharded DTensor. (torch.distributed.tensor is looked up, not imported: it
    costs a second to import, and a DTensor cannot exist before something else imported it.)"""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this process holds: a DTensor's local shard, else `t` itself."""
    return t.to_local() if is_dtensor(t) else t


def scalar(t: torch.Tensor) -> float:
    """A scalar tensor as a float; a sharded model's is a DTensor, replicated on every rank."""
    return float(t.full_tensor() if is_dtensor(t) else t)


def model_bytes(model: torch.nn.Module | None) -> int:
    """Bytes of `model`'s parameters and buffers this process holds (a sharded tensor: its
    local shard)."""
    if model is None:
        return 0
    tensors = [local_tensor(t) for t in (*model.parameters(), *model.buffers())]
    return sum(t.numel() * t.element_size() for t in tensors)


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy for no_grad passes: no gradient buffers, never in an optimizer, in eval mode."""
    return copy.deepcopy(model).requires_grad_(False).eval()


def synchronize(device: torch.device) -> None:
    """Wait until every copy queued on `device` has landed (a GPU's queued kernels and copies
    run after the call that queued them returns); nothing to wait for on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
