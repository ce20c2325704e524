"""The reward stage: reward workers score rows from the sample store as they arrive.

A learned reward model and a rule reward both run as a stage of worker processes; the rule as a
stage makes the update of the rule inside the rollout workers; a reward worker that dies or
cannot load stops the run with a clear error and leaves no process; the stage figures are in
metrics.jsonl and on the timeline.
"""

import json
import multiprocessing
import time

import pytest

from cadence.backend import RewardStage, WorkerDied, WorkerError
from cadence.builder import build_run, train
from cadence.data import DEFAULT_TEMPLATE, ArithmeticTask
from cadence.dataplane import LEARNER, TRAIN, SampleStore, batch_groups, group_rows
from cadence.metrics import MemorySink, Tracer
from cadence.rewards import RewardSpec, safe_reward
from cadence.rewards.model import RewardModel
from cadence.rewards.model_recipe import train_reward_model
from cadence.types import Completion, Group, Prompt
from fixtures_rewards import flaky
from runs import local_pids, pids_alive, run_config
from updates import assert_same_update, capture_grads

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, model_dir):
    """The embedded recipe at a tiny step budget: a real (if weak) classifier on the task."""
    out = tmp_path_factory.mktemp("rm") / "reward-model"
    task = ArithmeticTask(difficulty=1, seed=0, num_heldout=8)
    train_reward_model(task, DEFAULT_TEMPLATE, model_dir, out, steps=3, batch_size=8, num_heldout=8)
    return out


_BASE = (
    "pipeline.mode='periodic'",
    "pipeline.placement='separate'",
    "pipeline.num_workers=1",
    "pipeline.prompts_per_task=1",
    "train.iterations=2",
    "train.prompts_per_iteration=4",
    "train.micro_batch_groups=2",
    "train.lr=1e-3",
    "train.checkpoint_every=0",
    "rollout.group_size=4",
    "rollout.max_new_tokens=8",
    "data.num_heldout=4",
    "metrics.progress=false",
)


def _cfg(model_dir, *extra):
    return run_config(model_dir, *extra, base=_BASE)


def _train(cfg, out, grads=None):
    """Train; return the run, its records and the groups the learner trained on, in order."""
    run = build_run(cfg)
    if grads is not None:
        capture_grads(run.trainer, grads)
    trained = []
    train_iteration = run.trainer.train_iteration

    def capture(scored, num_groups):
        return train_iteration((trained.append(s.group) or s for s in scored), num_groups)

    run.trainer.train_iteration = capture
    pids = local_pids(run, cfg)
    sink = MemorySink()
    train(run, out, extra_sinks=[sink], evaluate=False)
    assert not pids_alive(pids) and not multiprocessing.active_children()
    return run, sink.records, trained


def test_a_rule_stage_scores_each_row_once_exactly_as_a_rollout_worker_would():
    store, tracer = SampleStore(), Tracer()
    stage = RewardStage(
        RewardSpec("rule", "fixtures_rewards:flaky"), 2, store, tracer, batch_size=3
    )
    prompt = Prompt("p", "What is 1 + 1?", "#### 2")
    groups = [
        Group(prompt, [1, 2], [Completion([7], [-0.5], text="x" * (g + j)) for j in range(4)], 0, 0)
        for g in range(5)
    ]
    try:
        stage.start()
        for g, group in enumerate(groups):
            rows, fields = group_rows(group, g, 4 * g, scored=False)
            store.put(rows, fields)
        batch = store.get(TRAIN, 5, LEARNER, timeout=60, min_size=5)
    finally:
        stage.close()
    assert not multiprocessing.active_children()
    scored = batch_groups(batch)
    assert [c.text for g in scored for c in g.completions] == [
        c.text for g in groups for c in g.completions
    ]
    for c in (c for g in scored for c in g.completions):
        expected = safe_reward(flaky, prompt.text, c.text, prompt.answer)
        assert (c.reward, c.reward_error) == (expected.value, expected.error)
    assert any(c.reward_error for g in scored for c in g.completions)  # raised and NaN, recorded
    assert stage.rows_scored == 20 and store.stats()["got"] == {"reward": 20, LEARNER: 20}
    spans = [s for s in tracer.spans if s.name == "score"]
    assert spans and {s.track for s in spans} <= {"reward-0", "reward-1"}


