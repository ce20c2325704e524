"""Run files survive a full disk: written whole or not at all, and the error names the file."""

import errno
import json
import os

import pytest

from cadence.metrics import JsonlSink
from cadence.metrics.files import atomic_write, is_disk_full, is_stale_temporary, writing


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _HalfThenFull:
    """`os.write` that writes half of what it is given, then fails: a disk filling mid-line."""

    def __init__(self) -> None:
        self.real, self.calls = os.write, 0

    def __call__(self, fd, data):
        self.calls += 1
        if self.calls == 1:
            return self.real(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_metrics_line_the_disk_cannot_hold_is_cut_back_off_the_file(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.write({"iteration": 0, "loss": 0.5})
    monkeypatch.setattr(os, "write", _HalfThenFull())
    with pytest.raises(OSError) as info:
        sink.write({"iteration": 1, "loss": 0.25})
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)
    assert [json.loads(x) for x in path.read_text().splitlines()] == [{"iteration": 0, "loss": 0.5}]
    sink.write({"iteration": 1, "loss": 0.25})  # space again: the line goes on after the last
    sink.close()
    assert [json.loads(x)["iteration"] for x in path.read_text().splitlines()] == [0, 1]


def test_atomic_write_keeps_the_old_file_whole_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "trace.json"
    atomic_write(path, '{"old": true}')
    monkeypatch.setattr(os, "write", _no_space)
    with pytest.raises(OSError) as info:
        atomic_write(path, '{"new": true}')
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)
    assert json.loads(path.read_text()) == {"old": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]


def test_disk_full_errors_are_told_apart_whatever_raises_them(tmp_path):
    # safetensors' own error for ENOSPC (measured on a full tmpfs), and a wrapped OSError
    rust = RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert is_disk_full(rust) and is_disk_full(OSError(errno.EDQUOT, "quota"))
    try:
        try:
            raise OSError(errno.ENOSPC, "full")
        except OSError as e:
            raise RuntimeError("saving failed") from e
    except RuntimeError as wrapped:
        assert is_disk_full(wrapped)
    assert not is_disk_full(OSError(errno.EACCES, "denied")) and not is_disk_full(ValueError("x"))
    with pytest.raises(OSError) as info, writing(tmp_path / "ckpt"):
        raise rust
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / "ckpt")
    with pytest.raises(PermissionError), writing(tmp_path / "ckpt"):
        raise PermissionError(errno.EACCES, "denied")  # any other error passes unchanged


def test_only_a_dead_writers_temporaries_are_stale(tmp_path):
    assert is_stale_temporary(tmp_path / ".iter-000004.tmp-999999999")  # no such process
    assert is_stale_temporary(tmp_path / f".trace.json.tmp-{os.getpid()}")  # this one's, before
    assert not is_stale_temporary(tmp_path / f".iter-000004.tmp-{os.getppid()}")  # alive
    assert not is_stale_temporary(tmp_path / "iter-000004")
    assert not is_stale_temporary(tmp_path / "notes.tmp-12")  # not one of ours: no leading dot


def test_the_device_is_named_by_its_source_and_mount_point(tmp_path):
    import re

    from cadence.metrics.files import device_of

    named = device_of(str(tmp_path / "run" / "not-yet" / "trace.json"))  # nearest existing parent
    match = re.fullmatch(r"(\S+) \(mounted on (\S+)\)", named)
    assert match, named
    assert str(tmp_path).startswith(match.group(2))
    assert device_of(None) == "device"
