"""`make gpu-check` where there is no GPU: the one-line refusal, from make and from the script;
and the pieces of benchmarks/gpu_check.py, gpu_smi.py and gpu_logprobs.py that run on a CPU:
finding the GPU, reading nvidia-smi, sampling its memory, counting test results, reading vLLM's
log, the log-prob difference, and the whole check (a run, the probe, the table and the JSON) on
the tiny model with cadence's own engine."""

import json
import os
import shutil
import subprocess
import sys
import threading
from argparse import Namespace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import gpu_check
import gpu_logprobs
import gpu_smi

ROOT = Path(__file__).parents[2]

NO_DRIVER = "nvidia-smi is missing or failed (no NVIDIA driver on this machine)"


def test_make_gpu_check_refuses_in_one_line_before_installing_anything(tmp_path):
    make = shutil.which("make")
    assert make is not None, "make is how CI runs the suite"
    no_tools = tmp_path / "bin"  # PATH without nvidia-smi, on any machine
    no_tools.mkdir()
    venv = tmp_path / "venv-gpu"
    # not a sub-make of the `make test` that runs the suite: its own output, no jobserver
    outer = ("CUDA_VISIBLE_DEVICES", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")
    env = {k: v for k, v in os.environ.items() if k not in outer}
    command = [make, "-C", str(ROOT), "--no-print-directory", "gpu-check"]
    done = subprocess.run(
        [*command, f"PYTHON={sys.executable}", f"GPU_VENV={venv}"],
        env=env | {"PATH": str(no_tools)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert done.stdout == ""
    ours = [line for line in done.stderr.splitlines() if not line.startswith(("make:", "make["))]
    assert ours == [f"make gpu-check needs an NVIDIA GPU with CUDA: {NO_DRIVER}"]
    assert not venv.exists()


@pytest.mark.parametrize("step", ["preflight", "run"])
def test_the_script_refuses_where_cuda_visible_devices_hides_the_gpus(step):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), step],
        env=os.environ | {"CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "make gpu-check needs an NVIDIA GPU with CUDA: CUDA_VISIBLE_DEVICES='' hides every GPU"
    ]


H100 = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1234)\n"


@pytest.mark.parametrize(
    ("env", "listing", "reason"),
    [
        ({}, H100, None),
        ({"CUDA_VISIBLE_DEVICES": "0"}, H100, None),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, H100, "CUDA_VISIBLE_DEVICES='-1' hides every GPU"),
        ({}, None, NO_DRIVER),
        ({}, "No devices were found\n", "nvidia-smi lists no GPU"),
    ],
)
def test_gpu_refusal(env, listing, reason):
    asked = []

    def smi(*args):
        asked.append(args)
        return listing

    assert gpu_check.gpu_refusal(env, smi) == reason
    assert asked in ([], [("-L",)])


def test_smi_rows_keep_whole_rows_of_integers_only():
    text = "1234, 81559\n[N/A], 5\n77, 12\n\n4242\n"
    assert gpu_smi.smi_rows(text) == [[1234, 81559], [77, 12], [4242]]
    assert gpu_smi.smi_rows(None) == []


def test_gpu_memory_keeps_the_peaks_of_the_device_and_of_each_process():
    device = iter(["500", "9000", "30000", "12000"])  # MiB used: idle, then while running
    apps = iter(["", "11, 4000\n", "11, 8000\n12, 20000\n", "11, 6000\n"])
    done = threading.Event()

    def smi(*args):
        if args[0].startswith("--query-gpu"):
            return next(device, "12000")
        value = next(apps, None)
        if value is None:  # every scripted sample taken
            done.set()
            return ""
        return value

    with gpu_smi.GpuMemory(smi, period_s=0.001) as memory:
        assert done.wait(10)
    assert memory.figures() == {
        "device_idle_mb": 500,
        "device_peak_mb": 30000,
        "process_peak_mb": {"11": 8000, "12": 20000},
    }


def test_junit_counts_read_what_pytest_writes(tmp_path):
    (tmp_path / "test_three.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert False\n"
        "@pytest.mark.skip\n"
        "def test_skipped(): pass\n"
    )
    xml = tmp_path / "out.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"],
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
    )
    assert gpu_check.junit_counts(xml) == {"passed": 1, "failed": 1, "errors": 0, "skipped": 1}


