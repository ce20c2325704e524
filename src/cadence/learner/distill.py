"""On-policy distillation in the learner: a teacher's log-probs of the tokens the student
sampled, and the per-token advantage they make.

A teacher is a frozen model beside the reference: its log-probs come from a no-grad pass over the
micro-batch's own layout (packed, shared prompt), so it costs one forward a micro-batch per
teacher the micro-batch's rows need. The advantage of token t is
coef * (log pi_teacher(y_t) - log pi_student(y_t)) plus reward_coef times the reward's advantage:
through the policy-gradient losses it is the gradient of the sampled per-token reverse KL. It
never loads a model (the builder does) and knows no config. docs/distillation.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from cadence.models.scoring import teacher_key


@dataclass(frozen=True)
class DistillParams:
    coef: float = 1.0
    reward_coef: float = 0.0


@dataclass
class Distilled:
    """A micro-batch's distillation: the per-token advantages (B, T) and the sums of its
    figures (`distill_kl_sum`, `distill_tokens`, and per teacher with several)."""

    advantages: Tensor
    sums: dict[str, float]
    passes: int  # teacher passes it took


class Teachers:
    """The teachers of a run: task label -> frozen model (`ANY_TASK` for one teacher of every
    prompt), each named by its label in the per-teacher figures; a model None where a teacher
    stage scores the rows instead (their `teacher_logprobs`). `every_pass`: every teacher
    scores every micro-batch, in one order, whatever its rows' tasks (sharded teachers, whose
    passes are collectives every rank must make alike)."""

    def __init__(
        self,
        models: dict[str, torch.nn.Module | None],
        params: DistillParams,
        every_pass: bool = False,
    ) -> None:
        if not models:
            raise ValueError("distillation needs at least one teacher")
        self.models, self.params, self.every_pass = models, params, every_pass

    @property
    def any_task(self) -> str:
        """A task some teacher scores (an idle rank's placeholder rows take it)."""
        return next(iter(self.models))

    @property
    def staged(self) -> bool:
        """Whether a teacher stage scores the rows (the learner holds no teacher)."""
        return all(m is None for m in self.models.values())

    def teacher_of(self, task: str) -> str:
        return teacher_key(self.models, task)

    def distill(
        self,
        tasks: Sequence[str],
        student: Tensor,
        mask: Tensor,
        reward_advantages: Tensor,
        logprobs_of: Callable[[torch.nn.Module], Tensor],
        scored: Tensor | None = None,
    ) -> Distilled:
        """Rows' `tasks` (B,), the student's log-probs (B, T; detached here), the loss mask,
        the reward's advantages (B,) and `logprobs_of(model)`, a teacher's (B, T) log-probs of
        the micro-batch, or `scored`, the (B, T) a teacher stage wrote: the advantages and the
        figures' sums."""
        keys = [self.teacher_of(t) for t in tasks]
        rows = {  # teacher -> (B, 1) its rows
            key: torch.tensor([k == key for k in keys], device=student.device)[:, None]
            for key in self.models
        }
        teacher, needed = torch.zeros_like(student), dict.fromkeys(keys)
        if self.every_pass:
            needed = dict.fromkeys(self.models)
        if scored is not None:
            teacher, needed = scored.to(student.dtype), {}
        elif self.staged:
            raise ValueError("distillation: rows reached the learner without teacher log-probs")
        for key in needed:  # each teacher the rows need, once
            teacher = torch.where(rows[key], logprobs_of(self.models[key]), teacher)
        valid = mask != 0
        gap = torch.where(valid, teacher - student.detach(), 0.0)  # (B, T) log pT - log pS
        p = self.params
        advantages = p.coef * gap + p.reward_coef * reward_advantages[:, None]
        sums = {"distill_kl_sum": float(-gap.sum()), "distill_tokens": float(valid.sum())}
        if len(self.models) > 1:
            for key, own in rows.items():
                sums[f"distill_kl_sum/{key}"] = float(-(gap * own).sum())
                sums[f"distill_tokens/{key}"] = float((valid & own).sum())
        return Distilled(torch.where(valid, advantages, 0.0), sums, len(needed))


def distill_figures(sums: dict[str, float]) -> dict[str, float]:
    """`distill_reverse_kl` (and `distill_reverse_kl/<task>` per teacher with several): the mean
    over response tokens of log pi_student - log pi_teacher of the sampled token, from a step's
    complete sums."""
    out = {}
    for name, value in sums.items():
        if name.startswith("distill_kl_sum"):
            suffix = name[len("distill_kl_sum") :]
            tokens = sums.get(f"distill_tokens{suffix}", 0.0)
            if tokens:
                out[f"distill_reverse_kl{suffix}"] = value / tokens
    return out
