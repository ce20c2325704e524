"""What the learner adds up over an optimizer step's micro-batches, and an iteration's figures
(with the process's peak memory).

A step's sums are plain floats keyed by name: the loss's weighted sums and counts, and the
learner's own (response tokens, sequences, passes). They are all sums, so the sums of several
ranks add up to the sums of the whole batch: a sharded learner reduces them across ranks before
it normalises (learner/rank.py), and the figures below come out the same whatever N. A figure
that is a largest value is kept apart (`StepSums.maxima`): across micro-batches and ranks it is
the largest, never a sum.

Read on: docs/learner.md#how-it-is-built.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass, field

import torch

from cadence.algo import (
    CORRECTION_FIGURES,
    CORRECTION_MAXIMA,
    CORRECTION_SUMS,
    COUNT_METRICS,
    LARGEST_FIGURES,
    SMALLEST_FIGURES,
    TOKEN_METRICS,
    AlgoParams,
    correction_figures,
)
from cadence.learner.batch import Responses
from cadence.learner.distill import distill_figures
from cadence.types import Group

# figures summed over an iteration's optimizer steps (the others are averaged)
TOTALS = ("num_tokens", "tokens_computed", "positions_computed", "forward_passes", "micro_batches")
# figures of the iteration's first optimizer step alone (absent where it trained no fresh row)
BEHAVIOUR_FIGURES = (
    "behaviour_logprob_abs_diff_mean",
    "behaviour_logprob_abs_diff_max",
    "first_step_ratio_abs_dev_max",
)


class StepSums:
    """Running sums over one optimizer step's micro-batches."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self.maxima: dict[str, float] = {}  # the largest value seen, not a sum
        self.loss_metrics: dict[str, None] = {}  # names the loss returned, in order

    def add(self, **kv: float) -> None:
        for k, v in kv.items():
            self.values[k] = self.values.get(k, 0.0) + float(v)

    def add_max(self, **kv: float) -> None:
        for k, v in kv.items():
            self.maxima[k] = max(self.maxima.get(k, float(v)), float(v))

    def add_loss_metrics(self, **kv: float) -> None:
        self.add(**kv)
        self.loss_metrics.update(dict.fromkeys(kv))

    def __getitem__(self, k: str) -> float:
        return self.values.get(k, 0.0)


