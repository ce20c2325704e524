"""Learner ranks end to end: `learner.ranks = 2` (FSDP2 or DDP over gloo, local processes or Ray
actors) makes the single-process update, in sync and periodic mode with worker processes; a
killed rank stops the run cleanly.

Two iterations (the second generates with the weights the first trained), of nine groups each in
two optimizer steps (`train.mini_batches = 2`: five groups, then four), two groups per
micro-batch. With two ranks the first step is a round of two micro-batches
of two groups, then a round in which one rank trains a single group and the other an idle pass;
the second step is one round of two and two. So an odd number of groups, micro-batches of
different sizes, idle passes and several steps per iteration (with the frozen old copy, sharded
like the policy) are all covered by every run.
"""

import json
import multiprocessing
import os
import signal
import threading
import time

import pytest

from cadence.backend import WorkerDied
from cadence.builder import build_run, train
from cadence.metrics import MemorySink
from cadence.models import load_model
from runs import pids_alive, run_config, train_run
from updates import assert_same_params

pytestmark = pytest.mark.slow


_BASE = (
    "pipeline.placement='separate'",
    "pipeline.num_workers=1",
    "pipeline.prompts_per_task=1",
    "pipeline.learner_threads=2",
    "train.iterations=2",
    "train.prompts_per_iteration=9",
    "train.micro_batch_groups=2",
    "train.mini_batches=2",
    "train.lr=1e-3",
    "train.checkpoint_every=0",
    "rollout.group_size=4",
    "rollout.max_new_tokens=8",
    "algo.kl_coef=0.05",
    "metrics.progress=false",
    "reward.function='fixtures_rewards:even_length'",
)


def _cfg(model_dir, mode="sync", *extra):
    return run_config(model_dir, f"pipeline.mode='{mode}'", *extra, base=_BASE)


def _train(cfg, out, grads=None):
    return train_run(cfg, out, grads, evaluate=False)


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.fixture(scope="module")
def one_process(model_dir, tmp_path_factory):
    """The reference: one learner process, sync mode; its parameters and every step's grads."""
    grads: list = []
    run, records, _ = _train(_cfg(model_dir), tmp_path_factory.mktemp("one"), grads)
    return _params(run.trainer.model), records, grads


@pytest.fixture(scope="module")
def ranked(model_dir, tmp_path_factory):
    """Runs with two ranks, by (strategy, mode, backend), each run once for the module."""
    runs = {}

    def get(strategy, mode, backend="local", *extra):
        key = (strategy, mode, backend)
        if key not in runs:
            sets = ["learner.ranks=2", f"learner.strategy='{strategy}'", *extra]
            if backend == "ray":
                sets.append("pipeline.backend='ray'")
            out = tmp_path_factory.mktemp("-".join(key))
            run, records, pids = _train(_cfg(model_dir, mode, *sets), out)
            trace = json.loads((out / "trace.json").read_text())["traceEvents"]
            tracks = {e["args"]["name"] for e in trace if e["name"] == "thread_name"}
            runs[key] = _params(run.trainer.model), records, tracks, pids
        return runs[key]

    return get


@pytest.mark.parametrize("mode", ["sync", "periodic"])
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_two_ranks_make_the_one_process_update(one_process, ranked, model_dir, strategy, mode):
    want, want_records, grads = one_process
    got, records, tracks, pids = ranked(strategy, mode)
    assert_same_params(got, want, grads)
    assert [r["reward_mean"] for r in records] == [r["reward_mean"] for r in want_records]
    for r, w in zip(records, want_records, strict=True):  # the figures are the global batch's
        assert r["num_tokens"] == w["num_tokens"] and r["tokens_computed"] == w["tokens_computed"]
        assert r["loss"] == pytest.approx(w["loss"], rel=1e-4, abs=1e-7)
        assert r["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4)
        assert r["optimizer_steps"] == 2 and r["learner_ranks"] == 2
        assert len(r["learner_rank_busy_s"]) == 2 and min(r["learner_rank_busy_s"]) > 0
        assert r["learner_peak_rss_mb"] == max(r["learner_rank_peak_rss_mb"]) > 0
    fresh = load_model(model_dir).named_parameters()
    assert max((got[k] - p).abs().max().item() for k, p in fresh) > 1e-4  # it really trained
    assert {"learner", "learner-0", "learner-1"} <= tracks  # one timeline track per rank
    assert not pids_alive(pids) and not multiprocessing.active_children()


def test_ranks_on_ray_end_with_the_local_ranks_parameters(ranked):
    from cadence.backend.ray.cluster import shutdown_ray, start_ray

    started = start_ray(None, num_cpus=3)  # a worker and two ranks, one CPU each
    try:
        got, records, tracks, _ = ranked("fsdp", "sync", "ray")
    finally:
        if started:
            shutdown_ray()  # and the reaper `start_ray` started
    want, want_records, _, _ = ranked("fsdp", "sync")
    assert max((got[k] - p).abs().max().item() for k, p in want.items()) <= 1e-6
    assert [r["reward_mean"] for r in records] == [r["reward_mean"] for r in want_records]
    assert {"learner-0", "learner-1"} <= tracks


def test_a_killed_rank_stops_the_run_naming_it_and_leaves_no_process(model_dir, tmp_path):
    cfg = _cfg(model_dir, "periodic", "learner.ranks=2", "train.iterations=6")
    run = build_run(cfg)
    pids = [d["pid"] for d in run.trainer.described]
    workers = [p.process.pid for p in run.source.pool.processes.procs]
    killed_at = []

    class KillRankOne(MemorySink):
        def write(self, record):
            super().write(record)
            if record["iteration"] == 0:
                os.kill(pids[1], signal.SIGKILL)
                killed_at.append(time.monotonic())

    error = []

    def target():
        try:
            train(run, tmp_path, extra_sinks=[KillRankOne()], evaluate=False)
        except BaseException as e:
            error.append(e)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the run hung after a rank was killed"
    assert time.monotonic() - killed_at[0] < 60  # the next round finds it (and the closing)
    assert isinstance(error[0], WorkerDied) and error[0].wid == 1, error
    assert f"learner rank 1 (pid {pids[1]}) exited with code -9" in str(error[0])
    assert not pids_alive(pids + workers) and not multiprocessing.active_children()
    assert not (tmp_path / "final").exists()
