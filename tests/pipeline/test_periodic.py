"""Periodic asynchrony: worker processes, producer thread, streaming consumer, proven on-policy."""

import json
import math
import multiprocessing

import pytest

from cadence.backend import WorkerDied, WorkerError
from cadence.builder import build_run, train
from cadence.dataplane import StaleRowError
from cadence.models import load_model
from cadence.pipeline import WorkerSource
from runs import TWO_WORKERS, pids_alive, run_config, train_run
from updates import assert_same_update, max_relative_diff

pytestmark = pytest.mark.slow


def _cfg(model_dir, mode, *extra):
    separate = "pipeline.placement='separate'"
    return run_config(model_dir, f"pipeline.mode='{mode}'", separate, *TWO_WORKERS, *extra)


@pytest.fixture(scope="module")
def sync_reference(model_dir, tmp_path_factory):
    """The synchronous run of `_cfg`, two worker processes: the update the periodic runs below
    must make (run, records, every step's gradients)."""
    grads: list = []
    run, records, _ = train_run(_cfg(model_dir, "sync"), tmp_path_factory.mktemp("sync"), grads)
    return run, records, grads


def test_periodic_update_equals_sync_update(model_dir, sync_reference, tmp_path):
    sync_run, sync_records, sync_grads = sync_reference
    per_grads: list = []
    # periodic trains padding-free (the packed layout), sync the default prefix layout
    packed = "learner.shared_prompt_impl='packed'"
    per_run, per_records, pids = train_run(
        _cfg(model_dir, "periodic", packed), tmp_path / "periodic", per_grads
    )
    assert per_run.trainer.layout == "packed"
    # Groups reach the periodic learner in completion order, so its sums run in another order:
    # equal within float tolerance, step by step (see tests/updates.py). The first step's
    # gradients agree to ~3e-7 relative; later steps start from parameters that already differ by
    # float noise (magnified by Adam where |g| ~ eps) and agree to ~5e-6. A lost or repeated
    # group of the six changes the sum by a sixth; a stale one changes the samples themselves.
    assert len(per_grads) == 3
    assert max_relative_diff(per_grads[0], sync_grads[0]) <= 1e-5
    assert_same_update(
        per_run.trainer.model, sync_run.trainer.model, per_grads, sync_grads, grad_rtol=5e-5
    )
    assert [r["reward_mean"] for r in sync_records] == [r["reward_mean"] for r in per_records]
    for r in per_records:  # one optimizer step per iteration, every group consumed once
        assert r["optimizer_steps"] == 1
        assert r["policy_version"] == r["iteration"]
    # the learner really moved, so equality is not trivially of two untrained models
    fresh = load_model(model_dir)
    moved = max(
        (a - b).abs().max().item()
        for a, b in zip(fresh.parameters(), per_run.trainer.model.parameters(), strict=True)
    )
    assert moved > 1e-4
    assert not pids_alive(pids) and not multiprocessing.active_children()


def test_learner_trains_before_the_last_group_is_generated(model_dir, tmp_path):
    cfg = _cfg(model_dir, "periodic", "train.micro_batch_groups=1", "pipeline.tasks_in_flight=1")
    run, records, _ = train_run(cfg, tmp_path)
    spans = run.tracer.spans
    for k in range(1, 3):  # iterations after the first (warm caches)
        starts = [s.start for s in spans if s.name == "weight_sync"]
        window = (starts[k], starts[k + 1] if k + 1 < len(starts) else float("inf"))
        inside = [s for s in spans if window[0] <= s.start < window[1]]
        first_train = min(s.start for s in inside if s.name == "forward_backward")
        last_gen_end = max(s.end for s in inside if s.name == "generate")
        assert first_train < last_gen_end
    assert all(r["overlap_s"] > 0 for r in records[1:])
    # slot occupancy per worker, from the engines, in the trace: filled, then empty at the end
    slots = [x for x in run.tracer.samples if x.name == "slots"]
    assert {x.track for x in slots} == {"worker-0", "worker-1"}
    assert max(x.value for x in slots) > 0 and min(x.value for x in slots) == 0
    assert max(x.value for x in slots) <= cfg.rollout.max_num_seqs
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert any(e["ph"] == "C" and e["name"] == "worker-1 slots" for e in events)
    for key in [
        "t_weight_sync",
        "t_first_group",
        "t_last_group",
        "gen_busy_s",
        "train_busy_s",
        "learner_idle_s",
        "worker_idle_s",
        "overlap_s",
        "pipeline_efficiency",
        "queue_depth",
        "tpspd",
        "weight_sync_s",
        "weight_sync_bytes",
    ]:
        assert key in records[-1], key
    weighs = sum(p.numel() * p.element_size() for p in run.trainer.model.parameters())
    assert all(r["weight_sync_bytes"] == weighs for r in records)  # a whole version each


