"""`cadence plan CONFIG`: what each GPU of a run holds, buffer by buffer, from the config and the
model's shape; the 8-GPU recipe fits it, and its header is that ledger."""

from __future__ import annotations

from pathlib import Path

import pytest

from cadence.cli import main
from cadence.config import load_config
from cadence.plan.ledger import learner_buffers, ledger
from cadence.plan.shapes import KNOWN, model_shape, shape_of

RECIPE = "configs/qwen7b-8gpu.toml"
H100 = 80e9


def test_a_shape_from_a_config_counts_the_published_parameters():
    # Qwen2.5-7B: 7.62 B parameters (untied head, q/k/v biases); SmolLM2-135M: 134.5 M (tied)
    assert shape_of(KNOWN["Qwen2.5-7B-Instruct"]).params == pytest.approx(7.6156e9, rel=1e-3)
    assert shape_of(KNOWN["SmolLM2-135M-Instruct"]).params == pytest.approx(134.515e6, rel=1e-3)
    assert model_shape("models/Qwen2.5-7B-Instruct").kv_dim == 512  # not downloaded: the table


def test_the_8_gpu_recipe_fits_every_gpu_and_gpu_0_holds_evaluation_only_while_it_runs(capsys):
    assert main(["plan", RECIPE, "--out", "/tmp/cadence-ledger-test"]) == 0
    printed = capsys.readouterr().out
    cfg = load_config(RECIPE)
    gpus = ledger(cfg, model_shape(cfg.model.path), H100)
    assert len(gpus) == 8 and all(g.peak <= H100 - 5e9 for g in gpus)  # headroom everywhere
    gpu0 = gpus[0]
    assert gpu0.buffers["held-out evaluation: a copy and its cache"][0] == "evaluating"
    assert not any("driver's copy" in name for name in gpu0.buffers)  # in host memory
    assert [g.roles[0] for g in gpus[4:]] == [f"rollout worker {w}" for w in range(4)]
    # the recipe's header is the ledger, line for line
    lines = Path(RECIPE).read_text().splitlines()
    header = [line[4:] for line in lines if line.startswith("#   |")]
    table = [line for line in printed.splitlines() if line.startswith("|")]
    assert header == table


def test_without_a_sized_evaluation_cache_gpu_0_is_over_its_memory(capsys):
    # 256 slots x 2,560 positions of keys and values: 37.6 GB beside rank 0's shards
    assert main(["plan", RECIPE, "--set", "train.eval_max_num_seqs=0", "--out", "/tmp/l2"]) == 1
    assert "GPU(s) [0] would hold more than their memory" in capsys.readouterr().out


def test_float32_masters_under_a_bf16_model_take_18_bytes_a_parameter_and_its_gradients():
    # the one-process path (and DDP) keeps the bf16 model beside float32 masters, their
    # gradients and AdamW's moments: 18 bytes a parameter, not 16, and the bf16 gradients of a
    # micro-batch while it trains; FSDP shards 16 and gathers bf16 layers
    shape = model_shape("models/Qwen2.5-7B-Instruct")
    one = learner_buffers(load_config(None, ["model.dtype='bfloat16'"]), shape, 1)
    state = ["weights (bfloat16)", "float32 masters", "masters' gradients"]
    steady = sum(one[k] for k in state) + one["AdamW moments (float32)"]
    assert steady == pytest.approx(18 * shape.params)
    assert one["a micro-batch's gradients (bfloat16)"] == pytest.approx(2 * shape.params)
    fsdp = learner_buffers(load_config(RECIPE), shape, 4)
    shards = ["parameter shards (float32)", "gradient shards", "AdamW moments (float32)"]
    assert sum(fsdp[k] for k in shards) == pytest.approx(16 * shape.params / 4)


def test_the_planners_ddp_rank_counts_the_bf16_copy_and_its_gradients():
    from cadence.plan.costs import DeviceSpec, from_hardware

    shape = model_shape("models/Qwen2.5-7B-Instruct")
    device = DeviceSpec("H100", 989e12, 3.35e12, H100)
    t = from_hardware(shape, device, seq_tokens=1000.0, reference_model=False).separate
    ddp = t.rank_memory(2, "ddp") - t.activation_bytes
    assert ddp == pytest.approx((16 + 2 + 2) * shape.params)
