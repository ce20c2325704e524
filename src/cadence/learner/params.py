"""What the learner is told besides the algorithm: how it steps and lays out its work
(`LearnerParams`), and how a learner that is one of several ranks differs (`Collective`).
Plain records; docs/learner.md, docs/ranks.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cadence.learner.sums import StepSums


@dataclass(frozen=True)
class LearnerParams:
    """How the learner steps and lays out its work; the algorithm is `AlgoParams`."""

    lr: float = 1e-4
    warmup_steps: int = 0  # linear learning-rate warm-up over the first optimizer steps
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch_groups: int = 4
    micro_batch_tokens: int = 0  # micro-batches packed up to this many tokens instead (0: off)
    mini_batches: int = 1
    temperature: float = 1.0  # log-probs are of softmax(logits / temperature), as sampled
    shared_prompt: bool = True  # compute each group's prompt once for its G responses
    shared_prompt_impl: str = "prefix"  # "prefix" (prompt K/V reused) or "dense" (4-D mask)
    reuse_old_logprobs: bool = True  # before the first step, old_logprobs = policy's, detached
    max_bad_steps: int = 3  # steps in a row with a non-finite loss or gradient before giving up
    logits_chunk_tokens: int = 1024  # log-probs this many tokens at a time (0: full logits)
    activation_checkpointing: bool = False  # recompute each decoder layer in the backward
    disable_dropout: bool = True  # dropout off in the policy (TRL's default for RL)


@dataclass(frozen=True)
class Collective:
    """How a learner that is one of several torch.distributed ranks differs from a lone one
    (learner/rank.py builds it). Each rank trains its own micro-batches; with a `Collective`:

    - `reduce_sums` turns this rank's step sums into the sums (and maxima) over all ranks, in
      place, before the step normalises, so every rank divides by the global batch's normaliser
      and takes one decision on a non-finite loss;
    - every micro-batch runs the same passes whatever its rows (a pass of a sharded model is a
      collective every rank must join), and an `idle` pass keeps a rank without groups in step;
    - forward passes go through `forward_model` (a DDP wrapper) when given, and the frozen old
      copy is made by `old_copy` (sharded like the policy) instead of a deep copy.
    """

    reduce_sums: Callable[[StepSums], None]
    forward_model: torch.nn.Module | None = None
    old_copy: Callable[[torch.nn.Module], torch.nn.Module] | None = None