class EagerProducer(WorkerSource):
    """Broken on purpose: publishes the weights but sends prompts without the workers' loading
    and acknowledging them."""

    def barrier(self, version):
        self.pool.weights.publish(self.model, version)


def test_producer_that_skips_the_barrier_is_caught(model_dir, tmp_path):
    run = build_run(_cfg(model_dir, "periodic", "pipeline.num_workers=1"))
    run.source.__class__ = EagerProducer
    with pytest.raises(StaleRowError, match="policy_version -1, learner is at 0"):
        train(run, tmp_path)
    assert not multiprocessing.active_children()


def test_a_worker_that_keeps_dying_stops_the_run_and_leaves_no_process(model_dir, tmp_path):
    cfg = _cfg(
        model_dir,
        "periodic",
        "reward.function='fixtures_rewards:exit_on_third_call'",
        "pipeline.max_worker_restarts=1",
    )
    run = build_run(cfg)
    pids = [p.process.pid for p in run.source.pool.processes.procs]
    with pytest.raises(
        WorkerDied,
        match=r"worker \d \(pid \d+\) exited with code 3; prompts in flight: .*; restarted 1 "
        r"time\(s\) already \(pipeline.max_worker_restarts = 1\)",
    ):
        train(run, tmp_path)
    assert not pids_alive(pids) and not multiprocessing.active_children()  # replacements too


def test_a_worker_killed_mid_iteration_is_replaced_and_the_update_equals_sync(
    model_dir, sync_reference, tmp_path, monkeypatch
):
    # the worker process exits while scoring a group; its replacement loads the current version
    # and regenerates the prompts it had not returned, with the same seeds: the run makes the
    # very update of the synchronous run (nothing lost, nothing trained twice, nothing stale)
    monkeypatch.setenv("CADENCE_TEST_EXIT_ONCE", str(tmp_path / "exited"))
    sync_run, _, sync_grads = sync_reference
    per_grads: list = []
    cfg = _cfg(model_dir, "periodic", "reward.function='fixtures_rewards:exit_once'")
    per_run, records, pids = train_run(cfg, tmp_path / "periodic", per_grads)
    assert (tmp_path / "exited").exists()
    assert [r["worker_restarts"] for r in records][-1] == 1
    assert all(r["staleness_max"] == 0 and r["optimizer_steps"] == 1 for r in records)
    assert_same_update(
        per_run.trainer.model, sync_run.trainer.model, per_grads, sync_grads, grad_rtol=5e-5
    )
    assert not pids_alive(pids) and not multiprocessing.active_children()  # replacements too


