"""Helpers for tests that claim two training runs make the same update.

Adam's first step moves a parameter by lr * g / (|g| + eps). Where |g| is near eps (1e-8), that
step magnifies float noise in g without bound: two computations of the same gradient that agree
to 1e-7 relative can move such an entry by visibly different amounts. So "the same update" is
checked in two parts, each with an explicit tolerance: the gradients the optimizer sees agree
everywhere, and the parameters agree wherever the step is well-conditioned (|g| >> eps).
"""

from __future__ import annotations

import torch


def capture_grads(learner, seen: list | None = None) -> list[dict[str, torch.Tensor]]:
    """Record the gradients each optimizer step of `learner` sees (one dict per step), into
    `seen` if given; the list fills as the learner steps."""
    seen = [] if seen is None else seen
    names = {id(p): n for n, p in learner.model.named_parameters()}

    def hook(optimizer, args, kwargs):
        seen.append(
            {
                names[id(p)]: p.grad.detach().clone()
                for group in optimizer.param_groups
                for p in group["params"]
                if p.grad is not None
            }
        )

    learner.optimizer.register_step_pre_hook(hook)
    return seen


def max_relative_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest per-tensor max|a - b| / max|b| over matching names."""
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-30)).item() for k in a)


def assert_same_update(
    model_a: torch.nn.Module,
    model_b: torch.nn.Module,
    grads_a: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]],
    grads_b: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]],
    grad_rtol: float = 1e-5,
    param_atol: float = 1e-6,
    conditioned: float = 1e-6,
) -> None:
    """One step's gradients (a dict) or every step's (a list of dicts, one per optimizer step).
    Parameters are compared where every step was well-conditioned: an entry magnified at one step
    carries that noise into all later ones."""
    steps_a = grads_a if isinstance(grads_a, list) else [grads_a]
    steps_b = grads_b if isinstance(grads_b, list) else [grads_b]
    assert len(steps_a) == len(steps_b) > 0
    for step, (ga, gb) in enumerate(zip(steps_a, steps_b, strict=True)):
        diff = max_relative_diff(ga, gb)
        assert diff <= grad_rtol, f"step {step}: gradients differ by {diff:.2e} relative"
    params_b = dict(model_b.named_parameters())
    for name, pa in model_a.named_parameters():
        well = torch.stack([g[name].abs() > conditioned for g in steps_b]).all(0)
        assert well.any(), name
        diff = (pa - params_b[name]).abs()[well].max().item()
        assert diff <= param_atol, f"{name}: {diff:.2e}"


def assert_same_params(got, want, grads, atol=1e-6, conditioned=1e-6):
    """Parameters equal within `atol` wherever every step of the reference was well-conditioned
    (|g| > `conditioned`, or exactly 0: a step without signal): Adam's step
    lr * g / (|g| + eps) magnifies float noise where |g| is near eps (tests/updates.py). Two runs
    whose sums of micro-batch gradients run in another order (ranks add theirs up in another
    order than one process) differ by such noise only."""
    checked = 0
    for name, want_p in want.items():
        well = torch.ones_like(want_p, dtype=torch.bool)
        for step in grads:
            well &= (step[name].abs() > conditioned) | (step[name] == 0)
        diff = (got[name] - want_p).abs()[well]
        assert diff.numel() == 0 or diff.max().item() <= atol, f"{name}: {diff.max().item():.2e}"
        checked += int(well.sum())
    total = sum(p.numel() for p in want.values())
    assert checked > 0.5 * total  # most entries are compared