@dataclass
class Passes:
    """What one micro-batch's passes made: the loss (not yet backpropagated) and its metrics,
    the policy's log-probs and entropy, the micro-batch's tensors, the tokens the layout
    computed and the forward passes it took."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    logprobs: torch.Tensor  # (B, T)
    entropy: torch.Tensor | None  # (B, T)
    resp: Responses
    tokens_computed: int
    positions_computed: int  # padding included
    passes: int
    old_logprobs: torch.Tensor | None = None  # (B, T): the loss's pi_old
    # pi_old is not the policy's own log-probs detached (a frozen old copy's pass, or the
    # behaviour log-probs): a first-step ratio can then differ from 1
    old_pass: bool = False
    distilled: dict[str, float] = field(default_factory=dict)  # learner/distill.py's sums


def record_micro_batch(
    sums: StepSums, out: Passes, groups: list[Group], first_step: bool, idle: bool
) -> None:
    """Add one micro-batch to its step's sums: the loss's sums and counts, the correction's sums
    and maxima, and the learner's own (tokens, sequences, passes, entropy, staleness, and before
    the iteration's `first_step` the gap to the behaviour log-probs on fresh rows). An `idle`
    pass records every name, as 0 (the ranks add their sums up by name)."""
    resp, mask = out.resp, out.resp.loss_mask
    on_policy = mask * ~resp.stale[:, None] if first_step else torch.zeros_like(mask)  # (B, T)
    behaviour, maxima = behaviour_sums(out.logprobs, resp.behaviour_logprobs, on_policy)
    if out.old_pass:  # the policy's own log-probs, detached, cannot disagree with themselves
        maxima["first_step_ratio_abs_dev_max"] = ratio_deviation(out, on_policy)
    loss_metrics = {"loss": out.loss.item(), **{k: v.item() for k, v in out.metrics.items()}}
    correction = {k: loss_metrics.pop(k) for k in CORRECTION_SUMS if k in loss_metrics}
    maxima |= {k: loss_metrics.pop(k) for k in CORRECTION_MAXIMA if k in loss_metrics}
    entropy = out.entropy if out.entropy is not None else torch.zeros_like(mask)
    own = {
        "entropy_sum": float((entropy * mask).sum()),
        "num_stale_tokens": float(mask[resp.stale].sum()),
        "num_response_tokens": float(mask.sum()),
        "num_seqs": float(mask.shape[0]),  # empty and masked responses count (TRL's way)
        "num_tokens": float(sum(g.num_tokens for g in groups)),
        "tokens_computed": float(out.tokens_computed),
        "positions_computed": float(out.positions_computed),
        "forward_passes": float(out.passes),
        "micro_batches": 1.0,
        **behaviour,
        **correction,
        **out.distilled,
    }
    if idle:
        loss_metrics, own = dict.fromkeys(loss_metrics, 0.0), dict.fromkeys(own, 0.0)
        maxima = dict.fromkeys(maxima, 0.0)
    sums.add_loss_metrics(**loss_metrics)
    sums.add(**own)
    sums.add_max(**maxima)


def step_figures(
    sums: StepSums, norm: float, grad_norm: float, skipped: bool, algo: AlgoParams
) -> dict[str, float]:
    """An optimizer step's figures from its complete sums (all ranks'): the loss's metrics over
    the normaliser `norm` (counts as they are, per-token figures per response token), entropy,
    staleness, the gradient norm, whether the step was skipped, the correction's and the
    behaviour figures, and the totals."""
    num_response_tokens = max(sums["num_response_tokens"], 1.0)
    divisor = {k: 1.0 for k in COUNT_METRICS} | {k: num_response_tokens for k in TOKEN_METRICS}
    out = {k: sums[k] / divisor.get(k, norm) for k in sums.loss_metrics}
    out["entropy"] = sums["entropy_sum"] / num_response_tokens
    out["stale_token_frac"] = sums["num_stale_tokens"] / num_response_tokens
    out["grad_norm"] = float(grad_norm)
    out["skipped_steps"] = float(skipped)
    out["num_response_tokens"] = sums["num_response_tokens"]
    if algo.corrects:
        out |= correction_figures(sums.values, sums.maxima)
        out["num_correction_tokens"] = sums["num_correction_tokens"]
    out |= distill_figures(sums.values)
    return out | behaviour_figures(sums) | {k: sums[k] for k in TOTALS}


def behaviour_sums(
    logprobs: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor
) -> tuple[dict[str, float], dict[str, float]]:
    """The step sums and maxima of |behaviour log-prob - learner's log-prob| over the tokens
    where `mask` is 1 (fresh rows' response tokens before the iteration's first step)."""
    diff = torch.where(mask > 0, (logprobs.detach() - behaviour).abs(), 0.0)  # (B, T)
    sums = {
        "behaviour_logprob_abs_diff_sum": float(diff.sum()),
        "num_fresh_tokens": float(mask.sum()),
    }
    return sums, {"behaviour_logprob_abs_diff_max": float(diff.max()) if diff.numel() else 0.0}


def ratio_deviation(out: Passes, mask: torch.Tensor) -> float:
    """The largest |pi / pi_old - 1| of the loss over the tokens where `mask` is 1: before the
    iteration's first step, on fresh rows, the policy is pi_old and this is 0 up to float noise
    (a learning gate: `first_step_ratio_abs_dev_max`). Measured only where pi_old is not the
    policy's own log-probs detached (a pass of its own with `learner.reuse_old_logprobs` off or
    several optimizer steps; the behaviour log-probs under the bypass): reused, the ratio is 1 by
    construction."""
    if out.old_logprobs is None or not bool(mask.any()):
        return 0.0
    ratio = (out.logprobs.detach() - out.old_logprobs).exp()  # (B, T)
    return float(torch.where(mask > 0, (ratio - 1).abs(), 0.0).max())


def behaviour_figures(sums: StepSums) -> dict[str, float]:
    """`BEHAVIOUR_FIGURES` of a step whose sums are complete (all ranks'); none without a fresh
    token."""
    tokens = sums["num_fresh_tokens"]
    if tokens == 0:
        return {}
    out = {
        "behaviour_logprob_abs_diff_mean": sums["behaviour_logprob_abs_diff_sum"] / tokens,
        "behaviour_logprob_abs_diff_max": sums.maxima["behaviour_logprob_abs_diff_max"],
    }
    if "first_step_ratio_abs_dev_max" in sums.maxima:
        out["first_step_ratio_abs_dev_max"] = sums.maxima["first_step_ratio_abs_dev_max"]
    return out


def iteration_stats(steps: list[dict[str, float]], frozen_copies_bytes: int) -> dict[str, float]:
    """One iteration's figures from its optimizer steps' outputs: counts and totals add up over
    the steps, the behaviour figures are the first step's, a largest (smallest) value is the
    steps' largest (smallest), every other figure is their mean over the steps that report it
    (a teacher's, over the steps with its rows). The correction's figures come from the steps
    that had correction tokens only (a step without reports 0s, which are no ratio)."""
    totals = {k: sum(s[k] for s in steps) for k in TOTALS}
    counts = (*COUNT_METRICS, "skipped_steps", "num_correction_tokens")
    summed = {*TOTALS, *counts, *BEHAVIOUR_FIGURES, *LARGEST_FIGURES, *SMALLEST_FIGURES}
    corrected = [s for s in steps if s.get("num_correction_tokens", 0) > 0] or steps

    def over(key: str) -> list[float]:  # the steps that report `key` (a teacher's, with rows)
        return [s[key] for s in (corrected if key in CORRECTION_FIGURES else steps) if key in s]

    names = dict.fromkeys(k for s in steps for k in s)
    return (
        {k: sum(over(k)) / len(over(k)) for k in names if k not in summed and over(k)}
        | {k: steps[0][k] for k in BEHAVIOUR_FIGURES if k in steps[0]}
        | {k: max(over(k)) for k in LARGEST_FIGURES if k in steps[0]}
        | {k: min(over(k)) for k in SMALLEST_FIGURES if k in steps[0]}
        | {k: sum(s[k] for s in steps) for k in counts if k in steps[0]}
        | {
            "num_tokens": totals["num_tokens"],
            "tokens_computed": totals["tokens_computed"],
            "positions_computed": totals["positions_computed"],
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
