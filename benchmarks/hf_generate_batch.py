"""transformers' own continuous batching (`model.generate_batch`) against cadence's engine, on CPU.

The same random-init 'tiny' model and prompts, 8 samples per prompt, exactly `--new-tokens`
sampled tokens each, 2 threads. Reports new tokens/s (median of `--repeats`, after one warm-up
call) and whether per-token log-probs came back, since the learner needs behaviour log-probs.

    .venv/bin/python benchmarks/hf_generate_batch.py [--prompts 32] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from cadence.bench.engine import _requests
from cadence.data import ArithmeticTask
from cadence.engine import ContinuousEngine, SamplingParams
from cadence.models import init_model, load_model, load_tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny"
        init_model("tiny", path, ArithmeticTask(difficulty=2).corpus(5000), seed=0)
        tokenizer = load_tokenizer(path)
        ours = load_model(path)
        theirs = AutoModelForCausalLM.from_pretrained(path, attn_implementation="paged|sdpa")
    requests = _requests(tokenizer, args.prompts, 8)
    rows = [r.prompt_ids for r in requests for _ in r.seeds]
    tokens = len(rows) * args.new_tokens
    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        eos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    engine = ContinuousEngine(ours, tokenizer, max_num_seqs=len(rows))
    params = SamplingParams(max_new_tokens=args.new_tokens)
    out = theirs.generate_batch(rows[:8], generation_config=config, persistent_manager=True)
    first = next(iter(out.values()))
    logprobs = getattr(first, "logprobs", None)
    engine.generate(requests[:1], params)
    t_theirs, t_ours = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        theirs.generate_batch(rows, generation_config=config, persistent_manager=True)
        t_theirs.append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.generate(requests, params)
        t_ours.append(time.perf_counter() - start)
    print(
        json.dumps(
            {
                "samples": len(rows),
                "new_tokens": args.new_tokens,
                "generate_batch_tokens_per_s": round(tokens / statistics.median(t_theirs)),
                "cadence_continuous_tokens_per_s": round(tokens / statistics.median(t_ours)),
                "generate_batch_logprobs": bool(logprobs),
            }
        )
    )


if __name__ == "__main__":
    main()
