"""What the learner computes, per layout, on workloads whose lengths vary: positions computed
against tokens computed, learner seconds per trained token and peak RSS, side by side in one run.

Three workloads, each the learner a config builds, on synthetic groups (random tokens, rewards
alternating so every response trains) whose lengths are drawn once from a seeded distribution:
- `longtail`: configs/bench-longtail.toml (the tiny model, G = 8, 16 prompts, responses
  lognormal mean 60, sigma 1.0, capped at its 256);
- `env`: configs/smollm2-env.toml (SmolLM2 with its LoRA adapter, 8 prompts x 8 episodes,
  prompts of 70 tokens, episodes lognormal mean 48, sigma 0.5, capped at its 128);
- `7b`: the 7B recipe's planned lengths (G = 8, lognormal mean 800, sigma 0.6, capped at
  2,048; micro-batches of 16,384 tokens) on a tiny Qwen2 of 4,096 positions built from a config.
Each variant runs in a process of its own (its peak RSS is its own): `today` is the config's
own layout and micro-batching, the others the layout (`learner.shared_prompt_impl`) and
micro-batching named. `--profile` runs one more iteration under
torch.profiler, after the timed ones, and reports where its CPU time went: matrix products,
attention, and the log-prob head (forward and backward, its matrix products included).
Seconds are the fastest of `--iterations` (default 2): a learner's first iteration also pages
in its activations' memory, paid once a run (`first_ms_per_trained_token`).

    .venv/bin/python benchmarks/learner_layouts.py [--workloads longtail,env,7b] [--profile]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# workload -> (config, prompts, group size, prompt tokens, (mean, sigma, cap) of responses)
WORKLOADS = {
    "longtail": ("configs/bench-longtail.toml", 16, 8, 20, (60.0, 1.0, 256)),
    "env": ("configs/smollm2-env.toml", 8, 8, 70, (48.0, 0.5, 128)),
    "7b": ("", 8, 8, 120, (800.0, 0.6, 2048)),
}
_PREFIX, _PACKED = "learner.shared_prompt_impl='prefix'", "learner.shared_prompt_impl='packed'"
_NO_CKPT = "learner.activation_checkpointing=false"
# workload -> {variant: config overrides}; "today" is the config as shipped
VARIANTS = {
    "longtail": {
        "today": [],
        "packed, 4 groups": [_PACKED],
    },
    "env": {  # named in full: the config now ships the last one
        "prefix, 1 group": [_PREFIX, "train.micro_batch_groups=1", _NO_CKPT],
        "prefix, 8 groups": [_PREFIX, "train.micro_batch_groups=8", _NO_CKPT],
        "packed, 8 groups": [_PACKED, "train.micro_batch_groups=8", _NO_CKPT],
        "packed, 8 groups, checkpointing (shipped)": [
            _PACKED,
            "train.micro_batch_groups=8",
            "learner.activation_checkpointing=true",
        ],
    },
    "7b": {
        "today (prefix, 16,384 tokens)": [_PREFIX],
        "packed, 16,384 positions": [_PACKED],
    },
}


def _tiny_7b_shape(directory: Path) -> str:
    """A tiny Qwen2 of 4,096 positions, random weights, saved with SmolLM2's tokenizer files."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return str(directory)


def _config(workload: str, sets: list[str], model_dir: str | None):
    from cadence.config import load_config

    path, prompts, group_size, _, _ = WORKLOADS[workload]
    if workload == "7b":
        sets = [
            f"model.path='{model_dir}'",
            "train.micro_batch_tokens=16384",
            f"train.prompts_per_iteration={prompts}",
            f"rollout.group_size={group_size}",
            "rollout.max_new_tokens=2048",
            "algo.kl_coef=0.0",
            *sets,
        ]
        path = "configs/default.toml"
    return load_config(str(ROOT / path), sets)


