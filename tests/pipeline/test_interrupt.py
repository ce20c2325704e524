"""Ctrl-C stops the learner and every worker process; nothing is left behind."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runs import UNFILTERED, processes

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


def _workers(pid: int) -> list[int]:
    """The run's worker processes: the children of its fork server (backend/procs.py)."""
    found = processes()
    servers = {p.pid for p in found if p.ppid == pid and "forkserver" in p.cmdline}
    return [p.pid for p in found if p.ppid in servers]


@contextlib.contextmanager
def _ctrl_c_not_ignored():
    """Start the run as a terminal starts a foreground command: with SIGINT not ignored. A suite
    launched as a background job (`cmd &` in a script, some CI runners) ignores SIGINT, an ignored
    signal stays ignored through exec, and Python then leaves it so: the run would rightly never
    see the Ctrl-C this test sends. A handled signal is reset to its default at exec."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("when", ["while workers start", "while training"])
def test_ctrl_c_stops_learner_and_workers_and_prints_one_line(model_dir, tmp_path, when):
    # Before: Ctrl-C printed KeyboardInterrupt (and BrokenPipeError) tracebacks from the workers,
    # most often while they were still importing their libraries.
    args = [
        sys.executable,
        "-m",
        "cadence.cli",
        "train",
        "configs/default.toml",
        "--out",
        str(tmp_path),
        "--set",
        f"model.path='{model_dir}'",
        "--set",
        "pipeline.placement='separate'",
        "--set",
        "pipeline.mode='periodic'",
        "--set",
        "pipeline.num_workers=2",
        "--set",
        "train.iterations=100000",
        "--set",
        "train.eval_every=0",
        "--set",
        "data.num_heldout=2",
        "--set",  # small iterations: the first ends (and training is under way) sooner
        "train.prompts_per_iteration=4",
        "--set",
        "rollout.group_size=4",
        "--set",
        "rollout.max_new_tokens=8",
        "--set",
        "metrics.progress=false",
        "--set",
        UNFILTERED,  # the first iteration ends after its 4 prompts
    ]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    with _ctrl_c_not_ignored():
        proc = subprocess.Popen(
            args, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
    try:
        metrics = tmp_path / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while len(_workers(proc.pid)) < 2 or (
            when == "while training" and (not metrics.exists() or not metrics.stat().st_size)
        ):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, f"never got to {when}"
            time.sleep(0.05)
        workers = _workers(proc.pid)
        assert len(workers) == 2
        servers = [p.ppid for p in processes() if p.pid in workers]
        if when == "while workers start":
            time.sleep(
                1.0
            )  # past Python's start-up, into the imports (seconds: torch, transformers)
        os.killpg(
            proc.pid, signal.SIGINT
        )  # what a terminal's Ctrl-C does: every process of the group
        assert proc.wait(timeout=60) == 130
        # one line for the interrupt, no traceback; before it only the run's own log lines (a
        # tiny model's run may get three iterations in and warn that its rewards are all equal)
        lines = proc.stderr.read().decode().splitlines()
        assert lines[-1] == "cadence: interrupted", lines
        assert all(line.startswith("cadence: ") for line in lines), lines
        assert lines.count("cadence: interrupted") == 1, lines
        deadline = time.monotonic() + 0.5  # the fork servers end once the run has ended
        while [pid for pid in workers + servers if _alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not [pid for pid in workers + servers if _alive(pid)]
    finally:  # a failed check must not leave a 100,000-iteration run behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
