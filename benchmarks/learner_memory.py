"""The learner's memory against response length: full logits, chunked log-probs, chunked log-probs
with activation checkpointing, and that with freed memory returned to the OS
(`learner.return_freed_memory`), side by side on SmolLM2-135M-Instruct (`make smollm2`).

Two measurements, each variant in a process of its own (its peak RSS is its own):
- `cadence train configs/smollm2.toml` for one iteration with `rollout.max_new_tokens` at
  `--tokens`, as a user would run it: peak RSS (`/usr/bin/time -f %M`) and the iteration's
  seconds;
- the learner alone on synthetic groups of the config's shape (8 prompts x 8 responses) at two
  response lengths: peak RSS and seconds per iteration, and their difference over the response
  tokens added: MB per response token, what a longer response costs.

    .venv/bin/python benchmarks/learner_memory.py [--tokens 96] [--variants A,B] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {  # name -> (logits_chunk_tokens, activation_checkpointing, return_freed_memory)
    "full logits": (0, False, False),
    "chunked": (1024, False, False),
    "chunked + checkpointing": (1024, True, False),
    "chunked + checkpointing + freed memory returned": (1024, True, True),
}
CONFIG = "configs/smollm2.toml"
MB = 2**20


def learner_only(
    chunk: int, checkpointing: bool, release: bool, tokens: int, iterations: int
) -> dict:
    """One process: the config's learner on synthetic groups of `tokens` response tokens."""
    import torch

    from cadence.bench.shared_prompt import synthetic_groups
    from cadence.builder import build_learner, load_policy, set_threads
    from cadence.config import load_config
    from cadence.learner import score

    sets = [
        f"learner.logits_chunk_tokens={chunk}",
        f"learner.activation_checkpointing={str(checkpointing).lower()}",
        f"learner.return_freed_memory={str(release).lower()}",
    ]
    cfg = load_config(CONFIG, sets)
    set_threads(cfg.train.threads)
    model, masters = load_policy(cfg)
    learner = build_learner(cfg, model, 0, masters=masters)
    vocab = model.get_input_embeddings().num_embeddings
    groups = synthetic_groups(
        vocab, cfg.train.prompts_per_iteration, 48, tokens, cfg.rollout.group_size
    )
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        learner.train_iteration(iter(score(groups, learner.algo)), len(groups))
        times.append(time.perf_counter() - start)
    del torch
    return {
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "iteration_s": min(times),
        "response_tokens": len(groups) * cfg.rollout.group_size * tokens,
    }


def train_run(chunk: int, checkpointing: bool, release: bool, tokens: int) -> dict:
    """`cadence train` for one iteration, responses of at most `tokens`."""
    with tempfile.TemporaryDirectory() as out:
        sets = {
            "rollout.max_new_tokens": tokens,
            "train.iterations": 1,
            "data.num_heldout": 1,
            "metrics.progress": "false",
            "learner.logits_chunk_tokens": chunk,
            "learner.activation_checkpointing": str(checkpointing).lower(),
            "learner.return_freed_memory": str(release).lower(),
        }
        args = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
        cmd = ["/usr/bin/time", "-f", "%M", sys.executable, "-m", "cadence.cli", "train", CONFIG]
        done = subprocess.run([*cmd, "--out", out, *args], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(done.stderr[-2000:])
        line = json.loads(Path(out, "metrics.jsonl").read_text().splitlines()[-1])
        return {
            "peak_rss_mb": int(done.stderr.strip().splitlines()[-1]) / 1024,
            "iteration_s": line["wall_s"],
            "train_s": line["train_s"],
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--short", type=int, default=48, help="the shorter response length")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--out", default="runs/learner-memory")
    ap.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated names (the first: base)"
    )
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        chunk, ckpt, release, tokens, its = args.child
        row = learner_only(int(chunk), ckpt == "1", release == "1", int(tokens), int(its))
        print(json.dumps(row))
        return
    rows = []
    for name in args.variants.split(","):
        chunk, ckpt, release = VARIANTS[name]
        row = {"variant": name, "run": train_run(chunk, ckpt, release, args.tokens)}
        for tokens in (args.short, args.tokens):
            flags = ["1" if ckpt else "0", "1" if release else "0"]
            child = [str(chunk), *flags, str(tokens), str(args.iterations)]
            cmd = [sys.executable, __file__, "--child", *child]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            row[f"learner_{tokens}"] = json.loads(out.strip().splitlines()[-1])
        short, long = row[f"learner_{args.short}"], row[f"learner_{args.tokens}"]
        added = long["response_tokens"] - short["response_tokens"]
        row["mb_per_response_token"] = (long["peak_rss_mb"] - short["peak_rss_mb"]) / added
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {
        "machine": platform.processor() or platform.machine(),
        "config": CONFIG,
        "tokens": args.tokens,
        "short": args.short,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "learner_memory.json").write_text(json.dumps(report, indent=2) + "\n")
    base = rows[0]
    lines = [
        f"| variant | `cadence train` peak RSS at {args.tokens} tokens (GB) | x less | iteration s "
        f"| learner peak RSS at {args.short} / {args.tokens} tokens (GB) | MB per response token "
        "| x less | learner s per iteration |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s, lg = r[f"learner_{args.short}"], r[f"learner_{args.tokens}"]
        lines.append(
            f"| {r['variant']} | {r['run']['peak_rss_mb'] / 1024:.2f} "
            f"| {base['run']['peak_rss_mb'] / r['run']['peak_rss_mb']:.2f} "
            f"| {r['run']['iteration_s']:.1f} | {s['peak_rss_mb'] / 1024:.2f} / "
            f"{lg['peak_rss_mb'] / 1024:.2f} | {r['mb_per_response_token']:.3f} "
            f"| {base['mb_per_response_token'] / r['mb_per_response_token']:.2f} "
            f"| {lg['iteration_s']:.1f} |"
        )
    (out / "learner_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
