"""What the learner adds up over an optimizer step's micro-batches, and an iteration's figures
(with the process's peak memory).

A step's sums are plain floats keyed by name: the loss's weighted sums and counts, and the
learner's own (response tokens, sequences, passes). They are all sums, so the sums of several
ranks add up to the sums of the whole batch: a sharded learner reduces them across ranks before
it normalises (learner/rank.py), and the figures below come out the same whatever N.
"""

from __future__ import annotations

import resource

import torch

from cadence.algo import COUNT_METRICS

# figures summed over an iteration's optimizer steps (the others are averaged)
TOTALS = ("num_tokens", "tokens_computed", "forward_passes", "micro_batches")


class StepSums:
    """Running sums over one optimizer step's micro-batches."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self.loss_metrics: dict[str, None] = {}  # names the loss returned, in order

    def add(self, **kv: float) -> None:
        for k, v in kv.items():
            self.values[k] = self.values.get(k, 0.0) + float(v)

    def add_loss_metrics(self, **kv: float) -> None:
        self.add(**kv)
        self.loss_metrics.update(dict.fromkeys(kv))

    def __getitem__(self, k: str) -> float:
        return self.values.get(k, 0.0)


def iteration_stats(steps: list[dict[str, float]], frozen_copies_bytes: int) -> dict[str, float]:
    """One iteration's figures from its optimizer steps' outputs: counts and totals add up over
    the steps, every other figure is their mean."""
    totals = {k: sum(s[k] for s in steps) for k in TOTALS}
    counts = (*COUNT_METRICS, "skipped_steps")
    summed = {*TOTALS, *counts}
    return (
        {k: sum(s[k] for s in steps) / len(steps) for k in steps[0] if k not in summed}
        | {k: sum(s[k] for s in steps) for k in counts if k in steps[0]}
        | {
            "num_tokens": totals["num_tokens"],
            "tokens_computed": totals["tokens_computed"],
            "forward_passes_per_microbatch": totals["forward_passes"] / totals["micro_batches"],
            "frozen_copies_mb": frozen_copies_bytes / 2**20,
            "optimizer_steps": float(len(steps)),
        }
    )


def peak_memory(device: torch.device) -> dict[str, float]:
    """This process's peak resident memory (`peak_rss_mb`) and, on a GPU, the peak CUDA memory
    allocated (`peak_cuda_mb`)."""
    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # KiB
    if device.type == "cuda":
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out
