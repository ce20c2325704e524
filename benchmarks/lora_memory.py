"""Memory of full fine-tuning against LoRA on the `small` preset (~110M parameters), side by side.

Each variant runs in its own process (so its peak RSS is its own): a random-init `small` Llama,
a learner with `algo.kl_coef > 0` (so a reference is needed: a frozen copy for full fine-tuning,
the same model with its adapter off for LoRA), and `--iterations` training iterations on
synthetic groups (4 prompts of 32 tokens x 8 responses of 64). Reported per variant: trainable
parameters, bytes of weights, gradients and AdamW state, `frozen_copies_mb`, the peak resident
set size of the process, and seconds per iteration. Variants alternate `--repeats` times; the
median is written to `lora_memory.json` and `.md` in `--out`.

    .venv/bin/python benchmarks/lora_memory.py [--repeats 2] [--out runs/lora-memory]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

VARIANTS = ("full", "lora")
MB = 2**20


def measure(variant: str, iterations: int) -> dict[str, float]:
    from cadence.algo import AlgoParams
    from cadence.bench.shared_prompt import synthetic_groups
    from cadence.learner import Learner, LearnerParams, frozen_copy, score
    from cadence.models.lora import AdapterOff, LoraSpec, apply_lora
    from cadence.models.presets import build_model

    torch.set_num_threads(2)

    class Vocab:  # build_model needs only the vocabulary's size and special ids
        eos_token_id, pad_token_id = 0, 1

        def __len__(self) -> int:
            return 512

    model = build_model("small", Vocab(), seed=0).train()
    if variant == "lora":
        model = apply_lora(model, LoraSpec(r=16, alpha=32.0))
        ref = AdapterOff(model)
    else:
        ref = frozen_copy(model)
    algo = AlgoParams(kl_coef=0.01)
    learner = Learner(model, LearnerParams(lr=1e-5), algo, pad_id=1, ref_model=ref)
    start = time.perf_counter()
    for _ in range(iterations):
        scored = score(synthetic_groups(512, 4, 32, 64, 8), algo)
        stats = learner.train_iteration(iter(scored), 4)
    seconds = (time.perf_counter() - start) / iterations
    trainable = [p for p in model.parameters() if p.requires_grad]
    state = learner.optimizer.state.values()
    return {
        "trainable_params_m": sum(p.numel() for p in trainable) / 1e6,
        "weights_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / MB,
        "grads_mb": sum(p.numel() * p.element_size() for p in trainable) / MB,
        "adam_state_mb": sum(t.numel() * t.element_size() for s in state for t in s.values()) / MB,
        "frozen_copies_mb": stats["frozen_copies_mb"],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "s_per_iteration": seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--out", default="runs/lora-memory")
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one child run
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant, args.iterations)))
        return
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for v in VARIANTS:  # alternating, so both see the machine in the same state
            cmd = [sys.executable, __file__, "--variant", v, "--iterations", str(args.iterations)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[v].append(json.loads(out.strip().splitlines()[-1]))
    result = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in runs.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "repeats": args.repeats}
    (out / "lora_memory.json").write_text(json.dumps(meta | result, indent=2) + "\n")
    lines = ["| figure | full | LoRA (r=16, attention) |", "|---|---|---|"]
    for k in result["full"]:
        lines.append(f"| {k} | {result['full'][k]:,.2f} | {result['lora'][k]:,.2f} |")
    (out / "lora_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
