"""The Scorer: what a group is worth to the loss, computed once, between the staleness check and
the trainer (pipeline/loop.py). Shaped rewards, advantages and the `reinforce` baseline live here
and nowhere else; trainers, one process or ranks, take the scored groups as they are.

Read on: docs/learner.md#how-it-is-built.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from cadence.algo import (
    AdvantageContext,
    AlgoParams,
    get_advantage,
    is_batch_advantage,
    overlong_penalty,
)
from cadence.types import Completion, Group


@dataclass
class Scored:
    """One group with what the scorer computed for it: what a trainer takes."""

    group: Group
    rewards: torch.Tensor  # (G,) raw reward + overlong penalty: what the advantages come from
    advantages: torch.Tensor  # (G,)
    trains: torch.Tensor  # (G,) bool: False for a response dropped from the loss

    @property
    def num_tokens(self) -> int:
        return self.group.num_tokens


class Scorer:
    """Shaping, advantages and the baseline for one run (see the module docstring)."""

    def __init__(self, params: AlgoParams) -> None:
        self.params = params
        get_advantage(params.advantage)  # an unknown name fails here, not at the first group
        self.batch_wide = is_batch_advantage(params.advantage)
        self.baseline = 0.0  # previous iteration's mean shaped reward (for "reinforce")
        self._scored: list[Scored] = []  # this iteration's, for its figures and the baseline

    def score(self, groups: Iterable[Group]) -> Iterator[Scored]:
        """Each group with its shaped rewards and advantages, one at a time as they come, or,
        for an estimator over the whole batch, all of the iteration's groups at once."""
        if self.batch_wide:
            batch = score(list(groups), self.params, self.baseline)
            self._scored += batch
            yield from batch
            return
        for group in groups:
            scored = score([group], self.params, self.baseline)
            self._scored += scored
            yield from scored

    def end_iteration(self) -> dict[str, float]:
        """The iteration's scoring figures; the baseline becomes its mean shaped reward."""
        scored, self._scored = self._scored, []
        if not scored:
            return {}
        self.baseline = float(torch.cat([s.rewards for s in scored]).mean())
        return reward_figures(scored, self.params)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the baseline (exact resume needs it)."""
        return {"baseline": self.baseline}

    def load_state(self, state: dict[str, Any]) -> None:
        self.baseline = float(state["baseline"])


def score(groups: list[Group], params: AlgoParams, baseline: float = 0.0) -> list[Scored]:
    """Shaped rewards and advantages of `groups` computed together (one group, or a whole batch
    for an estimator that normalises over the batch)."""
    if not groups:
        return []
    lengths = torch.tensor([[policy_tokens(c) for c in g.completions] for g in groups])  # (N, G)
    raw = torch.tensor([g.rewards for g in groups], dtype=torch.float32)  # (N, G)
    rewards = raw + overlong_penalty(
        lengths, params.max_policy_tokens, params.overlong_buffer, params.overlong_penalty
    )  # (N, G)
    trains = torch.tensor(
        [
            [not (params.mask_truncated and c.finish_reason == "length") for c in g.completions]
            for g in groups
        ]
    )  # (N, G)
    ctx = AdvantageContext(
        scale_by_std=params.scale_by_std,
        std=params.std,
        std_eps=params.std_eps,
        baseline=baseline,
        lengths=torch.where(trains, lengths, 0),  # tokens each response trains
    )
    advantages = get_advantage(params.advantage)(rewards, ctx)  # (N, G)
    return [Scored(g, rewards[i], advantages[i], trains[i]) for i, g in enumerate(groups)]


def policy_tokens(c: Completion) -> int:
    """Tokens the policy wrote in a response: its `loss_mask` ones (all of a single turn)."""
    return len(c.token_ids) if c.loss_mask is None else sum(c.loss_mask)


def reward_figures(scored: list[Scored], params: AlgoParams) -> dict[str, float]:
    """The fraction of responses cut (finish_reason "length") and, with the overlong penalty on,
    the mean shaped reward and mean penalty (the raw reward_mean is the run loop's)."""
    completions = [c for s in scored for c in s.group.completions]
    truncated = sum(c.finish_reason == "length" for c in completions)
    out = {"truncated_frac": truncated / len(completions)}
    if params.overlong_buffer > 0:
        shaped = torch.cat([s.rewards for s in scored])  # (num samples,)
        raw = torch.tensor([c.reward for c in completions])  # (num samples,)
        out["reward_shaped_mean"] = float(shaped.mean())
        out["overlong_penalty_mean"] = float((shaped - raw).mean())
    return out
