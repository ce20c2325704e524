"""The one-process trainer: consumes scored groups, runs each micro-batch's passes and backward,
steps the optimizer. It satisfies the Trainer seam (learner/trainer.py); each of a sharded
learner's ranks runs one too (learner/rank.py, through `Collective`).

Each micro-batch's loss is an unnormalised weighted sum and gradients are divided by the global
batch's normaliser at step time, so the update does not depend on micro-batching or arrival
order. What a micro-batch computes (layout, log-probs, loss) is `Forward`'s
(learner/forward.py); here are the optimizer, its schedule, float32 masters and the step. It
never branches on an algorithm's name and never computes a reward or an advantage (the
Scorer's). docs/learner.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from cadence.algo import AlgoParams, normaliser
from cadence.choices import loss_kind
from cadence.learner.distill import Teachers
from cadence.learner.forward import Forward
from cadence.learner.params import Collective, LearnerParams
from cadence.learner.precision import Masters
from cadence.learner.scorer import Scored
from cadence.learner.steps import BadSteps, micro_batches
from cadence.learner.sums import (
    StepSums,
    iteration_stats,
    peak_memory,
    record_micro_batch,
    step_figures,
)
from cadence.learner.tensors import scalar
from cadence.metrics.trace import Tracer

__all__ = ["Collective", "Learner", "LearnerParams"]


class Learner:
    """The one-process trainer (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        params: LearnerParams,
        algo: AlgoParams,
        pad_id: int,
        ref_model: torch.nn.Module | None = None,
        tracer: Tracer | None = None,
        collective: Collective | None = None,
        track: str = "learner",
        masters: Masters | None = None,
        teachers: Teachers | None = None,
    ) -> None:
        self.model = model
        self.collective = collective
        self.track = track  # the timeline's track of this learner's spans (a rank's own)
        self.params = params
        self.algo = algo
        self.tracer = tracer or Tracer()
        # Built before the layout check runs the model: a forward pass of an FSDP2-sharded model
        # swaps its root's parameters for unsharded ones until the next backward.
        self.masters = masters  # float32 masters of a bf16 model (learner/precision.py)
        self.trained = (
            masters.params if masters else [p for p in model.parameters() if p.requires_grad]
        )
        self.optimizer = torch.optim.AdamW(
            self.trained,
            lr=params.lr,
            weight_decay=params.weight_decay,
        )
        warmup = max(params.warmup_steps, 1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup)
        )
        self.forward = Forward(model, params, algo, pad_id, ref_model, collective, teachers)
        self.version = 0  # policy version: number of iterations trained
        self._steps_this_iteration = 0
        self.bad_steps = BadSteps(params.max_bad_steps)

    def allocate_state(self) -> None:
        """The optimizer's state (AdamW's moments, zeros, on each parameter's device) made now
        rather than at the first step, exactly as AdamW makes it: what the GPU must hold for the
        whole run is then held before an engine beside the learner measures what is free."""
        for p in self.trained:
            state = self.optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @property
    def layout(self) -> str:
        """The micro-batch layout the passes use (learner/packing.py)."""
        return self.forward.layout

    @property
    def frozen_copies_bytes(self) -> int:
        """Bytes of the frozen reference and old copies."""
        return self.forward.frozen_copies_bytes

    def close(self) -> None:
        """Nothing to release: this learner lives in the run's process (or in its rank's)."""

    def state(self, directory: Path) -> dict[str, Any]:
        """The optimizer's state, the schedule, the version and the bad-step count (the policy's
        weights are the checkpoint's own); nothing is written to `directory`."""
        return {
            "ranks": 1,
            "version": self.version,
            "bad_steps_in_a_row": self.bad_steps.in_a_row,
            "optimizer": self.optimizer.state_dict(),
            "masters": self.masters.state() if self.masters else [],
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state(self, directory: Path, state: dict[str, Any]) -> None:
        """Continue from what `state` returned (the policy's weights loaded already)."""
        if state.get("ranks") != 1:
            raise ValueError(
                f"{directory}: trainer state written by {state.get('ranks')} learner ranks "
                "cannot be read by a single-process learner"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        if self.masters is not None:
            self.masters.load(state["masters"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = state["version"]
        self.bad_steps.in_a_row = state["bad_steps_in_a_row"]

    def train_iteration(self, scored: Iterable[Scored], num_groups: int) -> dict[str, Any]:
        """Train on `num_groups` scored groups as they come, in micro-batches; step after each
        mini-batch's last group (learner/steps.py: fewer may come, and what did is trained)."""
        self.begin_iteration()
        sums, steps = StepSums(), []
        p = self.params
        chunks = micro_batches(
            scored,
            num_groups,
            p.mini_batches,
            p.micro_batch_groups,
            p.micro_batch_tokens,
            loss_kind(self.algo.loss).whole_groups,
            self.forward.layout,
        )
        for chunk, ends_step in chunks:
            if chunk:
                self.forward_backward(chunk, sums)
            if ends_step and sums.values:
                steps.append(self.step(sums))
                sums = StepSums()
        if not steps:
            raise RuntimeError(f"learner got no groups (expected {num_groups})")
        self.version += 1
        device = next(self.model.parameters()).device
        memory = {f"learner_{k}": v for k, v in peak_memory(device).items()}
        return iteration_stats(steps, self.frozen_copies_bytes) | {"learner_ranks": 1} | memory

    def begin_iteration(self, version: int | None = None) -> None:
        """Training mode; the old copy (if any) becomes the policy at the iteration's start.
        `version`: the policy version the iteration trains at, when another keeps count (a
        rank's driver); by default the learner's own."""
        if version is not None:
            self.version = version
        self.forward.begin_iteration()
        self._steps_this_iteration = 0

    def forward_backward(self, scored: list[Scored], sums: StepSums, idle: bool = False) -> None:
        """Log-probs, loss and backward of one micro-batch (groups with their advantages, from
        the Scorer); its sums added to `sums`.

        `idle`: the same passes with the loss multiplied by 0 (gradients 0), every sum recorded
        as 0: a rank without groups in a round runs one to keep in step with the others."""
        with self.tracer.span("forward_backward", self.track):
            stepped = self._steps_this_iteration > 0
            passes = self.forward.passes(scored, self.version, stepped)
            (passes.loss * 0.0 if idle else passes.loss).backward()
            if self.masters is not None:
                self.masters.collect_grads()
        # before the iteration's first step the policy is the behaviour policy of fresh rows
        first = self._steps_this_iteration == 0
        record_micro_batch(sums, passes, [s.group for s in scored], first, idle)

    def _normaliser(self, sums: StepSums) -> float:
        # a pair loss: the mean over the global batch's pairs; none (all ties): gradients are 0
        if self.forward.pair_loss:
            return max(sums["num_pairs"], 1.0)
        if sums["num_response_tokens"] == 0:  # every response dropped or empty: grads are 0
            return 1.0
        return normaliser(
            self.algo.loss_agg,
            num_tokens=int(sums["num_response_tokens"]),
            num_seqs=int(sums["num_seqs"]),
            max_new_tokens=self.algo.max_policy_tokens,
        )

    def step(self, sums: StepSums) -> dict[str, float]:
        """Divide the gradients by the global batch's normaliser, clip, step (unless the loss or
        gradient is not finite); the step's figures."""
        with self.tracer.span("optimizer_step", self.track):
            if self.collective is not None:
                self.collective.reduce_sums(sums)
            norm = self._normaliser(sums)
            for p in self.trained:
                if p.grad is not None:
                    p.grad.div_(norm)
            grad_norm = scalar(
                torch.nn.utils.clip_grad_norm_(self.trained, self.params.max_grad_norm)
            )
            bad = not (math.isfinite(grad_norm) and math.isfinite(sums["loss"]))
            if not bad:
                self.optimizer.step()
                self.scheduler.step()
                if self.masters is not None:
                    self.masters.publish()
            self.optimizer.zero_grad(set_to_none=True)
            self._steps_this_iteration += 1
        self.bad_steps.count(bad)
        return step_figures(sums, norm, grad_norm, bad, self.algo)