def _groups(workload: str, vocab: int):
    """The workload's groups: lengths drawn once (seed 0), random tokens."""
    import numpy as np

    from cadence.types import Completion, Group, Prompt

    _, prompts, group_size, prompt_len, (mean, sigma, cap) = WORKLOADS[workload]
    rng = np.random.default_rng(0)
    lengths = rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, size=(prompts, group_size))
    lengths = np.clip(np.rint(lengths), 1, cap).astype(int)
    groups = []
    for i, row in enumerate(lengths):
        completions = [
            Completion(rng.integers(0, vocab, n).tolist(), [-1.0] * int(n), reward=float(j % 2))
            for j, n in enumerate(row)
        ]
        ids = rng.integers(0, vocab, prompt_len).tolist()
        groups.append(Group(Prompt(f"synthetic:{i}", "", "", i), ids, completions, 0, 0))
    return groups


MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
HEAD = ("ChunkedLogprobs", "ChunkedLogprobsBackward")


def _shares(learner, groups) -> dict:
    """Where one more iteration's CPU time goes: each class's share of the self time of all ops
    (the head's share is its inclusive time, so it overlaps the matrix products)."""
    import torch

    from cadence.learner import score

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        learner.train_iteration(iter(score(groups, learner.algo)), len(groups))
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    return {
        "matmul_share": sum(e.self_cpu_time_total for e in events if e.key in MATMULS) / total,
        "attention_share": sum(
            e.self_cpu_time_total for e in events if "scaled_dot_product" in e.key
        ) / total,
        "logprob_head_share": sum(e.cpu_time_total for e in events if e.key in HEAD) / total,
    }  # fmt: skip


def measure(
    workload: str, variant: str, model_dir: str | None, iterations: int, profile: bool = False
) -> dict:
    """One process: the variant's learner over the workload's groups."""
    from cadence.builder import build_learner, load_policy, set_threads
    from cadence.learner import score

    cfg = _config(workload, VARIANTS[workload][variant], model_dir)
    set_threads(cfg.train.threads)
    model, masters = load_policy(cfg)
    learner = build_learner(cfg, model, 0, masters=masters)
    groups = _groups(workload, model.get_input_embeddings().num_embeddings)
    times, stats = [], {}
    for _ in range(iterations):
        start = time.perf_counter()
        stats = learner.train_iteration(iter(score(groups, learner.algo)), len(groups))
        times.append(time.perf_counter() - start)
    trained = sum(len(c.token_ids) for g in groups for c in g.completions)
    shares = _shares(learner, groups) if profile else {}
    return shares | {
        "layout": learner.layout,
        "tokens_computed": stats["tokens_computed"],
        "positions_computed": stats["positions_computed"],
        "positions_per_token": stats["positions_computed"] / stats["tokens_computed"],
        "trained_tokens": trained,
        "iteration_s": min(times),
        "ms_per_trained_token": 1e3 * min(times) / trained,
        "first_ms_per_trained_token": 1e3 * times[0] / trained,  # fresh memory, paged in
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--out", default="runs/learner-layouts")
    ap.add_argument("--profile", action="store_true", help="where each variant's time goes")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        workload, variant, model_dir = args.child
        row = measure(workload, variant, model_dir or None, args.iterations, args.profile)
        print(json.dumps(row))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _tiny_7b_shape(Path(tmp) / "tiny-7b-shape")
        shares = " | matmul | attention | log-prob head" if args.profile else ""
        print("| workload | variant | layout | positions / tokens | ms / trained token", end="")
        print(f" | first iteration | peak RSS MB{shares} |")
        print("|---|---|---|---|---|---|---|" + "---|" * (3 if args.profile else 0))
        for workload in args.workloads.split(","):
            for variant in VARIANTS[workload]:
                cmd = [sys.executable, __file__, "--iterations", str(args.iterations)]
                cmd += ["--profile"] if args.profile else []
                cmd += ["--child", workload, variant, model_dir if workload == "7b" else ""]
                done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                if done.returncode:
                    raise RuntimeError(done.stderr[-3000:])
                row = {"workload": workload, "variant": variant}
                row |= json.loads(done.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(
                    f"| {workload} | {variant} | {row['layout']} "
                    f"| {row['positions_per_token']:.2f} | {row['ms_per_trained_token']:.3f} "
                    f"| {row['first_ms_per_trained_token']:.3f} | {row['peak_rss_mb']:,.0f} |",
                    end="",
                )
                if args.profile:
                    print(
                        f" {row['matmul_share']:.0%} | {row['attention_share']:.0%} "
                        f"| {row['logprob_head_share']:.0%} |",
                        end="",
                    )
                print(flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "learner_layouts.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