def test_a_reward_model_stage_trains_with_the_reward_models_scores(
    model_dir, reward_model_dir, tmp_path
):
    cfg = _cfg(
        model_dir,
        "reward.kind='model'",
        f"reward.model_path='{reward_model_dir}'",
        "reward.num_workers=2",
        "reward.batch_size=3",
    )
    assert cfg.reward.stage == "separate"
    run, records, trained = _train(cfg, tmp_path)
    assert len(trained) == 8 and all(r["optimizer_steps"] == 1 for r in records)
    # the scores the learner trained on are the reward model's own for those samples
    reward = RewardModel.load(reward_model_dir)
    pairs = [(g.prompt_ids, c.token_ids) for g in trained for c in g.completions]
    expected = reward.score_ids([p for p, _ in pairs], [r for _, r in pairs])
    got = [c.reward for g in trained for c in g.completions]
    assert got == pytest.approx(expected, abs=1e-6)
    assert len(set(got)) > 1 and all(c.reward_error is None for g in trained for c in g.completions)
    # the learner did not score: every reward came from a reward worker's span
    assert {s.track for s in run.tracer.spans if s.name == "score"} <= {"reward-0", "reward-1"}
    _check_stage_figures(tmp_path, ("gen", "reward", "train"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    threads = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "reward-0" in threads
    assert any(e["ph"] == "C" and e["name"] == "queue-reward rows waiting" for e in events)


def _check_stage_figures(out, stages):
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for r in lines:
        for stage in stages:
            busy, idle = r[f"stage_{stage}_busy_s"], r[f"stage_{stage}_idle_s"]
            assert 0 < busy <= r["wall_s"] + 1e-9, (stage, busy, r["wall_s"])
            assert busy + idle == pytest.approx(r["wall_s"], rel=1e-9)
            assert r[f"stage_{stage}_rows_per_s"] > 0
            assert r[f"stage_{stage}_queue_depth"] >= 0
        assert r["stage_train_rows_per_s"] == pytest.approx(16 / r["wall_s"])


def test_a_rule_reward_as_a_stage_makes_the_update_of_the_rule_in_the_workers(model_dir, tmp_path):
    # same seeds, same samples, same rewards (and the same reward errors, counted the same way):
    # the update agrees within the float tolerance of a different group order (tests/updates.py)
    rule = ["reward.function='fixtures_rewards:flaky'", "reward.max_error_fraction=1.0"]
    in_grads, stage_grads = [], []
    in_run, in_records, _ = _train(_cfg(model_dir, *rule), tmp_path / "in", in_grads)
    stage_cfg = _cfg(model_dir, *rule, "reward.stage='separate'", "reward.batch_size=5")
    stage_run, stage_records, _ = _train(stage_cfg, tmp_path / "stage", stage_grads)
    assert [r["reward_mean"] for r in in_records] == [r["reward_mean"] for r in stage_records]
    errors = [r["reward_errors"] for r in in_records]
    assert errors == [r["reward_errors"] for r in stage_records] and min(errors) > 0
    assert_same_update(
        stage_run.trainer.model, in_run.trainer.model, stage_grads, in_grads, grad_rtol=5e-5
    )
    assert "stage_reward_busy_s" not in in_records[0]
    _check_stage_figures(tmp_path / "stage", ("gen", "reward", "train"))


def test_a_reward_worker_that_dies_stops_the_run_and_leaves_no_process(model_dir, tmp_path):
    cfg = _cfg(
        model_dir,
        "reward.stage='separate'",
        "reward.function='fixtures_rewards:exit_in_reward_worker'",
    )
    run = build_run(cfg)
    pids = local_pids(run, cfg)
    start = time.monotonic()
    with pytest.raises(WorkerDied, match=r"reward worker 0 \(pid \d+\) exited with code 3"):
        train(run, tmp_path, evaluate=False)
    assert time.monotonic() - start < 60
    assert not pids_alive(pids) and not multiprocessing.active_children()


def test_a_reward_worker_that_cannot_load_its_reward_fails_the_build_with_its_traceback(
    model_dir,
):
    cfg = _cfg(
        model_dir, "reward.stage='separate'", "reward.function='fixtures_broken_in_workers:reward'"
    )
    with pytest.raises(WorkerError, match=r"(?s)reward worker \d failed:.*Traceback.*refuses"):
        build_run(cfg)
    assert not multiprocessing.active_children()


def test_a_rule_reward_worker_scores_its_micro_batch_concurrently():
    # Before: one row after another, 16 x 0.5 s = 8 s per micro-batch.
    from cadence.rewards.stage import RuleScorer

    scorer = RuleScorer("fixtures_rewards:half_second_even_length", timeout_s=5.0, concurrency=8)
    prompts = [Prompt(f"u{i}", "q", "a", i) for i in range(16)]
    texts = ["x" * i for i in range(16)]
    t0 = time.perf_counter()
    rewards, errors = scorer({"prompt": prompts, "response_text": texts})
    assert time.perf_counter() - t0 < 4.0  # 2 waves of 0.5 s
    assert rewards == [1.0 if i % 2 == 0 else 0.0 for i in range(16)]
    assert errors == [None] * 16
