"""Helpers for the tests that build and train whole runs, and check what processes they leave.

One config builder on top of a small base run, one trainer that records metrics (and, if asked,
every optimizer step's gradients), `Cadence` (a `cadence` command in a session of its own, for
the tests that kill one), `KillOnFirstGroups` (a fault injected while prompts are in flight),
and the process checks the fault tests share: pids of a run's local processes, which of them are
alive, and the processes of a session or children of a pid as /proc lists them. Nothing here
asserts: each test states its own claim.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from cadence.builder import build_run, train
from cadence.cli import main
from cadence.config import Config, load_config
from cadence.metrics import MemorySink
from updates import capture_grads

# Three iterations of six prompts, groups of four, ten new tokens, KL to the reference: every
# "X makes the sync update" run (pipeline, Ray, reward stage) builds on it. Files add the
# placement, mode and worker settings of what they test.
SMALL_RUN = (
    "train.iterations=3",
    "train.prompts_per_iteration=6",
    "train.micro_batch_groups=2",
    "train.lr=1e-3",
    "rollout.group_size=4",
    "rollout.max_new_tokens=10",
    "data.num_heldout=4",
    "algo.kl_coef=0.05",
    "metrics.progress=false",
    "reward.function='fixtures_rewards:even_length'",
)

TWO_WORKERS = ("pipeline.num_workers=2", "pipeline.prompts_per_task=1")  # a task per prompt

# For tests that run configs/default.toml for what it shares with every config (the CLI, trackers,
# Ctrl-C, studies) and claim nothing about its dynamic sampling: each iteration trains the prompts
# it draws, rather than drawing up to `pipeline.max_oversample` more to replace all-equal groups.
UNFILTERED = "pipeline.filter_groups='none'"


def peer_workload(model_dir, *, kl: bool = True) -> list[str]:
    """The tiny workload cadence and TRL both run in the bench tests (`--suite trl`, `--suite
    race`): four prompts, groups of four, twelve new tokens; `kl=False` leaves out the reference
    pass."""
    return [
        f"model.path='{model_dir}'",
        "train.prompts_per_iteration=4",
        "train.micro_batch_groups=2",
        "rollout.group_size=4",
        "rollout.max_new_tokens=12",
        *(["algo.kl_coef=0.05"] if kl else []),
        "train.threads=2",
        "reward.function='fixtures_rewards:even_length'",
    ]


def run_config(model_dir, *sets: str, base: tuple[str, ...] = SMALL_RUN) -> Config:
    """`base`, then `sets` (later keys win), on the model in `model_dir`."""
    return load_config(None, [f"model.path='{model_dir}'", *base, *sets])


class KillOnFirstGroups:
    """Wraps a rollout pool's `poll`: calls `kill(pool)` once, when iteration 1's first groups
    arrive, so what it kills (an actor, a node) dies with prompts in flight. `killed` is what
    `kill` returned, `killed_at` the monotonic time (None before the kill)."""

    def __init__(self, pool, kill: Callable) -> None:
        self.pool, self.kill, self.poll = pool, kill, pool.poll
        self.killed, self.killed_at = None, None
        pool.poll = self

    def __call__(self, timeout_s):
        message = self.poll(timeout_s)
        groups = message[2].groups if message is not None and message[0] == "groups" else []
        if self.killed_at is None and groups and groups[0].iteration == 1:
            self.killed = self.kill(self.pool)
            self.killed_at = time.monotonic()
        return message


class Trained(NamedTuple):
    run: object  # the built `Run`: its learner holds the trained model
    records: list[dict]  # metrics.jsonl's records, one per iteration
    pids: list[int]  # the run's local processes, taken before it trained


def train_run(
    cfg: Config, out: Path, grads: list | None = None, sink=None, evaluate: bool = True
) -> Trained:
    """Build and train `cfg` into `out`; each optimizer step's gradients go to `grads` if given."""
    run = build_run(cfg)
    if grads is not None:
        capture_grads(run.trainer, grads)
    pids = local_pids(run, cfg)
    sink = sink or MemorySink()
    train(run, out, extra_sinks=[sink], evaluate=evaluate)
    return Trained(run, sink.records, pids)


def local_pids(run, cfg: Config) -> list[int]:
    """Pids of the processes a run started on this machine: rollout workers, reward and teacher
    workers (beside the workers, or reward workers beside a colocated one) and learner ranks
    (none for Ray actors)."""
    if cfg.pipeline.backend != "local":
        return []
    pids = [d["pid"] for d in run.trainer.described] if cfg.learner.ranks > 1 else []
    colocated_reward = getattr(getattr(run.source, "worker", None), "reward", None)
    processes = getattr(colocated_reward, "processes", None)
    pids += [p.process.pid for p in getattr(processes, "procs", [])]
    if cfg.pipeline.placement == "separate":
        source = run.source
        stages = [p for stage in source.stages for p in stage.processes.procs]
        pids += [p.process.pid for p in source.pool.processes.procs + stages]
    return pids


def pids_alive(pids: list[int]) -> list[int]:
    """Those of `pids` that still exist (a zombie counts: it was not reaped)."""
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


class ProcInfo(NamedTuple):
    pid: int
    state: str  # "R", "S", "Z", ... (field 3 of /proc/PID/stat)
    ppid: int
    sid: int
    cmdline: str


def processes() -> list[ProcInfo]:
    """Every process /proc shows now (those that end while it is read are left out)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        text = cmdline.replace(b"\0", b" ").decode(errors="replace")
        pid = int(stat.parent.name)
        found.append(ProcInfo(pid, fields[0], int(fields[1]), int(fields[3]), text))
    return found


def session_alive(sid: int) -> list[ProcInfo]:
    """Live (not zombie) processes of session `sid`."""
    return [p for p in processes() if p.sid == sid and p.state != "Z"]


class Cadence:
    """`cadence ARGS` in a session of its own, its stderr in a file (two may run at once: a pipe
    nobody reads could fill and stall one). `module` runs in its place a module that wraps the
    CLI (tests/partial_runs.py); $CADENCE_TEST_KILL_MARKER is `marker`."""

    def __init__(self, args, env, marker: Path, log: Path, module: str = "cadence.cli") -> None:
        self.log = log
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, *args],
                env=env | {"CADENCE_TEST_KILL_MARKER": str(marker)},
                start_new_session=True,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        self.pid = self.proc.pid

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        """After a failed check: leave no run behind."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def in_process(args: list[str]) -> int:
    """`cadence ARGS` run by its `main` in this process, for a run that need not be a process of
    its own (one no test signals or kills): no interpreter to start, and worker processes forked
    from this process's fork server, started once. torch's thread count is restored after."""
    threads = torch.get_num_threads()
    try:
        return main(args)
    finally:
        torch.set_num_threads(threads)
