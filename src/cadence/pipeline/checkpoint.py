"""Checkpoints: everything a run needs to continue exactly where it stopped.

A checkpoint is taken between iterations and named after the next iteration to run
(`checkpoints/iter-00000k/`): `policy/` (the policy in the Hugging Face layout), a sharded
trainer's own files, `state.pt` (the trainer's and scorer's state, and the `RunState`) and
`manifest.json` (the size and sha256 of every file). It goes through the Trainer seam and the
Scorer, never knowing which trainer; it is written to a temporary directory renamed into place
when complete, and loading it never unpickles an object (`torch.load(weights_only=True)`): a
damaged checkpoint is skipped for the newest intact one, an unsafe one refused. The layout, the
checks and what resume does: docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from cadence.learner import TRAINER_KEYS, Scorer, Trainer
from cadence.metrics.files import is_stale_temporary, write_all, writing
from cadence.models import ModelLoadError, load_model, save_pretrained
from cadence.models.lora import is_lora, load_adapter_into

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
# 2: state.pt of plain tensors and containers, and manifest.json; 3: the trainer's and the
# scorer's state each under a key of its own
FORMAT = 3
_PREFIX = "iter-"
_NAME = re.compile(r"iter-(\d+)")
STATE_KEYS = (  # what restoring needs of state.pt: by save_checkpoint, and the RunState
    *("format", "iteration", "trainer", "scorer", "rng"),
    *("cursor", "metrics_bytes", "records", "accuracy_before", "reference_path"),
    "reference_digest",
)


class CheckpointError(ValueError):
    """No usable checkpoint where one was asked for, or one that does not fit the run."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint whose files are as written but hold objects that loading could run: the
    directory is not to be trusted, so no other checkpoint of it is tried either."""


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
    """Write `out/checkpoints/iter-<iteration>` atomically; keep the newest `keep`. The trainer
    may write files of its own into the directory (a sharded one's shards).

    A full disk raises `OSError(ENOSPC, ..., checkpoint path)` and leaves no temporary behind."""
    root = out / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{iteration:06d}"
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    try:
        with writing(final):
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            save_pretrained(trainer.model, tokenizer, tmp / "policy")
            state = {
                "format": FORMAT,
                "iteration": iteration,
                "trainer": trainer.state(tmp),
                "scorer": scorer.state(),
                **asdict(run),
            }
            _write_state(tmp, _plain(state))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():  # the same iteration saved by an earlier attempt of this run
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync_dir(root)
    _prune(out, iteration, keep)
    return final


def _write_state(tmp: Path, state: dict[str, Any]) -> None:
    """`state.pt` and the manifest of every file under `tmp` (the policy, a trainer's own files
    if any, and the state), then everything synced."""
    files = {
        p.relative_to(tmp).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(tmp.rglob("*"))
        if p.is_file()
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)  # in memory: a full disk then fails in our write, with its errno
    data = buffer.getvalue()
    _write_file(tmp / "state.pt", data)
    files["state.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest = {"format": FORMAT, "iteration": state["iteration"], "files": files}
    _write_file(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
    _fsync_tree(tmp)


def _plain(obj: Any) -> Any:
    """`obj` as tensors, str, int, float, bool, None, and dicts, lists and tuples of them (numpy
    scalars become Python numbers): what `torch.load(weights_only=True)` reads back. Anything
    else is a bug, caught here when saving rather than when resuming."""
    if obj is None or isinstance(obj, str | bool | torch.Tensor):
        return obj
    if isinstance(obj, int | np.integer):
        return int(obj)
    if isinstance(obj, float | np.floating):
        return float(obj)
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_plain(v) for v in obj)
    raise TypeError(f"checkpoint state holds a {type(obj).__name__}: not a plain value")


def _prune(out: Path, iteration: int, keep: int) -> None:
    """Keep the newest `keep` checkpoints up to `iteration`; any later one is of the run's
    continuation before it was resumed from an earlier checkpoint (damaged, or abandoned)."""
    found = list_checkpoints(out)
    later = [p for p in found if _iteration(p) > iteration]
    for old in later + [p for p in found if p not in later][:-keep]:
        shutil.rmtree(old)


def list_checkpoints(out: Path) -> list[Path]:
    """Checkpoints under `out`, oldest first (temporary directories are not listed); whether
    each is intact is for `find_checkpoint` to tell."""
    root = out / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=_iteration)


def _iteration(path: Path) -> int:
    return int(path.name[len(_PREFIX) :])


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Remove what a process that died while writing left in `out` (a checkpoint being saved,
    `final.tmp`, an output file being replaced); returns what went."""
    stale = [p for d in (out, out / CHECKPOINTS) if d.is_dir() for p in d.iterdir()]
    gone = [p for p in stale if is_stale_temporary(p) or p.name == "final.tmp"]
    for p in gone:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return gone


def find_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint at `path`, or the newest intact one under `path/checkpoints` (a run
    directory), each checked in full first (see the module docstring). A damaged checkpoint is
    passed over for the next newest; an unsafe one stops the search (`UnsafeCheckpointError`)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"--resume {p}: no such directory")
    if _NAME.fullmatch(p.name) or (p / "state.pt").exists() or (p / MANIFEST).exists():
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
    """The checkpoint at `path`, every file checked against its manifest and the state loaded
    without unpickling any object; `CheckpointError` says what is wrong."""
    manifest = _read_manifest(path)
    try:
        data = (path / "state.pt").read_bytes()  # read once: checked, then loaded
    except FileNotFoundError:
        raise CheckpointError(f"{path}: state.pt is missing") from None
    for name, want in manifest["files"].items():
        _check_file(path, name, want, data if name == "state.pt" else None)
    try:
        state = torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        what = next((x for x in lines if "GLOBAL" in x), lines[-1] if lines else "")
        raise UnsafeCheckpointError(
            f"{path}: state.pt holds objects other than tensors and plain containers; it is "
            f"refused, since loading it could run code ({what})"
        ) from None
    except (RuntimeError, EOFError, ValueError) as e:
        raise CheckpointError(f"{path}: state.pt is unreadable: {e}") from None
    missing = [k for k in STATE_KEYS if not isinstance(state, dict) or k not in state]
    if not missing:
        trainer = state["trainer"]
        keys = [k for k in TRAINER_KEYS if not isinstance(trainer, dict) or k not in trainer]
        missing = [f"trainer.{k}" for k in keys]
    if missing or state["format"] != FORMAT:
        raise CheckpointError(f"{path}: state.pt lacks {', '.join(missing) or 'its format'}")
    return Checkpoint(path, state)


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: no {MANIFEST}: not a checkpoint, or one written before checkpoint format "
            "2 (whose state loads without unpickling objects), which cannot be resumed safely: "
            "start the run again"
        ) from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: {MANIFEST} is unreadable: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise CheckpointError(
            f"{path}: checkpoint format {found}, not {FORMAT}: written by another version of "
            "cadence, whose state this one does not read; resume it with that version, or "
            "start the run again"
        )
    if "state.pt" not in manifest.get("files", {}):
        raise CheckpointError(f"{path}: {MANIFEST} lists no state.pt")
    return manifest


def _check_file(root: Path, name: str, want: dict[str, Any], data: bytes | None = None) -> None:
    """Raise unless file `name` (whose bytes are `data`, if read already) has the size and
    sha256 the manifest recorded."""
    p = root / name
    if data is None and not p.is_file():
        raise CheckpointError(f"{root}: {name} is missing")
    size = p.stat().st_size if data is None else len(data)
    if size != want["bytes"]:
        raise CheckpointError(
            f"{root}: {name} is {size} bytes, {want['bytes']} when written (truncated?)"
        )
    digest = _sha256(p) if data is None else hashlib.sha256(data).hexdigest()
    if digest != want["sha256"]:
        raise CheckpointError(f"{root}: {name} differs from what was written (sha256)")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _write_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, data)
    finally:
        os.close(fd)


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
