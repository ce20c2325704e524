"""The race: both tools for the same budget, every snapshot scored by one evaluator, the time to
the lower final accuracy and the ratio computed; with a teacher both distil from it, the teacher
is scored too and the time to 90% of it reported."""

import json
import math

import pytest

from cadence.bench.race import (
    STEP_CAP,
    Snapshot,
    bench_race,
    race_config,
    seconds_to_reach,
    seconds_to_teacher,
)
from cadence.bench.trl_setup import run_trl
from cadence.config import ConfigError
from runs import peer_workload


def workload(model_dir):
    """`--suite trl`'s tiny workload, without the reference pass."""
    return peer_workload(model_dir, kl=False)


def test_the_time_to_target_is_the_first_snapshot_after_the_start_that_reaches_it():
    curve = [
        Snapshot(0, 0.0, "base", accuracy=0.5),  # the base model: not a time the tool needed
        Snapshot(5, 10.0, "a", accuracy=0.4),
        Snapshot(10, 20.0, "b", accuracy=0.6),
        Snapshot(15, 30.0, "c", accuracy=0.55),
    ]
    assert seconds_to_reach(curve, 0.55) == 20.0
    assert seconds_to_reach(curve, 0.3) == 10.0
    with pytest.raises(StopIteration):
        seconds_to_reach(curve, 0.7)
    assert seconds_to_teacher(curve, 0.54) == 20.0
    assert seconds_to_teacher(curve, 0.72) is None


def test_the_race_config_is_stopped_by_time_and_refuses_what_trl_cannot_run(model_dir):
    cfg = race_config(None, workload(model_dir), 2.5, 0)
    assert cfg.train.max_minutes == 2.5 and cfg.train.iterations == STEP_CAP
    assert cfg.train.checkpoint_every == 0 and cfg.train.eval_every == 0
    assert race_config(None, workload(model_dir), 1, 7).train.iterations == 7
    with pytest.raises(ConfigError, match="--minutes"):
        race_config(None, workload(model_dir), 0, 0)
    with pytest.raises(ConfigError, match=r"train\.mini_batches"):
        race_config(None, [*workload(model_dir), "train.mini_batches=2"], 1, 0)
    # TRL's DistillationTrainer: one teacher, no reward term, no reference
    teacher = f"distill.teacher='{model_dir}'"
    distilling = race_config(None, [*workload(model_dir), teacher], 1, 0)
    with pytest.raises(ConfigError, match="--suite race"):  # suite 'trl' compares GRPO steps
        run_trl(distilling, model_dir)
    for extra, named in (
        ("distill.reward_coef=1", r"distill\.reward_coef"),
        ("algo.kl_coef=0.05", r"algo\.kl_coef"),
        ("distill.coef=2", r"distill\.coef"),
    ):
        with pytest.raises(ConfigError, match=named):
            race_config(None, [*workload(model_dir), teacher, extra], 1, 0)


