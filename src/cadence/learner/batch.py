"""What the learner makes of groups before the loss: shaped rewards, advantages, the loss mask.

Rewards are shaped here, in the learner, from each response's length and the episode's cap
(DAPO's overlong penalty, `algo/shaping.py`), so the shaping is the same wherever the raw reward
was computed (in the rollout worker or in a reward stage) and the reward recorded with each sample
stays the raw score (`reward_mean` in metrics is raw; the learner reports `reward_shaped_mean`).
The shaped rewards are what every estimator and reward-reading loss sees (GRPO, RLOO, online DPO's
pairs, REINFORCE's baseline). With `mask_truncated`, a response that was cut (finish_reason
"length") keeps its place in its group's statistics but trains no token: to the loss it is an
empty response, which still counts in seq-mean's and seq-sum-norm's number of sequences (as TRL's
`mask_truncated_completions`).

A response's length is the tokens the policy wrote: its `loss_mask` ones (every token of a
single-turn response). A multi-turn episode's tool replies are not the policy's, so they count in
neither the overlong penalty nor REINFORCE++'s token weights (nor, in the learner, the loss's
tokens): an episode that used a tool is measured like one that did not. The cap is the episode's,
`max_policy_tokens`, the most tokens the policy can write in one episode: `rollout.max_new_tokens`
single-turn; with tools each of at most `env.max_turns` turns writes at most
`rollout.max_new_tokens`, and everything after the prompt fits `env.max_total_tokens`, so the
smaller of `env.max_turns x rollout.max_new_tokens` and `env.max_total_tokens`
(`Config.max_policy_tokens`). The same cap is seq-sum-norm's constant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadence.algo import AdvantageContext, AdvantageFn, overlong_penalty
from cadence.types import Completion, Group


@dataclass(frozen=True)
class Shaping:
    """How rewards and the loss mask are derived from the samples."""

    max_policy_tokens: int  # the episode's cap on tokens the policy writes (module docstring)
    overlong_buffer: int = 0  # tokens before that cap where the penalty ramps up; 0: off
    overlong_penalty: float = 1.0  # penalty of a response at the cap
    mask_truncated: bool = False  # drop cut responses (finish_reason "length") from the loss


@dataclass
class Scored:
    """One group with what the learner computed for it."""

    group: Group
    rewards: torch.Tensor  # (G,) raw reward + overlong penalty: what the advantages come from
    advantages: torch.Tensor  # (G,)
    trains: torch.Tensor  # (G,) bool: False for a response dropped from the loss

    @property
    def num_tokens(self) -> int:
        return self.group.num_tokens


@dataclass
class Responses:
    """Response-aligned tensors of one micro-batch (B responses, T = longest response)."""

    tokens: torch.Tensor  # (B, T) response token ids, right-padded
    loss_mask: torch.Tensor  # (B, T) 1.0 on response tokens, 0 on a response dropped from the loss
    behaviour_logprobs: torch.Tensor  # (B, T) recorded by the engine at sampling time
    advantages: torch.Tensor  # (B,)
    rewards: torch.Tensor  # (B,) shaped
    group_ids: torch.Tensor  # (B,) index of each response's group in the micro-batch
    stale: torch.Tensor  # (B,) True where the group's policy_version is older than the learner's


def score(
    groups: list[Group], advantage_fn: AdvantageFn, ctx: AdvantageContext, shaping: Shaping
) -> list[Scored]:
    """Shaped rewards and advantages of `groups` computed together (one group, or a whole batch
    for an estimator that normalises over the batch)."""
    if not groups:
        return []
    lengths = torch.tensor([[policy_tokens(c) for c in g.completions] for g in groups])  # (N, G)
    raw = torch.tensor([g.rewards for g in groups], dtype=torch.float32)  # (N, G)
    rewards = raw + overlong_penalty(
        lengths, shaping.max_policy_tokens, shaping.overlong_buffer, shaping.overlong_penalty
    )  # (N, G)
    trains = torch.tensor(
        [
            [not (shaping.mask_truncated and c.finish_reason == "length") for c in g.completions]
            for g in groups
        ]
    )  # (N, G)
    ctx = AdvantageContext(
        scale_by_std=ctx.scale_by_std,
        std=ctx.std,
        std_eps=ctx.std_eps,
        baseline=ctx.baseline,
        lengths=torch.where(trains, lengths, 0),  # tokens each response trains
    )
    advantages = advantage_fn(rewards, ctx)  # (N, G)
    return [Scored(g, rewards[i], advantages[i], trains[i]) for i, g in enumerate(groups)]


def policy_tokens(c: Completion) -> int:
    """Tokens the policy wrote in a response: its `loss_mask` ones (all of a single turn)."""
    return len(c.token_ids) if c.loss_mask is None else sum(c.loss_mask)


def responses(scored: list[Scored], pad_id: int, version: int, device: torch.device) -> Responses:
    """Pads a micro-batch's responses and lays out their per-row tensors."""
    groups = [s.group for s in scored]
    sizes = torch.tensor([g.group_size for g in groups])
    group_ids = torch.repeat_interleave(torch.arange(len(groups)), sizes)  # (B,)
    stale = torch.tensor([g.policy_version < version for g in groups])  # (N,)
    completions = [c for g in groups for c in g.completions]
    trains = torch.cat([s.trains for s in scored])  # (B,)
    width = max([len(c.token_ids) for c in completions] + [1])
    tokens = torch.full((len(completions), width), pad_id, dtype=torch.long)  # (B, T)
    behaviour = torch.zeros((len(completions), width))  # (B, T)
    mask = torch.zeros((len(completions), width))  # (B, T)
    for b, c in enumerate(completions):
        n = len(c.token_ids)
        tokens[b, :n] = torch.tensor(c.token_ids, dtype=torch.long)
        behaviour[b, :n] = torch.tensor(c.logprobs)
        kept = 1.0 if c.loss_mask is None else torch.tensor(c.loss_mask, dtype=torch.float32)
        mask[b, :n] = float(trains[b]) * kept  # loss_mask 0: an environment's token
    advantages = torch.cat([s.advantages for s in scored])  # (B,)
    rewards = torch.cat([s.rewards for s in scored])  # (B,)
    per_row = (advantages, rewards, group_ids, stale[group_ids])
    return Responses(*(t.to(device) for t in (tokens, mask, behaviour, *per_row)))


def reward_figures(scored: list[Scored], shaping: Shaping) -> dict[str, float]:
    """The fraction of responses cut (finish_reason "length") and, with the overlong penalty on,
    the mean shaped reward and mean penalty (the raw reward_mean is the run loop's)."""
    completions = [c for s in scored for c in s.group.completions]
    truncated = sum(c.finish_reason == "length" for c in completions)
    out = {"truncated_frac": truncated / len(completions)}
    if shaping.overlong_buffer > 0:
        shaped = torch.cat([s.rewards for s in scored])  # (num samples,)
        raw = torch.tensor([c.reward for c in completions])  # (num samples,)
        out["reward_shaped_mean"] = float(shaped.mean())
        out["overlong_penalty_mean"] = float((shaped - raw).mean())
    return out
