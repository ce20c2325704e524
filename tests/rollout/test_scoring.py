"""Scoring in the rollout worker and held-out evaluation goes through the reward runner: calls
overlap with one another and with generation, and the results, their order and a whole training
run are those of one call at a time."""

from __future__ import annotations

import json
import threading
import time

import pytest
from safetensors.torch import load_file

from cadence.cli import main
from cadence.engine import SamplingParams, ScriptedEngine
from cadence.rewards import RewardRunner
from cadence.rollout import RolloutWorker, evaluate
from cadence.types import Prompt


def _tokenize(text: str, add_special_tokens: bool = False) -> dict:
    return {"input_ids": [len(text)]}


def _worker(reward, group_size: int = 2) -> RolloutWorker:
    return RolloutWorker(
        ScriptedEngine(lambda ids, seed: [seed % 7 + 1, 2]),
        tokenizer=_tokenize,
        reward=reward,
        sampling=SamplingParams(max_new_tokens=4),
        group_size=group_size,
        run_seed=0,
    )


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(f"u{i}", f"question {i}", str(i), i) for i in range(n)]


def test_a_worker_scores_a_1_s_reward_concurrently_and_returns_groups_in_prompt_order():
    # Before: 4 prompts x 8 samples of a 1-s reward took 32 s in a colocated worker.
    def sleeps(prompt: str, completion: str, answer: str) -> float:
        time.sleep(1.0)
        return float(answer) + len(completion) / 100

    worker = _worker(RewardRunner(sleeps, concurrency=16), group_size=8)
    t0 = time.perf_counter()
    groups = worker.rollout(_prompts(4), iteration=0, version=0)
    assert time.perf_counter() - t0 < 8.0  # 2 waves of 16 take about 2 s
    assert [g.prompt.index for g in groups] == [0, 1, 2, 3]
    for g in groups:
        assert [c.reward for c in g.completions] == [
            int(g.prompt.answer) + len(c.text) / 100 for c in g.completions
        ]
    assert not worker.busy


def test_a_group_is_scored_while_the_engine_decodes_the_next_and_handed_out_in_finishing_order():
    gate = threading.Event()

    def reward(prompt: str, completion: str, answer: str) -> float:
        if answer == "slow":
            gate.wait(10)
        return 1.0 if answer == "slow" else 2.0

    worker = _worker(reward)
    try:
        worker.submit("a", [Prompt("u0", "first", "slow", 0)], 0, 0)
        assert worker.poll() == []  # generated; its scores wait on the gate
        assert worker.busy and not worker.task_done("a")
        worker.submit("b", [Prompt("u1", "second", "fast", 1)], 0, 0)
        assert worker.poll() == []  # generated while "a" is scored; "a" goes out first
        assert worker.engine.engine.num_calls == 2
    finally:
        gate.set()
    out = []
    while worker.busy:
        out += worker.poll()
    assert [task for task, _ in out] == ["a", "b"]
    assert [[c.reward for c in g.completions] for _, g in out] == [[1.0, 1.0], [2.0, 2.0]]
    assert worker.task_done("a") and worker.task_done("b")


def test_held_out_answers_are_scored_at_once():
    # Before: one call after another, 24 x 0.5 s = 12 s.
    def sleeps(prompt: str, completion: str, answer: str) -> float:
        time.sleep(0.5)
        return 1.0 if answer in ("0", "1", "2") else 0.25 if answer == "3" else 0.0

    engine = ScriptedEngine(lambda ids, seed: [1])
    t0 = time.perf_counter()
    reward = RewardRunner(sleeps, concurrency=12)
    worker = RolloutWorker(engine, _tokenize, reward, SamplingParams(max_new_tokens=2), 1, 0)
    result = evaluate(worker, _prompts(24))
    assert time.perf_counter() - t0 < 6.0  # 2 waves of 0.5 s
    assert result["accuracy"] == pytest.approx(3 / 24, abs=1e-12)  # partial credit is not right
    assert result["score_mean"] == pytest.approx((3 + 0.25) / 24, abs=1e-12)


def _run(model_dir, out, reward: str, concurrency: int, placement: str) -> list[dict]:
    sets = [
        f"model.path='{model_dir}'",
        "train.iterations=2",
        "train.prompts_per_iteration=4",
        "rollout.group_size=4",
        "rollout.max_new_tokens=12",
        "data.num_heldout=8",
        "train.eval_every=1",
        "train.lr=1e-3",
        "metrics.progress=false",
        f"reward.function='fixtures_rewards:{reward}'",
        f"reward.concurrency={concurrency}",
        f"pipeline.placement='{placement}'",
    ]
    args = ["train", "configs/default.toml", "--out", str(out)]
    assert main([*args, *(a for s in sets for a in ("--set", s))]) == 0
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("placement", "reward"),
    [
        ("colocated", "jittery_even_length"),
        ("colocated", "async_jittery_even_length"),
        ("separate", "jittery_even_length"),
    ],
)
def test_a_run_at_concurrency_8_equals_the_run_at_concurrency_1(
    model_dir, tmp_path, placement, reward
):
    serial = _run(model_dir, tmp_path / "serial", "jittery_even_length", 1, placement)
    concurrent = _run(model_dir, tmp_path / "concurrent", reward, 8, placement)
    figures = ("reward_mean", "reward_errors", "loss", "heldout_accuracy", "kl")
    assert [[r[k] for k in figures] for r in concurrent] == [
        [r[k] for k in figures] for r in serial
    ]
    assert serial[0]["reward_mean"] not in (0.0, 1.0)  # the reward did spread
    a = load_file(tmp_path / "serial" / "final" / "model.safetensors")
    b = load_file(tmp_path / "concurrent" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
