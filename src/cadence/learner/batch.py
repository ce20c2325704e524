"""A micro-batch's response-aligned tensors: what the learner's passes and the loss read.

The scored groups of one micro-batch (learner/scorer.py) become right-padded response tokens,
their behaviour log-probs and the loss mask (1 on the tokens the policy wrote and trains, 0 on an
environment's reply, on padding and on a response dropped from the loss), with each row's
advantage, shaped reward, group and staleness. Nothing here computes a reward or an advantage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadence.learner.scorer import Scored


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
    teacher_logprobs: torch.Tensor | None = None  # (B, T) a teacher stage's, where one scored


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
    out = Responses(*(t.to(device) for t in (tokens, mask, behaviour, *per_row)))
    if any(c.teacher_logprobs is not None for c in completions):
        teacher = torch.zeros((len(completions), width))  # (B, T)
        for b, c in enumerate(completions):
            if c.teacher_logprobs is None:
                raise ValueError("a micro-batch's responses have teacher log-probs, but not all")
            teacher[b, : len(c.teacher_logprobs)] = torch.tensor(c.teacher_logprobs)
        out.teacher_logprobs = teacher.to(device)
    return out
