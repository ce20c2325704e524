"""Sampling throughput: cadence's HFEngine against `model.generate` on the same batch.

Both decode exactly `--new-tokens` tokens per sample (no early stop) from the same prompts with
sampling on, so the work is identical. Runs are interleaved and the median of `--repeats` is
reported, since this machine's speed drifts by +-15%. Writes a JSON line per batch size.

    .venv/bin/python benchmarks/engine_vs_generate.py [--model DIR] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cadence.data import ArithmeticTask, make_prompt
from cadence.engine import HFEngine, Request, SamplingParams, derive_seed
from cadence.models import init_model, load_model, load_tokenizer


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench(model, tokenizer, num_prompts: int, group_size: int, new_tokens: int, repeats: int):
    task = ArithmeticTask(difficulty=2, seed=1)
    prompts = [tokenizer(make_prompt(e.question))["input_ids"] for e in task.heldout()]
    prompts = prompts[:num_prompts]
    requests = [
        Request(p, [derive_seed(0, 0, i, j) for j in range(group_size)])
        for i, p in enumerate(prompts)
    ]
    engine = HFEngine(model, tokenizer, max_num_seqs=num_prompts * group_size)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)  # no stop token
    tokenizer.padding_side = "left"
    rows = [p for p in prompts for _ in range(group_size)]
    batch = tokenizer.pad({"input_ids": rows}, return_tensors="pt")

    def hf_generate():
        model.generate(
            **batch,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )

    def ours():
        engine.generate(requests, params)

    ours(), hf_generate()  # warm-up
    t_ours, t_hf = [], []
    for _ in range(repeats):
        t_ours.append(_timed(ours))
        t_hf.append(_timed(hf_generate))
    tokens = len(rows) * new_tokens
    ours_tps, hf_tps = tokens / statistics.median(t_ours), tokens / statistics.median(t_hf)
    return {
        "batch": len(rows),
        "new_tokens": new_tokens,
        "engine_tokens_per_s": round(ours_tps),
        "generate_tokens_per_s": round(hf_tps),
        "ratio": round(ours_tps / hf_tps, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF model dir (default: a fresh 'tiny' model)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            path = Path(tmp) / "tiny"
            init_model("tiny", path, ArithmeticTask(difficulty=2).corpus(5000))
        model, tokenizer = load_model(path), load_tokenizer(path)
        for num_prompts, group_size in [(1, 8), (4, 8), (16, 8)]:
            row = bench(model, tokenizer, num_prompts, group_size, args.new_tokens, args.repeats)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
