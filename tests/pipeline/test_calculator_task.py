"""The calculator task end to end through the commands: a warm start on demonstrations with
calls, then RL with the tool environment in worker processes, every episode figure reported."""

import json
from pathlib import Path

import pytest

from cadence.cli import main

pytestmark = pytest.mark.slow

CONFIG = str(Path(__file__).parents[2] / "configs" / "calculator.toml")


def test_the_calculator_task_trains_end_to_end(calculator_model_dir, tmp_path):
    sft = tmp_path / "sft"
    base = calculator_model_dir.parent / "base"
    overrides = ["--set", "metrics.progress=false"]
    sft_args = ["--set", f"sft.base='{base}'", "--set", f"sft.out='{sft}'", "--set", "sft.steps=3"]
    assert main(["sft", CONFIG, *sft_args, "--set", "sft.batch_size=4", *overrides]) == 0
    assert json.loads((sft / "sft.json").read_text())["steps"] == 3
    out = tmp_path / "run"
    train = [
        f"model.path='{calculator_model_dir}'",  # the longer warm start: it calls its tool
        "train.iterations=3",
        "train.prompts_per_iteration=4",
        "train.micro_batch_groups=2",
        "rollout.group_size=4",
        "data.num_heldout=8",
        "data.max_operand=20",  # the demonstrations' range
        "pipeline.mode='periodic'",
        "pipeline.placement='separate'",
        "pipeline.num_workers=1",
        "train.checkpoint_every=0",
    ]
    sets = [x for kv in train for x in ("--set", kv)]
    assert main(["train", CONFIG, "--out", str(out), *sets, *overrides]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3
    for r in records:
        assert r["turns_mean"] >= 1 and r["tool_calls"] >= 0 and r["env_s"] >= 0
        assert r["tool_errors"] >= 0 and r["tool_timeouts"] == 0
        assert r["trained_token_frac"] + r["env_token_frac"] == pytest.approx(1.0)
    assert sum(r["tool_calls"] for r in records) > 0  # the policy did call its calculator
    summary = json.loads((out / "summary.json").read_text())
    assert 0 <= summary["accuracy_after"] <= 1
    assert (out / "timeline.png").is_file() and (out / "curves.png").is_file()
    trace = json.loads((out / "trace.json").read_text())["traceEvents"]
    assert any(e.get("name") == "tool" for e in trace)
