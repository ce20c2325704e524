"""`env.kind = "verifiers"` end to end: a verifiers environment built from an in-memory data set
(tests/fixtures_verifiers.py) trains for two iterations, its rollouts run against the worker's
own endpoint, rewards from its rubric, held-out accuracy from greedy episodes. A single-turn
environment on the tiny model in the learner's process; a tool environment on the calculator
warm start in a worker process."""

from __future__ import annotations

import json
import math
from itertools import islice

import pytest

from cadence.builder import build_run, make_task, sft_segments, train
from cadence.config import ConfigError, load_config

pytestmark = pytest.mark.slow


def _cfg(model_dir, factory: str, *extra: str):
    return load_config(
        None,
        [
            f"model.path='{model_dir}'",
            "env.kind='verifiers'",
            f"env.factory='{factory}'",
            "data.num_heldout=2",
            "train.iterations=2",
            "train.prompts_per_iteration=2",
            "train.micro_batch_groups=1",
            "train.lr=1e-3",
            "train.checkpoint_every=0",
            "rollout.group_size=3",
            "algo.kl_coef=0.05",
            "metrics.progress=false",
            *extra,
        ],
    )


def _lines(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _finite(record: dict) -> bool:
    return all(math.isfinite(v) for v in record.values() if isinstance(v, int | float))


def test_a_single_turn_environment_trains_in_the_learners_process(model_dir, tmp_path):
    cfg = _cfg(model_dir, "fixtures_verifiers:single_turn", "rollout.max_new_tokens=8")
    summary = train(build_run(cfg), tmp_path)
    lines = _lines(tmp_path)
    assert [r["iteration"] for r in lines] == [0, 1]
    assert all(_finite(r) for r in lines) and _finite(summary)
    for r in lines:
        assert r["reward_errors"] == 0 and r["turns_mean"] == 1.0
        assert 0.0 <= r["reward_mean"] <= 1.5  # the rubric: correct (1.0) + brief (0.5)
        assert r["trained_token_frac"] == 1.0
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0


def test_a_tool_environment_trains_in_a_worker_process(calculator_model_dir, tmp_path):
    cfg = _cfg(
        calculator_model_dir,
        "fixtures_verifiers:tool_env",
        "rollout.max_new_tokens=16",
        "pipeline.mode='periodic'",
        "pipeline.placement='separate'",
        "pipeline.num_workers=1",
    )
    summary = train(build_run(cfg), tmp_path)
    lines = _lines(tmp_path)
    assert [r["iteration"] for r in lines] == [0, 1]
    assert all(_finite(r) for r in lines) and _finite(summary)
    assert sum(r["tool_calls"] for r in lines) > 0  # the policy called verifiers' tool server
    assert all(r["reward_errors"] == 0 for r in lines)
    assert any(0.0 < r["env_token_frac"] < 1.0 for r in lines)
    for r in lines:
        assert r["trained_token_frac"] + r["env_token_frac"] == pytest.approx(1.0)
        assert r["policy_version"] == r["iteration"]  # periodic: on-policy


def test_the_taskset_is_the_prompt_stream_with_its_last_tasks_held_out(model_dir):
    cfg = _cfg(model_dir, "fixtures_verifiers:single_turn")
    task = make_task(cfg)
    from fixtures_verifiers import ROWS

    held = [e.metadata["verifiers_task"]["question"] for e in task.heldout()]
    assert held == [row["question"] for row in ROWS[-2:]]
    first_epoch = [e.metadata["verifiers_task"]["question"] for e in islice(task.train_iter(), 6)]
    assert sorted(first_epoch) == sorted(row["question"] for row in ROWS[:-2])


@pytest.mark.parametrize(
    ("factory", "extra", "reason"),
    [
        ("no_such_module:load", [], "cannot import module 'no_such_module'"),
        ("fixtures_verifiers:nothing", [], "has no 'nothing'"),
        ("fixtures_verifiers:not_an_env", [], "returned str, not a verifiers.v1.Env"),
        ("fixtures_verifiers:single_turn", ["data.num_heldout=8"], "leaves none to train on"),
    ],
)
def test_a_factory_that_gives_no_environment_stops_the_run_before_it_starts(
    model_dir, factory, extra, reason
):
    with pytest.raises((ConfigError, ValueError), match=reason):
        build_run(_cfg(model_dir, factory, *extra))


def test_a_warm_start_on_a_verifiers_taskset_is_refused(model_dir):
    with pytest.raises(ConfigError, match="has none: warm-start with the config of a cadence"):
        sft_segments(_cfg(model_dir, "fixtures_verifiers:single_turn"))