@pytest.mark.slow
def test_both_tools_race_for_the_budget_and_every_snapshot_is_scored(model_dir, tmp_path):
    # both tools distil from a teacher (the model itself), whose accuracy the report gives
    sets = [*workload(model_dir), "data.num_heldout=8", f"distill.teacher='{model_dir}'"]
    budget_min, cap = 0.01, 40  # 0.6 s each: stopped by time, long before the cap
    report = bench_race(None, sets, tmp_path, budget_min, every=2, iterations=cap, trl_threads=1)
    assert json.loads((tmp_path / "race.json").read_text()) == report
    for tool in ("cadence", "trl"):
        curve = report["curves"][tool]
        assert curve[0]["step"] == 0 and curve[0]["seconds"] == 0.0  # the one base model
        assert curve[0]["accuracy"] == report["curves"]["cadence"][0]["accuracy"]
        steps = [p["step"] for p in curve]
        assert len(curve) >= 2 and steps == sorted(set(steps)) and steps[-1] < cap, steps
        assert all(s % 2 == 0 for s in steps[1:-1])  # every 2 steps, then the last one
        seconds = [p["seconds"] for p in curve]
        assert seconds == sorted(seconds) and seconds[-1] > 0
        for p in curve:
            assert 0.0 <= p["accuracy"] <= 1.0
            assert p["stderr"] == pytest.approx(math.sqrt(p["accuracy"] * (1 - p["accuracy"]) / 8))
        assert report["final_accuracy"][tool] == curve[-1]["accuracy"]
    target = min(report["final_accuracy"].values())
    assert report["target_accuracy"] == target
    reach = report["seconds_to_target"]
    assert reach["cadence"] > 0 and reach["trl"] > 0
    assert report["ratio_trl_to_cadence"] == pytest.approx(reach["trl"] / reach["cadence"])
    assert (tmp_path / "race.png").stat().st_size > 0
    md = (tmp_path / "race.md").read_text()
    assert "| cadence |" in md and "| trl |" in md and "x cadence's training seconds" in md
    # each tool ran in a process of its own, TRL with the threads it was given
    assert report["threads"] == {"cadence": 2, "trl": 1}
    assert "each tool in a process of its own, torch threads cadence 2, trl 1" in md
    base = report["curves"]["cadence"][0]["accuracy"]
    assert report["teachers"] == {str(model_dir): pytest.approx(base)}
    assert report["trl_trainer"] == "DistillationTrainer"
    assert report["teacher_target_accuracy"] == pytest.approx(0.9 * base)
    for tool, seconds in report["seconds_to_teacher_target"].items():
        reached = [p for p in report["curves"][tool][1:] if p["accuracy"] >= 0.9 * base - 1e-12]
        assert seconds == (reached[0]["seconds"] if reached else None)
    assert f"Both tools distil from {model_dir} (held-out {base:.3f})" in md


def test_a_race_over_seeds_runs_one_race_a_seed_sums_them_up_and_resumes(
    model_dir, tmp_path, monkeypatch, capsys
):
    # what each seed's race returned is made up here (a real race is the test above): the claim
    # is the orchestration: train.seed per race, one folder a seed, the summary, the resumption
    from cadence.bench import race as race_module
    from cadence.cli import main

    raced = []

    def fake_race(config, overrides, out, **race):
        seed = int(overrides[-1].removeprefix("train.seed="))
        raced.append((seed, race["minutes"], race["trl_threads"]))
        cadence_s, trl_s = 10.0 * (seed + 1), 30.0 + seed
        report = {
            "final_accuracy": {"cadence": 0.5 + seed / 100, "trl": 0.4},
            "target_accuracy": 0.4,
            "seconds_to_target": {"cadence": cadence_s, "trl": trl_s},
            "ratio_trl_to_cadence": trl_s / cadence_s,
            "curves": {"cadence": [{"step": 9 + seed}], "trl": [{"step": 3}]},
            "threads": {"cadence": 2, "trl": race["trl_threads"]},
        }
        out.mkdir(parents=True)
        (out / "race.json").write_text(json.dumps(report))
        return report

    monkeypatch.setattr(race_module, "bench_race", fake_race)
    args = ["bench", "--suite", "race", "--out", str(tmp_path), "--minutes", "3"]
    args += ["--trl-threads", "2", "--set", f"model.path='{model_dir}'"]
    assert main([*args, "--seeds", "0,1,2"]) == 0
    assert raced == [(0, 3.0, 2), (1, 3.0, 2), (2, 3.0, 2)]
    summary = json.loads((tmp_path / "races.json").read_text())
    assert [row["seed"] for row in summary["seeds"]] == [0, 1, 2]
    assert summary["ratio_trl_to_cadence"] == pytest.approx(
        {"min": 32 / 30, "median": 31 / 20, "max": 3.0}
    )
    md = (tmp_path / "races.md").read_text()
    assert "| 1 | 10 / 3 | 0.510 / 0.400 | 0.400 | 20 / 31 | 1.55x |" in md
    assert "1.07x to 3.00x" in md and "median 1.55x" in md and md in capsys.readouterr().out
    # seeds raced already are read back; only the new one runs
    assert main([*args, "--seeds", "2,0,3"]) == 0
    assert [seed for seed, *_ in raced] == [0, 1, 2, 3]
    summary = json.loads((tmp_path / "races.json").read_text())
    assert [row["seed"] for row in summary["seeds"]] == [2, 0, 3]
    for bad in ("0,0", "a", ""):
        assert main([*args, "--seeds", bad]) == 2
    assert main(["bench", "--suite", "modes", "--out", str(tmp_path), "--seeds", "0"]) == 2