def test_vllm_log_figures_read_its_start_up_lines():
    log = (
        "INFO 11-25 10:00:01 [gpu_model_runner.py:5150] Model loading took 0.2571 GiB memory "
        "and 1.234567 seconds\n"
        "INFO 11-25 10:00:09 [gpu_worker.py:760] Available KV cache memory: 21.3 GiB\n"
        "INFO 11-25 10:00:20 [gpu_model_runner.py:6582] Graph capturing finished in 6 secs, "
        "took 0.41 GiB\n"
        "INFO 11-25 10:00:20 [core.py:396] init engine (profile, create kv cache, warmup model) "
        "took 19.50 s (compilation: 12.25 s)\n"
    )
    assert gpu_check.vllm_log_figures(log) == {
        "vllm_weights_gib": 0.2571,
        "vllm_kv_cache_gib": 21.3,
        "vllm_cuda_graphs_gib": 0.41,
        "vllm_start_s": 19.5,
        "vllm_compile_s": 12.25,
    }
    assert gpu_check.vllm_log_figures("cadence: no vLLM here\n") == {}


def test_logprob_abs_diff_over_the_masked_tokens():
    behaviour = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, 0.0]])
    learner = torch.tensor([[-1.5, -2.0, -9.0], [-0.5, -0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # the -9.0 is padding: not counted
    # |diffs| on the mask: 0.5, 0, 0, 0.25 -> max 0.5, mean 0.1875
    assert gpu_logprobs.logprob_abs_diff(behaviour, learner, mask) == {
        "max": 0.5,
        "mean": 0.1875,
        "num_tokens": 4,
    }
    with pytest.raises(ValueError, match="no token to compare"):
        gpu_logprobs.logprob_abs_diff(behaviour, learner, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="shapes differ"):
        gpu_logprobs.logprob_abs_diff(behaviour, learner[:, :2], mask)


def test_perturbed_moves_every_weight_and_is_seeded():
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    b.load_state_dict(a.state_dict())
    before = a.weight.detach().clone()
    gpu_logprobs.perturbed(a, 0.05)
    gpu_logprobs.perturbed(b, 0.05)
    assert torch.equal(a.weight, b.weight)
    relative = (a.weight - before).abs() / before.abs()
    assert relative.max().item() > 0.05  # a 5% standard deviation: some move further


@pytest.mark.slow
def test_the_whole_check_on_cpu_writes_figures_and_a_table(model_dir, tmp_path):
    cpu = [
        f"model.path='{model_dir}'",
        "model.device='cpu'",
        "model.dtype='float32'",
        "rollout.engine='continuous'",
        "rollout.vllm={}",
        "data.chat_template=false",
        "data.num_heldout=2",
        "train.iterations=2",
        "train.prompts_per_iteration=2",
        "train.micro_batch_groups=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=8",
    ]
    args = Namespace(
        config=ROOT / "configs" / "smollm2-gpu.toml",
        out=tmp_path / "check",
        set=cpu,
        placements=["colocated"],
        skip_tests=True,
        test_timeout_s=300.0,
        run_timeout_s=300.0,
    )
    result = gpu_check.check(args)
    run = result["runs"]["colocated"]
    assert run["rc"] == 0, run.get("log_tail")
    assert run["placement"] == "colocated" and run["iterations"] == 2
    assert run["tpspd_overall"] > 0 and run["gen_busy_s"] > 0 and run["train_busy_s"] > 0
    assert run["num_tokens"] > 0 and len(run["reward_mean"]) == 2
    probe = result["logprob_probe"]
    assert probe["rc"] == 0, probe.get("log_tail")
    assert list(probe["models"]) == ["start", "perturbed", "colocated"]
    for figures in probe["models"].values():  # fp32 on CPU: the engine's tokens are the learner's
        assert figures["max"] <= 1e-4 and figures["num_tokens"] > 0
    assert probe["models"]["start"]["max_weight_change"] == 0.0
    assert probe["models"]["perturbed"]["max_weight_change"] > 1e-3
    assert gpu_check.passed(result)
    path = gpu_check.write_results(result, args.out)
    assert json.loads(path.read_text()) == result
    table = gpu_check.report(result)
    assert "TPSPD (tokens/s/device)" in table and "probe, perturbed model" in table
    failed = json.loads(path.read_text())
    failed["runs"]["colocated"]["rc"] = 1
    assert not gpu_check.passed(failed)
