"""Checkpoints: everything a run needs to continue exactly where it stopped.

A checkpoint is taken between iterations and named after the next iteration to run: `policy/`
(the policy in the Hugging Face layout), a sharded trainer's own files, and its state: the
trainer's and the scorer's, and the `RunState` (data cursor, records, RNG states, the reference's
identity). It goes through the Trainer seam and the Scorer, never knowing which trainer. The
files, their manifest and their integrity are pipeline/checkpoint_files.py's; here is what a run
saves and how it continues: the newest intact checkpoint is found, the trainer, the scorer and
the run restored. docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import logging
import random
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from cadence.learner import TRAINER_KEYS, Scorer, Trainer
from cadence.models import ModelLoadError, load_model, save_pretrained
from cadence.models.lora import is_lora, load_adapter_into
from cadence.pipeline.checkpoint_files import (
    CheckpointError,
    UnsafeCheckpointError,
    is_checkpoint_dir,
    list_checkpoints,
    read_state,
    write_checkpoint,
)

log = logging.getLogger(__name__)

STATE_KEYS = (  # what restoring needs of state.pt: by save_checkpoint, and the RunState
    *("format", "iteration", "trainer", "scorer", "rng"),
    *("cursor", "metrics_bytes", "records", "accuracy_before", "reference_path"),
    "reference_digest",
)


@dataclass
class RunState:
    """What a run resumed from a checkpoint continues with, besides the trainer's and the
    scorer's state: where the data stream is (the next example, and the starts of batches drawn
    but not yet trained), the behaviour policies of the versions in flight (off-policy), where
    metrics.jsonl ends, the records so far, held-out accuracy before RL (overall and per task),
    the RNG states, and the reference model's identity."""

    cursor: int
    metrics_bytes: int
    records: list[dict[str, Any]]
    accuracy_before: float
    rng: dict[str, Any]
    reference_path: str = ""
    reference_digest: str | None = None
    pending_batches: list[int] = field(default_factory=list)
    behaviour_policies: list[dict[str, Any]] = field(default_factory=list)
    tasks_before: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, state: dict[str, Any]) -> RunState:
        """The record as a checkpoint's state holds it (fields it lacks: their defaults)."""
        return cls(**{f.name: state[f.name] for f in fields(cls) if f.name in state})


