"""Checkpoints as untrusted, damaged or half-written input: loading one never runs code, a damaged
one is passed over for the newest intact one, and a full disk leaves every file whole."""

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from cadence.cli import main
from cadence.pipeline.checkpoint_files import MANIFEST, list_checkpoints

pytestmark = pytest.mark.slow


def _sets(model_dir, *extra):
    common = [
        f"model.path='{model_dir}'",
        "train.iterations=3",
        "train.prompts_per_iteration=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=6",
        "data.num_heldout=2",
        "train.checkpoint_every=1",
        "train.keep_checkpoints=2",
        "metrics.progress=false",
        "reward.function='fixtures_rewards:even_length'",
        *extra,
    ]
    return [a for s in common for a in ("--set", s)]


@pytest.fixture(scope="module")
def finished_run(model_dir, tmp_path_factory):
    """A 3-iteration run with checkpoints iter-000002 and iter-000003."""
    out = tmp_path_factory.mktemp("run") / "run"
    assert main(["train", "configs/default.toml", "--out", str(out), *_sets(model_dir)]) == 0
    assert [p.name for p in list_checkpoints(out)] == ["iter-000002", "iter-000003"]
    return out


@pytest.fixture
def run_dir(finished_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    return copy


def _resume(target, *extra):
    return main(["train", "--resume", str(target), "--set", "train.iterations=4", *extra])


def _iterations(run: Path) -> list[int]:
    return [json.loads(x)["iteration"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def _rewrite_manifest(ckpt: Path) -> None:
    """Make the manifest match the files again, as someone crafting a checkpoint would."""
    manifest = json.loads((ckpt / MANIFEST).read_text())
    for name, entry in manifest["files"].items():
        data = (ckpt / name).read_bytes()
        entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


class _RunsACommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("target", ["run", "checkpoint"])
def test_a_crafted_state_that_would_run_a_command_is_refused_with_exit_2(
    run_dir, tmp_path, capsys, target
):
    # Before: torch.load(weights_only=False) ran the command and the resume exited 0.
    marker = tmp_path / "pwned"
    newest = list_checkpoints(run_dir)[-1]
    state = torch.load(newest / "state.pt", weights_only=True)
    torch.save(state | {"baseline": _RunsACommand(marker)}, newest / "state.pt")
    _rewrite_manifest(newest)
    assert _resume(run_dir if target == "run" else newest) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cadence: error: {newest}: state.pt holds objects other than tensors")
    assert "refused, since loading it could run code" in err and "posix.system" in err
    assert not marker.exists()  # the command never ran
    assert _iterations(run_dir) == [0, 1, 2]  # nothing was resumed from the older one either


def test_a_crafted_state_that_does_not_match_its_manifest_is_passed_over(run_dir, tmp_path, caplog):
    marker = tmp_path / "pwned"
    newest = list_checkpoints(run_dir)[-1]
    torch.save({"x": _RunsACommand(marker)}, newest / "state.pt")
    assert _resume(run_dir) == 0  # from iter-000002, saying why iter-000003 is not used
    err = caplog.text  # warnings: on stderr outside the tests
    assert f"{newest}: state.pt is" in err and "when written (truncated?)" in err
    assert "resuming from the newest intact one" in err and "iter-000002 (iteration 2)" in err
    assert not marker.exists()
    assert _iterations(run_dir) == [0, 1, 2, 3]


@pytest.mark.parametrize("damaged", ["state.pt", "policy/model.safetensors"])
def test_a_truncated_newest_checkpoint_falls_back_to_the_newest_intact_one(
    run_dir, caplog, damaged
):
    # Before: a truncated state.pt exited 2 without a hint, a truncated model.safetensors with a
    # traceback and exit 1.
    older, newest = list_checkpoints(run_dir)
    with (newest / damaged).open("r+b") as f:
        f.truncate(100)
    assert _resume(run_dir) == 0
    err = caplog.text
    assert f"{newest}: {damaged} is 100 bytes" in err
    assert f"resuming from the newest intact one, {older} (iteration 2)" in err
    assert _iterations(run_dir) == [0, 1, 2, 3]  # iteration 2 redone, each once
    assert [p.name for p in list_checkpoints(run_dir)] == ["iter-000003", "iter-000004"]


def test_no_intact_checkpoint_exits_2_with_what_is_wrong_with_each(run_dir, capsys):
    older, newest = list_checkpoints(run_dir)
    with (newest / "state.pt").open("r+b") as f:
        f.truncate(10)
    (older / "policy" / "config.json").unlink()
    assert _resume(run_dir) == 2
    err = capsys.readouterr().err
    assert f"cadence: error: --resume {run_dir}: none of its 2 checkpoint(s) is intact" in err
    assert f"{newest}: state.pt is 10 bytes" in err
    assert f"{older}: policy/config.json is missing" in err


def test_a_checkpoint_of_the_older_pickled_format_is_refused_with_exit_2(run_dir, capsys):
    newest = list_checkpoints(run_dir)[-1]
    (newest / MANIFEST).unlink()
    assert _resume(newest) == 2
    err = capsys.readouterr().err
    assert f"{newest}: no manifest.json: not a checkpoint, or one written before" in err


class _FullDisk:
    """`os.write` to files under `root` as on a disk with `free` bytes left: a write that does
    not fit fails with ENOSPC, and so does every later one (other writes, to pipes or the
    terminal, are untouched)."""

    def __init__(self, root: Path, free: int) -> None:
        self.root, self.free, self._write = str(root), free, os.write

    def __call__(self, fd: int, data) -> int:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target.startswith(self.root):
            if len(data) > self.free:
                self.free = 0
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.free -= len(data)
        return self._write(fd, data)


def test_a_full_disk_stops_the_run_in_one_line_and_leaves_every_file_whole(
    run_dir, capsys, caplog, monkeypatch
):
    # Before: a .iter-*.tmp-PID directory stayed for good, trace.json was cut to 0 bytes and the
    # error came as three chained tracebacks.
    trace = (run_dir / "trace.json").read_text()
    monkeypatch.setattr(os, "write", _FullDisk(run_dir, free=20_000))  # a line fits, a state not
    assert _resume(run_dir, "--set", "train.iterations=5") == 1
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith("resuming from")]
    expected = f"while writing {run_dir / 'checkpoints' / 'iter-000004'}"
    assert not caplog.text  # not a warning more
    assert len(lines) == 1 and lines[0].startswith("cadence: run stopped: no space left on ")
    assert lines[0].endswith(expected) and "Traceback" not in err
    assert not [p for p in run_dir.rglob("*") if ".tmp" in p.name]  # no temporary left
    assert _iterations(run_dir) == [0, 1, 2, 3]  # whole lines only
    assert json.loads((run_dir / "trace.json").read_text()) == json.loads(trace)  # kept whole
    assert [p.name for p in list_checkpoints(run_dir)] == ["iter-000002", "iter-000003"]

    monkeypatch.undo()  # space again; a dead process's temporaries go at the next start
    stale = run_dir / "checkpoints" / ".iter-000004.tmp-999999999"
    (stale / "policy").mkdir(parents=True)
    assert _resume(run_dir, "--set", "train.iterations=5") == 0
    assert f"removed {stale}" in caplog.text
    assert not stale.exists() and _iterations(run_dir) == [0, 1, 2, 3, 4]


def test_a_resume_with_another_reference_model_is_refused_with_exit_2(run_dir, tmp_path, capsys):
    from cadence.data import ArithmeticTask
    from cadence.models import init_model

    other = tmp_path / "other-model"  # same shapes and tokenizer, other weights
    init_model("test", other, ArithmeticTask(difficulty=1, seed=0).corpus(2000), seed=1)
    assert _resume(run_dir, "--set", f"model.path='{other}'") == 2
    err = capsys.readouterr().err
    assert "was taken with another reference model" in err and "Traceback" not in err


def test_a_run_out_of_minutes_stops_and_writes_what_its_end_writes(model_dir, tmp_path):
    out = tmp_path / "run"
    sets = _sets(
        model_dir, "train.iterations=50", "train.checkpoint_every=20", "train.max_minutes=1e-6"
    )
    assert main(["train", "configs/default.toml", "--out", str(out), *sets]) == 0
    assert _iterations(out) == [0]  # stopped after the first iteration, not the 50th
    assert [p.name for p in list_checkpoints(out)] == ["iter-000001"]  # the end's checkpoint
    assert (out / "final").is_dir()
    assert json.loads((out / "summary.json").read_text())["accuracy_after"] >= 0.0
