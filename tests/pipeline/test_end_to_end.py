import json
import math

import pytest
import torch
from safetensors.torch import load_file

from cadence.builder import build_run, train
from cadence.cli import main
from cadence.config import load_config
from cadence.dataplane import StaleRowError
from cadence.engine import ScriptedEngine
from cadence.metrics import MemorySink
from cadence.pipeline.loop import within_staleness

METRIC_FIELDS = [
    "iteration",
    "reward_mean",
    "accuracy",
    "kl",
    "entropy",
    "num_tokens",
    "tpspd",
    "gen_s",
    "train_s",
    "wall_s",
    "tokens_computed",
    "forward_passes_per_microbatch",
    "frozen_copies_mb",
]
SUMMARY_FIELDS = [
    "accuracy_before",
    "accuracy_after",
    "accuracy_before_stderr",
    "accuracy_after_stderr",
    "num_heldout",
    "tpspd_overall",
    "wall_s",
    "mode",
]


def _overrides(model_dir):
    return [
        f"model.path='{model_dir}'",
        "train.iterations=2",
        "train.prompts_per_iteration=4",
        "rollout.group_size=4",
        "rollout.max_new_tokens=12",
        "data.num_heldout=8",
        "algo.kl_coef=0.05",
        "train.lr=1e-3",
        "metrics.progress=false",
        "reward.function='fixtures_rewards:even_length'",
    ]


@pytest.mark.slow
def test_two_iterations_change_the_parameters_and_write_every_output(model_dir, tmp_path):
    cfg = load_config(None, _overrides(model_dir))
    memory = MemorySink()
    summary = train(build_run(cfg), tmp_path, extra_sinks=[memory])
    before = load_file(model_dir / "model.safetensors")
    after = load_file(tmp_path / "final" / "model.safetensors")
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 1e-5
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in lines] == [0, 1] == [r["iteration"] for r in memory.records]
    for record in lines:
        for field in METRIC_FIELDS:
            assert field in record and math.isfinite(record[field]), field
        assert record["num_tokens"] > 0 and record["tpspd"] > 0
    for field in SUMMARY_FIELDS:
        assert field in summary
    assert json.loads((tmp_path / "summary.json").read_text())["mode"] == "sync"
    assert (tmp_path / "config.toml").is_file() and (tmp_path / "final" / "config.json").is_file()
    assert summary["num_heldout"] == 8  # stderr of p on 8 problems: sqrt(p(1-p)/8)
    p = summary["accuracy_after"]
    assert math.isclose(summary["accuracy_after_stderr"], math.sqrt(p * (1 - p) / 8))
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_cli_train_runs_and_eval_reads_the_result(model_dir, tmp_path, capsys):
    args = ["train", "configs/default.toml", "--out", str(tmp_path / "run")]
    for o in _overrides(model_dir):
        args += ["--set", o]
    assert main(args) == 0
    assert "held-out accuracy after RL" in capsys.readouterr().out
    assert main(["eval", str(tmp_path / "run" / "final"), "--set", "data.num_heldout=4"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["num_prompts"] == 4 and 0.0 <= result["accuracy"] <= 1.0
    # a distillation config's teacher is evaluated beside the student, on the same problems
    teacher = ["--set", f"distill.teacher='{tmp_path / 'run' / 'final'}'"]
    assert main(["eval", str(model_dir), "--set", "data.num_heldout=4", *teacher]) == 0
    both = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"model": str(tmp_path / "run" / "final")} | both["teachers"][result["model"]] == result


def test_groups_of_another_version_are_refused(model_dir):
    cfg = load_config(None, _overrides(model_dir))
    run = build_run(cfg)
    run.source.worker.engine = ScriptedEngine(lambda ids, seed: [5, 6])
    run.source.start_iteration(iteration=0, version=3)  # a producer from the future
    with pytest.raises(StaleRowError, match="policy_version 3"):  # on-policy: refused
        list(within_staleness(run.source.groups(), 0, 0, [], []))
    run.source.start_iteration(iteration=1, version=0)
    assert len(list(within_staleness(run.source.groups(), 0, 0, [], []))) == 4


@pytest.mark.parametrize(
    "args, needle",
    [
        (["train", "configs/default.toml", "--set", "train.iterationz=1"], "train.iterationz"),
        (["train", "configs/default.toml", "--set", "pipeline.mode=fast"], "pipeline.mode"),
        (["train", "no/such/config.toml"], "does not exist"),
        (["train", "configs/default.toml", "--set", "model.path='no/such/dir'"], "no/such/dir"),
    ],
)
def test_bad_input_exits_2_and_names_the_culprit(args, needle, capsys, tmp_path):
    assert main([*args, "--out", str(tmp_path)]) == 2
    assert needle in capsys.readouterr().err


def test_malformed_jsonl_line_is_reported_with_its_line_number(model_dir, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    good = json.dumps({"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"})
    data.write_text(f"{good}\n{good}\nnot json\n")
    args = ["eval", str(model_dir), "--set", "data.task='gsm8k'", "--set", f"data.path='{data}'"]
    assert main(args) == 2
    assert f"{data}:3" in capsys.readouterr().err


def test_summary_reports_cpu_as_one_device():
    from cadence.metrics import tpspd

    assert tpspd(1000, 2.0) == 500.0 and tpspd(1000, 2.0, num_devices=4) == 125.0
    assert torch.get_num_threads() >= 1


@pytest.mark.slow
def test_tensorboard_option_writes_event_files(model_dir, tmp_path):
    cfg = load_config(None, [*_overrides(model_dir), "metrics.tensorboard=true"])
    train(build_run(cfg), tmp_path, evaluate=False)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_bench_writes_one_row_per_mode_with_the_named_fields(model_dir, tmp_path, capsys):
    args = [
        "bench",
        "--config",
        "configs/default.toml",
        "--modes",
        "sync-colocated,periodic",
        "--repeats",
        "1",
        "--iterations",
        "1",
        "--out",
        str(tmp_path),
    ]
    for o in _overrides(model_dir):
        args += ["--set", o]
    assert main(args) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())
    assert [r["name"] for r in rows] == ["sync-colocated", "periodic"]
    for r in rows:
        for field in [
            "name",
            "mode",
            "placement",
            "tpspd",
            "wall_s",
            "gen_busy_s",
            "train_busy_s",
            "pipeline_efficiency",
        ]:
            assert field in r, field
        assert r["tpspd"] > 0
    assert "| periodic | periodic | separate |" in (tmp_path / "bench.md").read_text()
    assert main(["bench", "--modes", "fast", "--out", str(tmp_path)]) == 2
    assert "allowed: sync-colocated, sync, periodic" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_shared_prompt_suite_reports_tokens_and_times(model_dir, tmp_path):
    args = ["bench", "--suite", "shared-prompt", "--repeats", "1", "--out", str(tmp_path)]
    for o in [*_overrides(model_dir), "train.prompts_per_iteration=2"]:
        args += ["--set", o]
    assert main(args) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())
    assert [(r["workload"], r["layout"]) for r in rows] == [
        (w, v) for w in ("default", "long-prompt") for v in ("off", "dense", "prefix")
    ]
    for r in rows:
        assert r["time_s"] > 0 and r["tokens_computed"] > 0
        if r["workload"] == "long-prompt" and r["layout"] != "off":
            # G(P + R) / (P + G R) with P = 256, R = 64, G = 8, exactly
            assert r["tokens_ratio"] == pytest.approx(8 * (256 + 64) / (256 + 8 * 64), rel=1e-12)
    assert "| long-prompt | prefix |" in (tmp_path / "bench.md").read_text()


