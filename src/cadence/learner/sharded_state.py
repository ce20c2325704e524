"""A sharded learner's state on disk, with torch.distributed.checkpoint (DCP).

Every rank writes its own shards of the policy's parameters and of AdamW's state (`exp_avg`,
`exp_avg_sq`, `step`) through DCP's Hugging Face storage: safetensors files whose headers say
where each shard sits in the full tensor (JSON; nothing is pickled, unlike DCP's default
`.metadata` file). Tensors replicated on every rank (DDP, Adam's `step`) are written once.

Loading asks each rank's tensors for the rows that rank now holds, and DCP reads them from
whichever files have them: a checkpoint written by N ranks loads into M ranks, FSDP or DDP alike
(the keys are the model's own parameter names). What is not a tensor (the learning-rate schedule,
the bad-step count, the version) travels in the driver's state instead.

All ranks call `save_sharded` / `load_sharded` together: they are collectives.
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
