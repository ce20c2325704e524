"""Writing a run's files so that a crash or a full disk never leaves one half-written.

`atomic_write` writes a temporary file beside its target (`.NAME.tmp-PID`), syncs it and renames
it over the target, so a reader finds the old file or the new one, never a truncated one; on
failure the temporary goes. `writing(path)` turns any error that means "the disk is full" (an
`OSError` with ENOSPC or EDQUOT, or a library's error that says so in words, as safetensors'
does) into `OSError(ENOSPC, ..., path)`, which the CLI reports in one line naming the device and
the file. This module knows no run layout; it must not import anything of cadence.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

_FULL = (errno.ENOSPC, errno.EDQUOT)
_FULL_WORDS = ("No space left on device", "Disk quota exceeded", "os error 28", "StorageFull")


def is_disk_full(e: BaseException) -> bool:
    """Whether `e`, or any exception it was raised from, says that the disk is full."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL:
            return True
        if any(words in str(e) for words in _FULL_WORDS):
            return True
        e = e.__cause__ or e.__context__
    return False


@contextlib.contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Re-raise a disk-full error inside the block as `OSError(ENOSPC, ..., path)`."""
    try:
        yield
    except Exception as e:
        if not is_disk_full(e):
            raise
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from e


def write_all(fd: int, data: bytes) -> None:
    """`os.write` until every byte is written (a write may take fewer)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def atomic_write(path: str | Path, data: bytes | str) -> Path:
    """Replace `path` with `data` all at once (see the module docstring)."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with writing(path):
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                write_all(fd, raw)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return path


def is_stale_temporary(path: Path) -> bool:
    """A `.NAME.tmp-PID` file or directory whose writer (process PID) is gone."""
    name, sep, pid = path.name.rpartition(".tmp-")
    if not sep or not name.startswith(".") or not pid.isdigit():
        return False
    if int(pid) == os.getpid():
        return True  # ours from before: nothing of this process is writing it now
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # a live process of another user
        return False
    return False


def device_of(path: str | None) -> str:
    """'SOURCE (mounted on MOUNTPOINT)' of the filesystem holding `path` (or its nearest existing
    parent), from /proc/self/mountinfo; 'device' where that cannot be told."""
    if not path:
        return "device"
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    dev = os.stat(p).st_dev
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return "device"
    for line in lines:  # ID PARENT MAJOR:MINOR ROOT MOUNTPOINT OPTIONS ... - FSTYPE SOURCE ...
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        major, minor = (int(x) for x in parts[2].split(":"))
        if os.makedev(major, minor) == dev:
            source = rest.split()[1] if len(rest.split()) > 1 else "device"
            return f"{source} (mounted on {parts[4]})"
    return "device"