@pytest.mark.slow
def test_bench_engine_suite_compares_the_engines_on_the_same_work(model_dir, tmp_path):
    from cadence.bench import bench_engine

    rows = bench_engine(
        tmp_path,
        repeats=1,
        model_dir=str(model_dir),
        num_prompts=3,
        group_size=2,
        max_num_seqs=4,
        engines=("static", "generate", "continuous"),  # vllm: tests/pipeline/test_vllm_pipeline
    )
    assert [(r["workload"], r["engine"]) for r in rows] == [
        (w, e) for w in ("long-tail", "uniform") for e in ("static", "generate", "continuous")
    ]
    by = {(r["workload"], r["engine"]): r for r in rows}
    for w in ("long-tail", "uniform"):  # the same seeded samples, so the same tokens
        assert by[w, "static"]["new_tokens"] == by[w, "continuous"]["new_tokens"]
        assert by[w, "static"]["vs_static"] == 1.0
    assert by["uniform", "generate"]["new_tokens"] == 3 * 2 * 64
    assert all(r["new_tokens_per_s"] > 0 and r["first_group_s"] > 0 for r in rows)
    assert "| long-tail | continuous |" in (tmp_path / "bench.md").read_text()


@pytest.mark.slow
def test_study_offpolicy_writes_a_row_per_cell_and_resumes(model_dir, tmp_path, capsys):
    args = ["study", "offpolicy", "--losses", "grpo,online_dpo", "--staleness", "0,1"]
    args += ["--out", str(tmp_path), "--iterations", "2"]
    for o in [*_overrides(model_dir), "data.num_heldout=2", "pipeline.num_workers=1"]:
        args += ["--set", o]
    assert main(args) == 0
    rows = json.loads((tmp_path / "study.json").read_text())
    assert [(r["loss"], r["staleness"]) for r in rows] == [
        ("grpo", 0),
        ("grpo", 1),
        ("online_dpo", 0),
        ("online_dpo", 1),
    ]
    for r in rows:
        assert 0 <= r["accuracy"] <= 1 and r["kl"] >= 0 and r["iterations"] == 2
    assert (tmp_path / "study.png").stat().st_size > 0
    staleness = [
        json.loads(line)["staleness_max"]
        for line in (tmp_path / "runs" / "grpo-N1" / "metrics.jsonl").read_text().splitlines()
    ]
    assert staleness == [0, 1]
    capsys.readouterr()
    assert main(args) == 0  # a second call keeps the finished cells
    assert capsys.readouterr().out.count("done earlier, kept") == 4
    assert main(["study", "offpolicy", "--losses", "dpo", "--out", str(tmp_path)]) == 2
