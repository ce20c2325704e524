"""The TRL peer: same workload for both tools, figures defined alike, bad workloads refused."""

import json

import pytest

from cadence.bench import trl_peer, trl_setup
from cadence.cli import main
from cadence.config import ConfigError, load_config
from cadence.models import load_model
from runs import peer_workload


def workload(model_dir):
    return peer_workload(model_dir)


def cli_args(model_dir, out, *extra):
    """The bench command on the tiny workload; `extra` comes last, so its --set wins."""
    args = ["bench", "--repeats", "1", "--iterations", "1", "--out", str(out)]
    for o in workload(model_dir):
        args += ["--set", o]
    return [*args, *extra]


@pytest.mark.slow
def test_both_tools_report_positive_figures_and_the_same_settings(model_dir, tmp_path):
    assert main(cli_args(model_dir, tmp_path, "--suite", "trl")) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["tool"]: r for r in report["rows"]}
    assert set(rows) == {"cadence", "trl"}
    for row in rows.values():
        for f in ["tpspd", "wall_s", "num_tokens", "gen_busy_s", "train_busy_s"]:
            assert row[f] > 0, (row["tool"], f)
        assert row["tpspd"] == pytest.approx(row["num_tokens"] / row["wall_s"], rel=1e-9)
    # what each tool reports it ran with (cadence's config, TRL's trainer.args and state) agrees
    settings = report["settings"]
    for key in trl_setup.SHARED_SETTINGS:
        assert settings["cadence"][key] == settings["trl"][key], key
    assert settings["trl"]["optimizer_steps"] == 1 and settings["trl"]["group_size"] == 4
    # trained tokens counted the same way: TRL's own count agrees with ours, and both tools saw
    # the same prompts through the same tokenizer
    assert rows["trl"]["num_tokens"] == rows["trl"]["trl_num_input_tokens_seen"]
    assert rows["trl"]["prompt_tokens_mean"] == pytest.approx(
        rows["cadence"]["prompt_tokens_mean"], rel=1e-9
    )
    grpo = report["grpo_config"]
    assert grpo["use_vllm"] is False and grpo["bf16"] is False and grpo["use_cpu"] is True
    assert grpo["gradient_checkpointing"] is False and grpo["report_to"] == "none"
    assert grpo["beta"] == 0.05 and grpo["num_generations"] == 4
    md = (tmp_path / "bench.md").read_text()
    assert "| trl |" in md and "| cadence |" in md and "**no**" not in md


def test_trl_arguments_map_the_workload(model_dir, tmp_path):
    from trl import GRPOConfig

    cfg = load_config(None, [*workload(model_dir), "train.iterations=3", "algo.scale_by_std=false"])
    args = trl_setup.trl_args(cfg, tmp_path)
    # 4 prompts x 4 samples per optimizer step, in micro-batches of 2 groups = 8 sequences
    assert args["per_device_train_batch_size"] == 8 and args["gradient_accumulation_steps"] == 2
    assert args["max_steps"] == 3 and args["max_completion_length"] == 12
    assert args["loss_type"] == "dapo" and args["scale_rewards"] == "none"
    assert args["mask_truncated_completions"] is False
    masked = load_config(None, [*workload(model_dir), "algo.mask_truncated=true"])
    assert trl_setup.trl_args(masked, tmp_path)["mask_truncated_completions"] is True
    config = GRPOConfig(**args)
    assert config.generation_batch_size == 16 and config.steps_per_generation == 2
    assert config.gradient_checkpointing is False and config.optim == "adamw_torch"


def test_a_lora_workload_trains_the_same_adapter_in_trl(model_dir, model, tmp_path):
    from peft import get_peft_model

    from cadence.bench.runs import config_lora
    from cadence.models.lora import LoraSpec, apply_lora

    lora = "model.lora={r=4, alpha=8.0, dropout=0.05, target_modules=['v_proj', 'q_proj']}"
    cfg = load_config(None, [*workload(model_dir), lora])
    peft_config = trl_setup.trl_peft_config(cfg)
    assert (peft_config.r, peft_config.lora_alpha, peft_config.lora_dropout) == (4, 8.0, 0.05)
    assert set(peft_config.target_modules) == {"q_proj", "v_proj"}
    # read back from the model TRL wraps, from cadence's config and from the model cadence
    # wraps: the same setting (the settings table compares the first two)
    trl_side = trl_setup.trained_lora(get_peft_model(model, peft_config))
    assert trl_side == "r=4, alpha=8.0, dropout=0.05, targets=['q_proj', 'v_proj']"
    assert config_lora(cfg) == trl_side
    spec = LoraSpec(4, 8.0, 0.05, ("v_proj", "q_proj"))
    assert trl_setup.trained_lora(apply_lora(load_model(model_dir), spec)) == trl_side
    plain = load_config(None, workload(model_dir))
    assert trl_setup.trl_peft_config(plain) is None and config_lora(plain) == "off"
    assert trl_setup.trained_lora(load_model(model_dir)) == "off"


@pytest.mark.parametrize(
    "override, needle",
    [
        ("algo.loss='pg'", "algo.loss"),
        ("algo.advantage='rloo'", "algo.advantage"),
        ("algo.kl_estimator='k1'", "algo.kl_estimator"),
        ("train.mini_batches=2", "train.mini_batches"),
        ("train.micro_batch_groups=3", "not a multiple"),
        ("rollout.temperature=0", "rollout.temperature"),
        ("model.dtype='bfloat16'", "model.dtype"),
        ("algo.std='population'", "algo.std = 'population'"),
        ("algo.std_eps=1e-6", "algo.std_eps = 1e-06"),
        ("algo.clip_ratio_c=3", "algo.clip_ratio_c"),
        ("algo.kl_clamp=10", "algo.kl_clamp"),
        ("reward.overlong_buffer=4", "reward.overlong_buffer"),
    ],
)
def test_workloads_trl_cannot_match_are_refused(model_dir, tmp_path, capsys, override, needle):
    cfg = load_config(None, [*workload(model_dir), override])
    with pytest.raises(ConfigError, match=needle):
        trl_setup.check_workload(cfg)
    assert main(cli_args(model_dir, tmp_path, "--suite", "trl", "--set", override)) == 2
    assert needle in capsys.readouterr().err


def test_missing_trl_is_a_clear_error(model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(trl_peer, "available", lambda: False)
    assert main(cli_args(model_dir, tmp_path, "--suite", "trl")) == 2
    assert "pip install 'cadence[bench]'" in capsys.readouterr().err
