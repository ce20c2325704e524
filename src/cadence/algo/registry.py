"""Name -> function tables for advantage estimators and losses.

The learner looks its algorithm up here by the config's name and never branches on it; a new
loss is added by inserting it into `LOSSES` (its traits, such as being normalised per preference
pair like online DPO, are its row in `cadence.choices`), a new estimator into `ADVANTAGES` (and into
`BATCH_ADVANTAGES` when it needs the whole batch's rewards at once). Nothing here holds state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from torch import Tensor

from cadence.algo.advantages import (
    STD_EPS,
    grpo_advantages,
    reinforce_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from cadence.algo.dpo import online_dpo_loss
from cadence.algo.losses import (
    PolicyBatch,
    cispo_loss,
    gspo_loss,
    pg_loss,
    ppo_clip_loss,
    rloo_loss,
)
from cadence.algo.params import AlgoParams
from cadence.choices import ADVANTAGES as ADVANTAGE_NAMES
from cadence.choices import LOSS_KINDS
from cadence.choices import LOSSES as LOSS_NAMES

AdvantageFn = Callable[[Tensor, "AdvantageContext"], Tensor]  # rewards (N, G) -> (N, G)
LossFn = Callable[[PolicyBatch, AlgoParams], tuple[Tensor, dict[str, Tensor]]]
F = TypeVar("F")


@dataclass(frozen=True)
class AdvantageContext:
    """Everything any estimator may need beyond the rewards, so callers never branch on names."""

    scale_by_std: bool = True  # GRPO: divide by the group's std (False: Dr. GRPO)
    std: str = "unbiased"  # GRPO, REINFORCE++: "unbiased" or "population" std
    std_eps: float = STD_EPS  # added to that std
    baseline: float = 0.0  # REINFORCE: e.g. the previous iteration's mean reward
    lengths: Tensor | None = None  # (N, G) tokens each response trains (REINFORCE++)


def _grpo(rewards: Tensor, ctx: AdvantageContext) -> Tensor:
    return grpo_advantages(rewards, ctx.scale_by_std, eps=ctx.std_eps, std=ctx.std)


def _rloo(rewards: Tensor, ctx: AdvantageContext) -> Tensor:
    return rloo_advantages(rewards)


def _reinforce(rewards: Tensor, ctx: AdvantageContext) -> Tensor:
    return reinforce_advantages(rewards, baseline=ctx.baseline)


def _reinforce_pp(group_baseline: bool) -> AdvantageFn:
    def estimator(rewards: Tensor, ctx: AdvantageContext) -> Tensor:
        if ctx.lengths is None:
            raise ValueError("reinforce_pp needs each response's token count (lengths); got None")
        return reinforce_pp_advantages(
            rewards, ctx.lengths, group_baseline, eps=ctx.std_eps, std=ctx.std
        )

    return estimator


ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": _grpo,
    "rloo": _rloo,
    "reinforce": _reinforce,
    "reinforce_pp": _reinforce_pp(group_baseline=False),
    "reinforce_pp_baseline": _reinforce_pp(group_baseline=True),
}
# Estimators whose advantages depend on the whole batch (not one group at a time): the learner
# computes them once over every group of the iteration, before its first micro-batch.
BATCH_ADVANTAGES = frozenset({"reinforce_pp", "reinforce_pp_baseline"})
LOSSES: dict[str, LossFn] = {
    "ppo_clip": ppo_clip_loss,
    "pg": pg_loss,
    "rloo": rloo_loss,
    "online_dpo": online_dpo_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
}
# Losses over preference pairs rather than tokens: the learner divides their sum by the global
# batch's number of pairs (their `num_pairs` metric), they need the frozen reference, and they
# read no old_logprobs (no importance ratio).
PAIR_LOSSES = frozenset(name for name, kind in LOSS_KINDS.items() if kind.pairs)
# one list of names for the registries and the config's allowed values (cadence.choices)
assert tuple(ADVANTAGES) == ADVANTAGE_NAMES and tuple(LOSSES) == LOSS_NAMES


def _lookup(table: dict[str, F], kind: str, name: str) -> F:
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; allowed: {', '.join(table)}")
    return table[name]


def get_advantage(name: str) -> AdvantageFn:
    """The advantage estimator registered as `name` (config key `algo.advantage`)."""
    return _lookup(ADVANTAGES, "algo.advantage", name)


def get_loss(name: str) -> LossFn:
    """The policy loss registered as `name` (config key `algo.loss`)."""
    return _lookup(LOSSES, "algo.loss", name)


def is_batch_advantage(name: str) -> bool:
    """Whether estimator `name` needs the whole batch's rewards at once (see `BATCH_ADVANTAGES`)."""
    return name in BATCH_ADVANTAGES


def is_pair_loss(name: str) -> bool:
    """Whether loss `name` is normalised per preference pair (see `PAIR_LOSSES`)."""
    return name in PAIR_LOSSES


def needs_reference(loss: str, kl_coef: float) -> bool:
    """Whether training needs the frozen reference model: for the KL penalty, or a pair loss."""
    return kl_coef > 0 or is_pair_loss(loss)