def test_worker_exception_reaches_the_learner_with_its_traceback(model_dir, tmp_path):
    cfg = _cfg(model_dir, "periodic", "reward.function='fixtures_broken_in_workers:reward'")
    with pytest.raises(WorkerError, match=r"(?s)worker \d failed:.*Traceback.*refuses to load"):
        build_run(cfg)
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("loss", ["ppo_clip", "online_dpo"])
def test_one_step_offpolicy_run_end_to_end(model_dir, tmp_path, loss):
    extra = ["pipeline.max_staleness=1", f"algo.loss='{loss}'"]
    if loss == "online_dpo":
        extra.append("algo.kl_coef=0.0")
    _, records, pids = train_run(_cfg(model_dir, "offpolicy", *extra), tmp_path)
    assert [r["staleness_hist"] for r in records] == [[6, 0], [0, 6], [0, 6]]
    assert [r["staleness_max"] for r in records] == [0, 1, 1]
    assert all(r["dropped_groups"] == 0 and r["optimizer_steps"] == 1 for r in records)
    assert [r["stale_token_frac"] for r in records] == [0.0, 1.0, 1.0]
    assert all(math.isfinite(r["loss"]) for r in records)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["staleness_hist"] == [0, 6]
    assert not pids_alive(pids) and not multiprocessing.active_children()


def test_periodic_update_equals_sync_update_with_dynamic_sampling(model_dir, tmp_path):
    # two samples per prompt make constant groups common; each is replaced by the next prompt
    extra = ("pipeline.filter_groups='zero_variance'", "rollout.group_size=2")
    sync_grads, per_grads = [], []
    sync_run, sync_records, _ = train_run(
        _cfg(model_dir, "sync", *extra), tmp_path / "sync", sync_grads
    )
    per_run, per_records, pids = train_run(
        _cfg(model_dir, "periodic", *extra), tmp_path / "periodic", per_grads
    )
    figures = [(r["filtered_groups"], r["oversampled_prompts"]) for r in sync_records]
    assert figures == [(r["filtered_groups"], r["oversampled_prompts"]) for r in per_records]
    assert sum(f for f, _ in figures) > 0  # groups were filtered and replaced
    assert [r["reward_mean"] for r in sync_records] == [r["reward_mean"] for r in per_records]
    assert_same_update(
        per_run.trainer.model, sync_run.trainer.model, per_grads, sync_grads, grad_rtol=5e-5
    )
    assert not pids_alive(pids) and not multiprocessing.active_children()
    # generating in the learner's thread draws and keeps the same groups, round by round
    colocated = _cfg(model_dir, "sync", *extra, "pipeline.placement='colocated'")
    _, col_records, _ = train_run(colocated, tmp_path / "colocated")
    assert figures == [(r["filtered_groups"], r["oversampled_prompts"]) for r in col_records]
    assert [r["reward_mean"] for r in col_records] == [r["reward_mean"] for r in sync_records]


def test_periodic_update_equals_sync_update_for_multi_turn_episodes(calculator_model_dir, tmp_path):
    # the calculator warm start calls its tool: episodes of several turns, tool results in them
    tool = [
        "env.kind='tool'",
        "env.max_turns=3",
        "env.max_total_tokens=40",
        "rollout.max_new_tokens=16",
    ]  # the reward stays even_length: the transcripts' lengths vary, so every step has a gradient
    sync_grads, per_grads = [], []
    sync_run, sync_records, _ = train_run(
        _cfg(calculator_model_dir, "sync", *tool), tmp_path / "sync", sync_grads
    )
    per_run, per_records, pids = train_run(
        _cfg(calculator_model_dir, "periodic", *tool), tmp_path / "periodic", per_grads
    )
    assert all(r["turns_mean"] > 1 and r["tool_calls"] > 0 for r in per_records)
    assert all(0 < r["env_token_frac"] < 1 for r in per_records)
    for key in ("reward_mean", "turns_mean", "tool_calls", "tool_errors", "env_token_frac"):
        assert [r[key] for r in sync_records] == [r[key] for r in per_records], key
    assert max_relative_diff(per_grads[0], sync_grads[0]) <= 1e-5
    assert_same_update(
        per_run.trainer.model, sync_run.trainer.model, per_grads, sync_grads, grad_rtol=5e-5
    )
    assert all(r["policy_version"] == r["iteration"] for r in per_records)
    # tool calls are on the timeline, under their worker
    tools = [s for s in per_run.tracer.spans if s.name == "tool"]
    assert tools and all(
        s.track.startswith("worker-") and s.track.endswith(" tools") for s in tools
    )
    assert not pids_alive(pids) and not multiprocessing.active_children()
