"""Checkpoints: everything a run needs to continue exactly where it stopped.

A checkpoint is taken between iterations, after iteration k - 1 is trained and its metrics line
written, and is named after k, the next iteration to run (`checkpoints/iter-00000k/`):

    policy/       the policy in the Hugging Face layout (loadable by `cadence eval` as it is)
    state.pt      optimizer and learning-rate schedule, policy version, advantage baseline,
                  bad-step count, RNG states (torch, random, numpy), data cursor, the metrics
                  file's length, the records so far, held-out accuracy before RL, and the
                  reference model's identity (its path and a digest of its weights)

It is written to a temporary directory that is renamed into place only when complete, so a crash
while saving leaves the previous checkpoint intact and no half-written one that looks whole; the
last `keep` are kept. Resuming reads the newest, truncates `metrics.jsonl` to the length it
records (lines of the interrupted iteration go) and rebuilds the run from it.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cadence.models import load_model, save_pretrained

CHECKPOINTS = "checkpoints"
_PREFIX = "iter-"


class CheckpointError(ValueError):
    """No usable checkpoint where one was asked for, or one that does not fit the run."""


@dataclass
class Checkpoint:
    path: Path
    state: dict[str, Any]

    @property
    def iteration(self) -> int:
        """The next iteration to run (iterations completed)."""
        return int(self.state["iteration"])


def weights_digest(model: torch.nn.Module | None) -> str | None:
    """sha256 over parameter names, shapes, dtypes and bytes: the identity of a frozen model."""
    if model is None:
        return None
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        t = p.detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "random": random.getstate(),
        "numpy": np.random.get_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])


def save_checkpoint(
    out: Path,
    iteration: int,
    learner,
    tokenizer,
    extra: dict[str, Any],
    keep: int,
    shards: Callable[[Path], dict[str, Any]] | None = None,
) -> Path:
    """Write `out/checkpoints/iter-<iteration>` atomically; keep the newest `keep`. `shards`: a
    sharded learner's (pipeline/ranks.py), which writes its optimizer state into the directory
    itself and returns what the state records instead of `optimizer` and `scheduler`."""
    root = out / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{iteration:06d}"
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_pretrained(learner.model, tokenizer, tmp / "policy")
    if shards is None:
        trainer = {
            "optimizer": learner.optimizer.state_dict(),
            "scheduler": learner.scheduler.state_dict(),
        }
    else:
        trainer = shards(tmp)
    state = {
        "iteration": iteration,
        **trainer,
        "version": learner.version,
        "baseline": learner.baseline,
        "bad_steps_in_a_row": learner.bad_steps_in_a_row,
        "rng": rng_state(),
        **extra,
    }
    torch.save(state, tmp / "state.pt")
    _fsync_tree(tmp)
    if final.exists():  # the same iteration saved by an earlier attempt of this run
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync_dir(root)
    for old in list_checkpoints(out)[:-keep]:
        shutil.rmtree(old)
    return final


def list_checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints under `out`, oldest first (temporary directories are not listed)."""
    root = out / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(_PREFIX) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


def find_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint at `path`, or the newest under `path/checkpoints` (a run directory)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"--resume {p}: no such directory")
    if not (p / "state.pt").is_file():
        found = list_checkpoints(p)
        if not found:
            raise CheckpointError(
                f"--resume {p}: no checkpoint in it (is train.checkpoint_every > 0 for that run, "
                "and did it reach its first checkpoint?)"
            )
        p = found[-1]
    try:
        state = torch.load(p / "state.pt", weights_only=False)
    except (OSError, RuntimeError, EOFError) as e:
        raise CheckpointError(f"checkpoint {p} is unreadable: {e}") from e
    return Checkpoint(p, state)


@torch.no_grad()
def restore_learner(learner, ckpt: Checkpoint, reference_digest: str | None) -> None:
    """Load the checkpoint's policy and trainer state into a freshly built learner."""
    expected = ckpt.state.get("reference_digest")
    if expected != reference_digest:
        raise CheckpointError(
            f"checkpoint {ckpt.path} was taken with another reference model "
            f"({ckpt.state.get('reference_path')}): the digest of the reference weights differs"
        )
    saved = load_model(ckpt.path / "policy", dtype=next(learner.model.parameters()).dtype)
    learner.model.load_state_dict(saved.state_dict())
    learner.optimizer.load_state_dict(ckpt.state["optimizer"])
    learner.scheduler.load_state_dict(ckpt.state["scheduler"])
    learner.version = ckpt.state["version"]
    learner.baseline = ckpt.state["baseline"]
    learner.bad_steps_in_a_row = ckpt.state["bad_steps_in_a_row"]


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())
        else:
            _fsync_dir(p)
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
