"""A version of weights as files that every tensor-parallel worker of one vLLM engine reads.

With `tensor_parallel_size` > 1 vLLM's workers are processes of their own: tensors handed to
`collective_rpc` are pickled and each worker unpickles a whole copy of the model (on a GPU, every
CUDA tensor through host memory, once per worker). Written once as safetensors shards into a
directory (host memory, /dev/shm, where it has room), the version is one copy: each worker maps
the files and reads only its own shard of each tensor (vLLM's `reload_weights(weights_path=)`).
It must not hold more than one shard of CPU copies at a time, nor leave the directory behind.

Read on: docs/engines.md.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch

SHARD_BYTES = 1 << 30  # CPU copies held at once while a version is written
SHM = Path("/dev/shm")


def version_dir(num_bytes: int) -> Path:
    """A fresh directory for a version of `num_bytes`: in /dev/shm (memory) if it has room,
    else in the system's temporary directory."""
    where = None
    if SHM.is_dir() and shutil.disk_usage(SHM).free > num_bytes + SHARD_BYTES:
        where = SHM
    return Path(tempfile.mkdtemp(prefix="cadence-weights-", dir=where))


def write_shards(
    tensors: Iterable[tuple[str, torch.Tensor]], directory: Path, shard_bytes: int = SHARD_BYTES
) -> int:
    """`tensors` as safetensors files in `directory`, a shard of at most `shard_bytes` (or one
    tensor) at a time; the bytes written."""
    from safetensors.torch import save_file

    shard: dict[str, torch.Tensor] = {}
    held = total = files = 0
    for name, t in tensors:
        shard[name] = t.detach().to("cpu", copy=True).contiguous()
        held += t.numel() * t.element_size()
        if held >= shard_bytes:
            save_file(shard, str(directory / f"weights-{files:05d}.safetensors"))
            files, total, held, shard = files + 1, total + held, 0, {}
    if shard or not files:
        save_file(shard, str(directory / f"weights-{files:05d}.safetensors"))
        total += held
    return total


def reload_from_files(llm, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Load `tensors` into the running `vllm.LLM` through files written once (each worker maps
    them and reads its own shard of each tensor); the files go after. The bytes written."""
    held = sum(llm.apply_model(_parameter_bytes))  # an upper bound: some are replicated
    directory = version_dir(held)
    try:
        written = write_shards(tensors, directory)
        llm.collective_rpc(
            "reload_weights", kwargs={"weights_path": str(directory), "is_checkpoint_format": True}
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return written


def _parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
