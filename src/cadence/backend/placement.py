"""Which GPUs each local process sees: learner ranks take the first, rollout workers the next.

On the local backend `learner.num_gpus_per_rank` and `pipeline.num_gpus_per_worker` mean what
they mean on Ray: a share of 1 or more is that many whole GPUs of the process's own, a fraction
is part of one GPU shared with the next fractions until they add up past 1 (as Ray packs
fractional GPUs), 0 is none. Each process is started with its own `CUDA_VISIBLE_DEVICES` (entries
of the parent's, when it has one), so its first GPU is its `cuda`. Asking for more GPUs than are
visible raises `PlacementError` naming the keys. Plain values only: nothing here touches CUDA
beyond counting devices.

The design in full: docs/scaling.md, `cadence/backend/placement.py`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

GPUs = tuple[str, ...]  # CUDA_VISIBLE_DEVICES entries


class PlacementError(ValueError):
    """The processes ask for more GPUs than this machine shows (the message names the keys)."""


@dataclass(frozen=True)
class Placement:
    ranks: tuple[GPUs, ...]  # per learner rank (rank 0: the driver when it trains alone)
    workers: tuple[GPUs, ...]  # per rollout worker

    def rank_env(self, rank: int) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.ranks[rank])}

    def worker_env(self, wid: int) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.workers[wid])}


def visible_gpus(environ: Mapping[str, str] = os.environ, count: int | None = None) -> list[str]:
    """This process's GPUs as `CUDA_VISIBLE_DEVICES` entries: its own list when set, else
    0..count-1 (`count`: torch's device count when not given)."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    if count is None:
        import torch

        count = torch.cuda.device_count()
    return [str(i) for i in range(count)]


def gpus_needed(shares: list[float]) -> int:
    """How many GPUs `shares` take, packed in order (see the module docstring)."""
    return _pack(shares, None)[1]


def place(
    num_ranks: int, rank_share: float, num_workers: int, worker_share: float, visible: list[str]
) -> Placement:
    """Ranks first, then workers, on `visible` (see the module docstring)."""
    shares = [rank_share] * num_ranks + [worker_share] * num_workers
    taken, needed = _pack(shares, visible)
    if needed > len(visible):
        shown = f"CUDA_VISIBLE_DEVICES={','.join(visible)}" if visible else "none"
        raise PlacementError(
            f"learner.ranks = {num_ranks} x learner.num_gpus_per_rank = {rank_share:g} and "
            f"pipeline.num_workers = {num_workers} x pipeline.num_gpus_per_worker = "
            f"{worker_share:g} need {needed} GPU(s); this machine shows {len(visible)} "
            f"({shown}): lower the counts or the shares (fractions share a GPU)"
        )
    return Placement(tuple(taken[:num_ranks]), tuple(taken[num_ranks:]))


def _pack(shares: list[float], visible: list[str] | None) -> tuple[list[GPUs], int]:
    """Each share's GPUs (indices into `visible`, or positions without it) and the count used."""
    out: list[GPUs] = []
    cursor, used = 0, 0.0  # the GPU being filled with fractions, and how much of it is taken
    for share in shares:
        if share <= 0:
            out.append(())
            continue
        if share >= 1:
            cursor += used > 0  # a whole GPU is never one that fractions hold
            whole = math.ceil(share - 1e-9)
            ids = range(cursor, cursor + whole)
            cursor, used = cursor + whole, 0.0
        else:
            if used + share > 1 + 1e-9:
                cursor, used = cursor + 1, 0.0
            ids, used = range(cursor, cursor + 1), used + share
        out.append(tuple(_name(i, visible) for i in ids))
    return out, cursor + (used > 0)


def _name(i: int, visible: list[str] | None) -> str:
    return visible[i] if visible is not None and i < len(visible) else str(i)
