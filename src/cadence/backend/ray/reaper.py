"""Stop a Ray started for the run when its learner dies without stopping it (SIGKILL, OOM).

A process of that Ray is one running the Python interpreter or a binary of the Ray package with a
file open in the session's directory (its logs): the agents rename themselves (`ray::...`) and
overwrite their environment, but keep their logs open, and the session directory is unique to
one `ray.init`. Linux only (it reads /proc); elsewhere no reaper is started. This module must not
import Ray or anything of cadence: it runs as a script, `python .../reaper.py SESSION RAY_DIR`.

Read on: docs/ray.md.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def ray_processes(session_dir: str, ray_dir: str, spare: tuple[int, ...] = ()) -> list[int]:
    """Pids of the processes of the Ray whose session is `session_dir`, but for this one and
    `spare` (the learner: a driver keeps log files of the session open too)."""
    interpreter = os.path.realpath(sys.executable)
    inside = session_dir.rstrip("/") + "/"
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        if int(entry.name) in (os.getpid(), *spare):
            continue
        try:
            exe = os.readlink(entry / "exe")
            if exe != interpreter and not exe.startswith(ray_dir):
                continue
            if any(os.readlink(fd).startswith(inside) for fd in (entry / "fd").iterdir()):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return found


def reap(session_dir: str, ray_dir: str, spare: tuple[int, ...] = (), grace_s: float = 3.0) -> int:
    """SIGTERM every process of that Ray, SIGKILL any still alive after `grace_s`; how many
    there were."""
    pids = ray_processes(session_dir, ray_dir, spare)
    _signal(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while (left := ray_processes(session_dir, ray_dir, spare)) and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal(left, signal.SIGKILL)
    return len(pids)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def start(session_dir: str, ray_dir: str) -> subprocess.Popen | None:
    """The reaper of the Ray whose session is `session_dir` (None where there is no /proc)."""
    if not Path("/proc/self/fd").is_dir():
        return None
    return subprocess.Popen(  # a script: no import of cadence (and torch) for it
        [sys.executable, str(Path(__file__).resolve()), session_dir, ray_dir],
        stdin=subprocess.PIPE,
        start_new_session=True,  # outlives the learner, and Ctrl-C does not reach it
    )


def stop(reaper: subprocess.Popen | None, timeout_s: float = 10.0) -> None:
    """After `ray.shutdown()`: let the reaper sweep up any straggler, and wait for it."""
    if reaper is None or reaper.stdin is None:
        return
    reaper.stdin.close()
    try:
        reaper.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    learner = os.getppid()  # now, while it is alive: it is spared at a normal shutdown
    sys.stdin.buffer.read()  # until the learner closes it, or dies
    reap(sys.argv[1], sys.argv[2], spare=(learner,))
