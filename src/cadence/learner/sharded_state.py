"""A sharded learner's state on disk, with torch.distributed.checkpoint (DCP).

Read on: docs/ranks.md.
"""

from __future__ import annotations

from pathlib import Path

import torch


def _tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The state to write or read, by name; views of the live tensors (a load fills them).

    Parameters by `named_parameters` (tied weights once: safetensors refuses shared storage);
    the optimizer's by DCP's state-dict API, which keys them by parameter name and gives an
    optimizer that has not stepped yet its (zero) state to load into."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    out = {f"model.{name}": p for name, p in model.named_parameters()}
    optim = get_optimizer_state_dict(model, optimizer)
    for name, state in optim["state"].items():
        for key, value in state.items():
            out[f"optim.{name}.{key}"] = value
    return out


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Write this rank's shards under `path` (every rank calls it, with the same path)."""
    import torch.distributed.checkpoint as dcp

    writer = dcp.HuggingFaceStorageWriter(str(path), save_distributed=True)
    dcp.save(_tensors(model, optimizer), storage_writer=writer)


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Fill the policy's parameters and the optimizer's state from `path`, whatever the number
    of ranks that wrote it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    if not path.is_dir() or not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{path}: no sharded learner state (safetensors files) in it")
    tensors = _tensors(model, optimizer)
    with torch.no_grad():
        dcp.load(tensors, storage_reader=dcp.HuggingFaceStorageReader(str(path)))
    optim = get_optimizer_state_dict(model, optimizer)
    for name, state in optim["state"].items():
        for key in state:
            state[key] = tensors[f"optim.{name}.{key}"]
    set_optimizer_state_dict(model, optimizer, optim)