@dataclass
class Checkpoint:
    path: Path
    state: dict[str, Any]

    @property
    def run(self) -> RunState:
        """What the run continues with (see `RunState`)."""
        return RunState.of(self.state)

    @property
    def iteration(self) -> int:
        """The next iteration to run (iterations completed)."""
        return int(self.state["iteration"])

    @property
    def trainer(self) -> dict[str, Any]:
        """What `Trainer.state` returned when this was written."""
        return self.state["trainer"]

    @property
    def scorer(self) -> dict[str, Any]:
        """What `Scorer.state` returned when this was written."""
        return self.state["scorer"]


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
    """The RNG states as tensors and plain values (numpy's key array becomes an int64 tensor)."""
    name, keys, pos, has_gauss, cached = cast(tuple, np.random.get_state(legacy=True))
    return {
        "torch": torch.get_rng_state(),
        "random": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["random"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def save_checkpoint(
    out: Path,
    iteration: int,
    trainer: Trainer,
    scorer: Scorer,
    tokenizer,
    run: RunState,
    keep: int,
) -> Path:
    """Write `out/checkpoints/iter-<iteration>` (pipeline/checkpoint_files.py); keep the newest
    `keep`. The trainer may write files of its own into the directory (a sharded one's shards).
    A full disk raises `OSError(ENOSPC, ..., checkpoint path)` and leaves no temporary behind."""

    def write_files(tmp: Path) -> dict[str, Any]:
        save_pretrained(trainer.model, tokenizer, tmp / "policy")
        return {"trainer": trainer.state(tmp), "scorer": scorer.state(), **asdict(run)}

    return write_checkpoint(out, iteration, write_files, keep)


def find_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint at `path`, or the newest intact one under `path/checkpoints` (a run
    directory), each checked in full first (see the module docstring). A damaged checkpoint is
    passed over for the next newest; an unsafe one stops the search (`UnsafeCheckpointError`)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"--resume {p}: no such directory")
    if is_checkpoint_dir(p):
        return load_checkpoint(p)
    found = list_checkpoints(p)
    if not found:
        raise CheckpointError(
            f"--resume {p}: no checkpoint in it (is train.checkpoint_every > 0 for that run, "
            "and did it reach its first checkpoint?)"
        )
    damaged: list[str] = []
    for candidate in reversed(found):
        try:
            ckpt = load_checkpoint(candidate)
        except UnsafeCheckpointError:
            raise
        except CheckpointError as e:
            damaged.append(f"  {e}")
            continue
        if damaged:
            log.warning(
                "cadence: the newest checkpoint(s) cannot be used:\n%s\nresuming from the newest "
                "intact one, %s (iteration %d)",
                "\n".join(damaged),
                candidate,
                ckpt.iteration,
            )
        return ckpt
    raise CheckpointError(
        f"--resume {p}: none of its {len(found)} checkpoint(s) is intact:\n" + "\n".join(damaged)
    )


def load_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint at `path`, its files checked (`read_state`) and its state holding what a
    run restores; `CheckpointError` says what is wrong."""
    state = read_state(path)
    missing = [k for k in STATE_KEYS if k not in state]
    if not missing:
        trainer = state["trainer"]
        keys = [k for k in TRAINER_KEYS if not isinstance(trainer, dict) or k not in trainer]
        missing = [f"trainer.{k}" for k in keys]
    if missing:
        raise CheckpointError(f"{path}: state.pt lacks {', '.join(missing)}")
    return Checkpoint(path, state)


def check_reference(ckpt: Checkpoint, reference_digest: str | None) -> None:
    """Refuse a checkpoint taken with other reference weights than the run's."""
    if ckpt.state.get("reference_digest") != reference_digest:
        raise CheckpointError(
            f"checkpoint {ckpt.path} was taken with another reference model "
            f"({ckpt.state.get('reference_path')}): the digest of the reference weights differs"
        )


def restore_trainer(trainer: Trainer, ckpt: Checkpoint, reference_digest: str | None) -> None:
    """Continue a freshly built trainer from `ckpt`: its policy into `trainer.model`, then the
    trainer's own state (and files) through `load_state`."""
    check_reference(ckpt, reference_digest)
    load_policy(trainer.model, ckpt)
    trainer.load_state(ckpt.path, ckpt.trainer)
    if trainer.version != ckpt.iteration:  # versions count the iterations trained
        raise CheckpointError(
            f"{ckpt.path}: the trainer's state is at policy version {trainer.version}, the "
            f"checkpoint after iteration {ckpt.iteration}: a version counter that went back "
            "would let stale groups through the staleness rule; the checkpoint is refused"
        )


@torch.no_grad()
def load_policy(model: torch.nn.Module, ckpt: Checkpoint) -> None:
    """The checkpoint's `policy/` into `model`: a LoRA policy's adapter, or every weight."""
    if is_lora(model):  # the policy was saved as its adapter
        load_adapter_into(model, ckpt.path / "policy")
        return
    try:
        saved = load_model(ckpt.path / "policy", dtype=next(model.parameters()).dtype)
    except ModelLoadError as e:
        raise CheckpointError(f"{ckpt.path}: its policy cannot be loaded: {e}") from e
    model.load_state_dict(saved.state_dict())


def restore_scorer(scorer: Scorer, ckpt: Checkpoint) -> None:
    """The scorer's state (the advantage baseline) as `ckpt` recorded it."""
    scorer.load_state(ckpt.scorer)
