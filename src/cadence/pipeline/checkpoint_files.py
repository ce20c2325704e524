"""Checkpoint files: the on-disk format and its integrity, apart from what a run restores.

A checkpoint directory (`checkpoints/iter-00000k/`) is written whole into a temporary directory
and renamed into place; `manifest.json` records the size and sha256 of every file in it, and
`state.pt` holds tensors and plain containers only, so reading it never unpickles an object
(`torch.load(weights_only=True)`): a file that differs from the manifest is a damaged checkpoint,
a state that holds objects an unsafe one. Everything is fsynced before the rename; older
checkpoints are pruned. What goes into a checkpoint and how a run continues from one:
pipeline/checkpoint.py; the layout and the checks: docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cadence.metrics.files import is_stale_temporary, write_all, writing

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
# 2: state.pt of plain tensors and containers, and manifest.json; 3: the trainer's and the
# scorer's state each under a key of its own
FORMAT = 3
_PREFIX = "iter-"
_NAME = re.compile(r"iter-(\d+)")


class CheckpointError(ValueError):
    """No usable checkpoint where one was asked for, or one that does not fit the run."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint whose files are as written but hold objects that loading could run: the
    directory is not to be trusted, so no other checkpoint of it is tried either."""


def is_checkpoint_dir(path: Path) -> bool:
    """Whether `path` names one checkpoint (rather than a run directory holding several)."""
    return (
        bool(_NAME.fullmatch(path.name))
        or (path / "state.pt").exists()
        or (path / MANIFEST).exists()
    )


def write_checkpoint(
    out: Path,
    iteration: int,
    write_files: Callable[[Path], dict[str, Any]],
    keep: int,
) -> Path:
    """Write `out/checkpoints/iter-<iteration>` atomically and keep the newest `keep`:
    `write_files(tmp)` writes what it will into the temporary directory and returns the state,
    saved as `state.pt` (plain values only) beside a manifest of every file.

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
            state = {"format": FORMAT, "iteration": iteration, **write_files(tmp)}
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


def read_state(path: Path) -> dict[str, Any]:
    """The state of the checkpoint at `path`, every file checked against its manifest and the
    state loaded without unpickling any object; `CheckpointError` says what is wrong
    (`UnsafeCheckpointError` when it holds objects)."""
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
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: state.pt lacks its format")
    return state


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
