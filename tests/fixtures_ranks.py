"""Rank objects for the rank-process tests: spawned processes import them from here."""

from __future__ import annotations

import os


class EchoRank:
    """Answers `echo` with (rank, value, pid); `fail` raises; `sleep` blocks."""

    def __init__(self, rank: int, greeting: str) -> None:
        self.rank, self.greeting = rank, greeting
        self.closed = False

    def echo(self, value):
        return self.rank, value, self.greeting, os.getpid()

    def environ(self, key: str) -> str | None:
        return os.environ.get(key)

    def fail(self, message: str):
        raise ValueError(f"rank {self.rank} refuses: {message}")

    def sleep(self, seconds: float):
        import time

        time.sleep(seconds)

    def close(self) -> None:
        self.closed = True


def sharded_state_rank(rank: int, world: int, mode: str, store: str, model_dir, ckpt, out):
    """One rank of a sharded-state round trip: `save` takes one AdamW step on an FSDP2-sharded
    model and writes the shards; `load` reads them into a fresh sharded model and optimizer.
    Rank 0 saves the full tensors it then holds (model and optimizer state) to `out`."""
    import torch
    import torch.distributed as dist

    from cadence.learner.sharded_state import _tensors, load_sharded, save_sharded
    from cadence.models import load_model

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    try:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        model = load_model(model_dir)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if mode == "save":
            model(input_ids=torch.tensor([[1, 2, 3, 4, 5]])).logits.square().mean().backward()
            optimizer.step()
            save_sharded(model, optimizer, ckpt)
        else:
            load_sharded(model, optimizer, ckpt)
        full = {
            k: v.full_tensor() if isinstance(v, DTensor) else v.clone()
            for k, v in _tensors(model, optimizer).items()
        }
        if rank == 0:
            torch.save(full, out)
    finally:
        dist.destroy_process_group()
