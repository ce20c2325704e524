import math
import os
from dataclasses import dataclass

import pytest

from cadence.algo import AlgoParams
from cadence.builder import algo_params, build_run, train
from cadence.builder import params as builder_params
from cadence.config import load_config

CAP = {"max_policy_tokens": 48}  # the default rollout.max_new_tokens, single-turn


def test_algo_params_carry_the_loss_and_shaping_keys():
    cfg = load_config(None, ["algo.loss='online_dpo'", "algo.dpo_beta=0.3", "algo.dpo_loss='ipo'"])
    assert algo_params(cfg) == AlgoParams(loss="online_dpo", dpo_beta=0.3, dpo_loss="ipo", **CAP)
    algo = algo_params(load_config(None, ["algo.tis_cap=2.5", "algo.clip_high=0.28"]))
    assert algo == AlgoParams(clip_high=0.28, tis_cap=2.5, **CAP)
    # the older key is the newer mode with the same number
    newer = ["algo.rollout_correction='token_truncate'", "algo.correction_clip_max=2.5"]
    assert algo == algo_params(load_config(None, [*newer, "algo.clip_high=0.28"]))
    correction = [
        "algo.rollout_correction='icepop'",
        "algo.correction_clip_min=0.5",
        "algo.correction_clip_max=5",
        "algo.correction_proximal='bypass'",
    ]
    algo = algo_params(load_config(None, correction))
    assert algo == AlgoParams(
        rollout_correction="icepop",
        correction_clip_min=0.5,
        correction_clip_max=5.0,
        correction_proximal="bypass",
        **CAP,
    )
    shaping = [
        "reward.overlong_buffer=8",
        "reward.overlong_penalty=0.5",
        "algo.mask_truncated=true",
    ]
    algo = algo_params(load_config(None, shaping))
    assert algo == AlgoParams(overlong_buffer=8, overlong_penalty=0.5, mask_truncated=True, **CAP)


def test_every_field_a_translation_copies_is_fed_by_a_key_or_given():
    # each parameter object the builder makes by name is complete on the default config, every
    # field from a key of the same name or given by hand (from_sections refuses a field neither
    # feeds), whatever the mode
    for overrides in ([], ["pipeline.placement='separate'", "pipeline.mode='offpolicy'"]):
        cfg = load_config(None, overrides)
        builder_params.algo_params(cfg)
        builder_params.learner_params(cfg)
        builder_params.producer_params(cfg)
        builder_params.loop_params(cfg)
        builder_params.reward_spec(cfg)

    @dataclass(frozen=True)
    class Probe:
        lr: float  # train.lr
        made_up: int = 3  # no key feeds it

    train_section = load_config(None, []).train
    with pytest.raises(TypeError, match=r"Probe: .* feeds \['made_up'\]"):
        builder_params.from_sections(Probe, train_section)
    assert builder_params.from_sections(Probe, train_section, made_up=4).made_up == 4


def test_a_thread_count_of_zero_means_omp_num_threads_else_the_cores_this_process_may_use(
    monkeypatch,
):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert builder_params.all_threads() == cores
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # as under `taskset -c 0`
    assert builder_params.all_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # as torchrun or a batch scheduler sets it
    assert builder_params.all_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "not a number")
    assert builder_params.all_threads() == 1
    # the learner beside its workers: the cores they leave it, at most OMP_NUM_THREADS
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    separate = ["pipeline.placement='separate'", "pipeline.num_workers=2"]
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert builder_params.learner_threads(load_config(None, separate)) == 4
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert builder_params.learner_threads(load_config(None, separate)) == 6
    assert (
        builder_params.learner_threads(load_config(None, [*separate, "pipeline.learner_threads=7"]))
        == 7
    )


def test_online_dpo_run_builds_a_reference_without_kl_and_trains(model_dir, tmp_path):
    overrides = [
        f"model.path='{model_dir}'",
        "algo.loss='online_dpo'",
        "train.iterations=1",
        "train.prompts_per_iteration=2",
        "rollout.group_size=4",
        "rollout.max_new_tokens=8",
        "data.num_heldout=2",
        "metrics.progress=false",
        "reward.function='fixtures_rewards:even_length'",
    ]
    cfg = load_config(None, overrides)
    assert cfg.algo.kl_coef == 0.0
    run = build_run(cfg)
    assert run.trainer.forward.ref_model is not None
    summary = train(run, tmp_path, evaluate=False)
    assert math.isfinite(summary["kl_last"])


def test_periodic_with_several_steps_releases_groups_a_step_at_a_time():
    from cadence.builder.run import step_groups

    def groups(*sets):
        base = ["pipeline.placement='separate'", "train.prompts_per_iteration=6"]
        return step_groups(load_config(None, [*base, *sets]))

    assert groups("pipeline.mode='periodic'", "train.mini_batches=4") == 2  # 6 prompts / 4 steps
    assert groups("pipeline.mode='periodic'", "train.mini_batches=1") == 0  # one step sums all
    assert groups("pipeline.mode='sync'", "train.mini_batches=4") == 0  # sync sorts the batch
    assert groups("pipeline.mode='offpolicy'", "train.mini_batches=4") == 0
    # periodic with dynamic sampling and several steps is refused (tests/test_config.py)
