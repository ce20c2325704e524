"""The planner's memory model against a learner's measured peak, at two model sizes.

`cadence plan` counts, per training rank, the training state and one micro-batch's activations
and logits (`plan.costs.activation_memory`). This measures, for two random-init Llamas of
different widths and depths in float32 on the CPU, the peak resident memory one micro-batch's
forward and backward adds (peak RSS less the RSS just before; each variant in a process of its
own), with and without activation checkpointing and chunked log-probs, and sets it beside what
the model predicts for the same micro-batch: its activations and logits, and the gradients the
backward allocates (4 bytes a parameter). `--held-out`: shapes, and a micro-batch of long-tailed
responses in the packed layout, that the constants were not fitted on. Written to
plan_memory.json and .md in `--out`.

    .venv/bin/python benchmarks/plan_memory.py [--out runs/plan-memory]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

SIZES = {  # name -> (hidden, intermediate, layers, heads, vocab): the two the constants were
    # fitted to
    "h512-L8": (512, 1376, 8, 8, 16384),
    "h1024-L6": (1024, 2752, 6, 16, 32768),
}
# shapes the constants were not fitted on (--held-out): grouped-query attention and SmolLM2's
# vocabulary, a deep narrow model, and bf16 compute under float32 masters
HELD_OUT = {  # name -> (hidden, intermediate, layers, heads, kv heads, vocab, dtype)
    "h768-L10-gqa": (768, 2048, 10, 12, 4, 49152, "float32"),
    "h384-L24": (384, 1024, 24, 6, 6, 24576, "float32"),
    "h768-L10-gqa-bf16": (768, 2048, 10, 12, 4, 49152, "bfloat16"),
}
# a micro-batch of long-tailed responses in the packed layout (--held-out too): the planner sizes
# activations by the positions the layout computes (each group's prompt once, then its responses
# end to end), which it was not fitted on
LONG_TAIL = {"h768-L10-gqa long tail": "h768-L10-gqa"}
TAIL_GROUPS, TAIL_SIZE, TAIL_MEAN, TAIL_CAP = 4, 4, 160, 1024  # lognormal lengths, capped
VARIANTS = {"full logits": (0, False), "chunked": (256, False), "chunked + ckpt": (256, True)}
# glibc returns every block of 64 KiB or more to the system when freed, so the resident set is
# what is live (its default threshold grows, and freed tensors would stay counted)
ENV = os.environ | {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
SEQUENCES, PROMPT, RESPONSE = 8, 64, 448  # one micro-batch: 8 groups of 1 x (64 + 448) tokens


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def child(size: str, chunk: int, ckpt: bool) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from cadence.algo import AlgoParams
    from cadence.bench.shared_prompt import synthetic_groups
    from cadence.learner import Learner, LearnerParams, StepSums, score

    torch.set_num_threads(2)
    h, i, layers, heads, kv_heads, vocab, dtype = shape(size)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=i,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    masters = None
    if dtype == "bfloat16":  # as the one-process learner holds it: float32 masters
        from cadence.learner.precision import Masters

        masters = Masters.split(model, torch.bfloat16)
    tail = size in LONG_TAIL
    params = LearnerParams(
        micro_batch_groups=TAIL_GROUPS if tail else SEQUENCES,
        logits_chunk_tokens=chunk,
        activation_checkpointing=ckpt,
        shared_prompt=tail,
        shared_prompt_impl="packed",
    )
    algo = AlgoParams(max_policy_tokens=TAIL_CAP if tail else RESPONSE, kl_coef=0.0)
    learner = Learner(model, params, algo, 0, masters=masters)
    if tail:
        groups = score(long_tailed_groups(vocab), algo)
    else:
        groups = score(synthetic_groups(vocab, SEQUENCES, PROMPT, RESPONSE, 2)[:SEQUENCES], algo)
    learner.begin_iteration()
    before = rss_mb()
    learner.forward_backward(groups, StepSums())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    n = sum(p.numel() for p in model.parameters())
    # the positions the layout computes: every token of the unpacked layout, each group's
    # prompt once and its responses end to end in the packed one
    tokens = sum(s.group.num_tokens for s in groups)
    if tail:
        tokens = sum(
            len(s.group.prompt_ids) + sum(len(c.token_ids) for c in s.group.completions)
            for s in groups
        )
    return {"added_mb": peak - before, "params": n, "tokens": tokens}


def long_tailed_groups(vocab: int) -> list:
    """`TAIL_GROUPS` groups of `TAIL_SIZE` responses after a `PROMPT`-token prompt, their
    lengths lognormal (mean about `TAIL_MEAN`, capped at `TAIL_CAP`), rewards alternating."""
    import numpy as np

    from cadence.bench.shared_prompt import synthetic_groups

    rng = np.random.default_rng(0)
    sigma = 1.0
    lengths = rng.lognormal(np.log(TAIL_MEAN) - sigma**2 / 2, sigma, TAIL_GROUPS * TAIL_SIZE)
    groups = synthetic_groups(vocab, TAIL_GROUPS, PROMPT, TAIL_CAP, TAIL_SIZE)
    for g, group in enumerate(groups):
        for j, c in enumerate(group.completions):
            n = int(min(max(lengths[g * TAIL_SIZE + j], 1), TAIL_CAP))
            c.token_ids, c.logprobs = c.token_ids[:n], c.logprobs[:n]
    return groups


def shape(size: str) -> tuple:
    size = LONG_TAIL.get(size, size)
    if size in SIZES:
        h, i, layers, heads, vocab = SIZES[size]
        return h, i, layers, heads, heads, vocab, "float32"
    return HELD_OUT[size]


def predicted_mb(size: str, tokens: int, params: int, chunk: int, ckpt: bool) -> float:
    """The planner's activations and logits for the micro-batch, and the gradients its backward
    allocates: 4 bytes a parameter in float32; under bf16 compute the bf16 gradients and the
    float32 masters' they are added into (2 + 4)."""
    from cadence.plan.costs import ModelShape, activation_memory

    h, i, layers, heads, kv_heads, vocab, dtype = shape(size)
    value = 4.0 if dtype == "float32" else 2.0
    model = ModelShape(params, layers, h, h * kv_heads // heads, value, i, vocab)
    grads = 4 * params if dtype == "float32" else 6 * params
    return (activation_memory(model, tokens, ckpt, chunk) + grads) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/plan-memory")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument(
        "--held-out", action="store_true", help="the shapes the constants were not fitted on"
    )
    args = ap.parse_args()
    if args.child:
        size, chunk, ckpt = args.child
        print(json.dumps(child(size, int(chunk), ckpt == "1")))
        return
    rows = []
    for size in [*HELD_OUT, *LONG_TAIL] if args.held_out else SIZES:
        for name, (chunk, ckpt) in VARIANTS.items():
            cmd = [sys.executable, __file__, "--child", size, str(chunk), "1" if ckpt else "0"]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=ENV).stdout
            got = json.loads(out.strip().splitlines()[-1])
            want = predicted_mb(size, got["tokens"], got["params"], chunk, ckpt)
            row = {"size": size, "variant": name, "measured_mb": got["added_mb"]}
            row |= {"predicted_mb": want, "ratio": want / got["added_mb"], "tokens": got["tokens"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_memory.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = [
        "| model | variant | measured MB | planner MB | planner / measured |",
        "|---|---|---|---|---|",
        *(
            f"| {r['size']} | {r['variant']} | {r['measured_mb']:,.0f} | {r['predicted_mb']:,.0f} "
            f"| {r['ratio']:.2f} |"
            for r in rows
        ),
    ]
    (out / "plan_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
