"""Reward processes beside a colocated rollout worker (`reward.stage = 'separate'`, placement
colocated; the default with vLLM on a GPU): each group is scored in another process, off the
engine's thread, exactly as the worker scores it itself; a run so scored makes the update of the
run scored in the worker; a reward process that dies fails every call loudly; none is left
behind."""

from __future__ import annotations

import multiprocessing
import os

import pytest
from safetensors.torch import load_file

from cadence.backend import RewardProcesses, WorkerDied
from cadence.backend.reward_stage import GRACE_S, work_limit_s
from cadence.engine import SamplingParams, ScriptedEngine
from cadence.rewards import RewardCall, RewardRunner, RewardSpec
from cadence.rollout import RolloutWorker
from cadence.types import Prompt
from fixtures_rewards import flaky
from runs import pids_alive, run_config, train_run

pytestmark = pytest.mark.slow


def _worker(reward) -> RolloutWorker:
    return RolloutWorker(
        ScriptedEngine(lambda ids, seed: [1] * (seed % 7 + 1), decode=lambda ids: "x" * len(ids)),
        tokenizer=lambda text, add_special_tokens=False: {"input_ids": [len(text)]},
        reward=reward,
        sampling=SamplingParams(max_new_tokens=8),
        group_size=4,
        run_seed=0,
    )


def test_groups_scored_in_reward_processes_equal_those_the_worker_scores_itself():
    prompts = [Prompt(f"u{i}", f"question {i}", str(i), i) for i in range(6)]
    procs = RewardProcesses(RewardSpec("rule", "fixtures_rewards:flaky"), 2)
    pids = [p.process.pid for p in procs.processes.procs]
    worker = _worker(procs)
    try:
        groups = worker.rollout(prompts, iteration=0, version=0)
    finally:
        worker.close()  # closes the reward processes it scored in
    own = _worker(RewardRunner(flaky)).rollout(prompts, iteration=0, version=0)
    scores = [[(c.reward, c.reward_error) for c in g.completions] for g in groups]
    assert scores == [[(c.reward, c.reward_error) for c in g.completions] for g in own]
    assert any(e for g in scores for _, e in g) and any(r == 1.0 for g in scores for r, _ in g)
    assert not pids_alive(pids) and os.getpid() not in pids


def test_a_reward_process_that_dies_fails_the_calls_in_flight_and_every_later_one():
    procs = RewardProcesses(RewardSpec("rule", "fixtures_rewards:exit_in_reward_worker"), 1)
    pid = procs.processes.procs[0].process.pid
    calls = [RewardCall("p", "x" * n, "1") for n in range(4)]  # the third call exits
    try:
        with pytest.raises(WorkerDied, match=r"reward worker 0 \(pid \d+\) exited with code 3"):
            procs.score(calls)
        with pytest.raises(WorkerDied):
            procs.score(calls[:1])
    finally:
        procs.close()
    assert not pids_alive([pid]) and not multiprocessing.active_children()


def test_a_colocated_run_scored_in_reward_processes_makes_the_update_scored_in_the_worker(
    model_dir, tmp_path
):
    # colocated, the rollout worker scored each group between decode steps of its engine; an
    # in-process vLLM engine waits on it (one GIL)
    runs = {}
    for stage in ("worker", "separate"):
        cfg = run_config(model_dir, f"reward.stage='{stage}'", "train.iterations=2")
        trained = train_run(cfg, tmp_path / stage, evaluate=False)
        reward = trained.run.source.worker.reward
        assert isinstance(reward, RewardProcesses) == (stage == "separate")
        assert not pids_alive(trained.pids)
        runs[stage] = trained.records
    assert runs["separate"][0]["reward_mean"] not in (0.0, 1.0)  # the reward did spread
    figures = ("reward_mean", "reward_errors", "loss", "kl")
    assert [[r[k] for k in figures] for r in runs["separate"]] == [
        [r[k] for k in figures] for r in runs["worker"]
    ]
    a = load_file(tmp_path / "worker" / "final" / "model.safetensors")
    b = load_file(tmp_path / "separate" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_a_message_whose_calls_may_take_longer_than_the_silence_limit_is_waited_for():
    # 6 calls of 0.5 s one at a time take 3 s: with the limit fixed at 1 s the healthy worker
    # was called hung; the limit now follows the work sent (6 x the 2 s deadline + grace)
    spec = RewardSpec(
        "rule", "fixtures_rewards:half_second_even_length", timeout_s=2.0, concurrency=1
    )
    procs = RewardProcesses(spec, 1, timeout_s=1.0)
    try:
        results = procs.score([RewardCall("p", "x" * n, "1") for n in range(6)])
    finally:
        procs.close()
    assert [r.value for r in results] == [float(n % 2 == 0) for n in range(6)]
    assert work_limit_s(spec, 6, 1.0) == 6 * 2.0 + GRACE_S
    assert work_limit_s(RewardSpec("rule", timeout_s=10.0), 32, 300.0) == 320.0 + GRACE_S
    assert work_limit_s(RewardSpec("rule"), 32, 300.0) == 300.0  # no deadline: the floor
