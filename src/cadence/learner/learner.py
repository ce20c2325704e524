"""The one-process trainer: consumes scored groups, computes log-probs and the loss, steps the
optimizer. It satisfies the Trainer seam (learner/trainer.py); each of a sharded learner's ranks
runs one too (learner/rank.py, through `Collective`).

Each micro-batch's loss is an unnormalised weighted sum and gradients are divided by the global
batch's normaliser at step time, so the update does not depend on micro-batching or arrival
order. Log-probs come from as few passes as the algorithm allows (the policy's, the old policy's
reused before the first step, the reference's under no_grad). It never branches on an
algorithm's name and never computes a reward or an advantage (the Scorer's). docs/learner.md.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cadence.algo import (
    AlgoParams,
    PolicyBatch,
    get_loss,
    is_pair_loss,
    needs_reference,
    normaliser,
    token_weights,
)
from cadence.learner.batch import Responses, responses
from cadence.learner.checkpointing import checkpoint_layers
from cadence.learner.logprobs import token_logprobs
from cadence.learner.packing import LAYOUTS, Layout, check_layout, install_checked_head
from cadence.learner.precision import Masters
from cadence.learner.scorer import Scored
from cadence.learner.steps import BadSteps, micro_batches
from cadence.learner.sums import (
    Passes,
    StepSums,
    iteration_stats,
    peak_memory,
    record_micro_batch,
    step_figures,
)
from cadence.learner.tensors import frozen_copy, model_bytes, scalar
from cadence.metrics.trace import Tracer


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
    ) -> None:
        self.model = model
        self.collective = collective
        self.forward_model = (collective and collective.forward_model) or model
        self.track = track  # the timeline's track of this learner's spans (a rank's own)
        self.ref_model = ref_model
        self.params = params
        self.algo = algo
        self.pad_id = pad_id
        self.tracer = tracer or Tracer()
        self.loss_fn = get_loss(algo.loss)
        self.pair_loss = is_pair_loss(algo.loss)
        if needs_reference(algo.loss, algo.kl_coef) and ref_model is None:
            why = "algo.kl_coef > 0" if algo.kl_coef > 0 else f"algo.loss = {algo.loss!r}"
            raise ValueError(f"{why} needs a reference model")
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
        _prepare(model, ref_model, params, pad_id, wrapped=collective is not None)
        self.layout = choose_layout(model, params, pad_id)
        self.bypass = algo.correction_proximal == "bypass"  # old log-probs: the behaviour ones
        after_a_step = params.mini_batches > 1 or not params.reuse_old_logprobs
        # pair losses read no old log-probs; the bypass reads the behaviour ones
        needs_old = after_a_step and not (self.pair_loss or self.bypass)
        old_copy = (collective and collective.old_copy) or frozen_copy
        self.old_model = old_copy(model) if needs_old else None
        self.frozen_copies_bytes = model_bytes(ref_model) + model_bytes(self.old_model)
        self.version = 0  # policy version: number of iterations trained
        self._steps_this_iteration = 0
        self.bad_steps = BadSteps(params.max_bad_steps)

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
            self.pair_loss,
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
        self.forward_model.train()
        if self.old_model is not None:
            self.old_model.load_state_dict(self.model.state_dict())
        self._steps_this_iteration = 0

    def forward_backward(self, scored: list[Scored], sums: StepSums, idle: bool = False) -> None:
        """Log-probs, loss and backward of one micro-batch (groups with their advantages, from
        the Scorer); its sums added to `sums`.

        `idle`: the same passes with the loss multiplied by 0 (gradients 0), every sum recorded
        as 0: a rank without groups in a round runs one to keep in step with the others."""
        with self.tracer.span("forward_backward", self.track):
            passes = self._passes(scored)
            (passes.loss * 0.0 if idle else passes.loss).backward()
            if self.masters is not None:
                self.masters.collect_grads()
        # before the iteration's first step the policy is the behaviour policy of fresh rows
        first = self._steps_this_iteration == 0
        record_micro_batch(sums, passes, [s.group for s in scored], first, idle)

    def _passes(self, scored: list[Scored]) -> Passes:
        """The micro-batch's layout, its passes (policy with grad; old and reference as the
        algorithm needs them) and the loss, not yet backpropagated."""
        groups = [s.group for s in scored]
        device = next(self.model.parameters()).device
        tokens = [(g.prompt_ids, [c.token_ids for c in g.completions]) for g in groups]
        layout = LAYOUTS[self.layout](tokens, self.pad_id).to(device)
        resp = self._responses(scored, device)
        logprobs, entropy = self._logprobs(self.forward_model, layout, resp, True)
        old_logprobs, old_passes = self._old_logprobs(logprobs, layout, resp)
        count = 1 + old_passes
        ref_logprobs = None
        if self.ref_model is not None:
            ref_logprobs = self._frozen_logprobs(self.ref_model, layout, resp)
            count += 1
        batch = PolicyBatch(
            logprobs=logprobs,
            old_logprobs=old_logprobs,
            advantages=resp.advantages,
            loss_mask=resp.loss_mask,
            token_weights=token_weights(resp.loss_mask, self.algo.loss_agg),
            ref_logprobs=ref_logprobs,
            behaviour_logprobs=resp.behaviour_logprobs,
            rewards=resp.rewards,
            group_ids=resp.group_ids,
        )
        loss, metrics = self.loss_fn(batch, self.algo)
        computed = layout.tokens_computed
        return Passes(loss, metrics, logprobs, entropy, resp, computed, count, old_logprobs)

    def _old_logprobs(
        self, logprobs: torch.Tensor, layout: Layout, resp: Responses
    ) -> tuple[torch.Tensor, int]:
        """`old_logprobs` per row, and the forward passes they cost (0 or 1).

        Fresh rows: the policy at the iteration's start (the policy itself, detached, before the
        iteration's first step). Stale rows: the behaviour log-probs, unless a rollout correction
        is on, which keeps the iteration-start policy as the trust region's anchor and weighs by
        pi_old / pi_behaviour in the loss. The bypass, and pair losses (which read no old
        log-probs), take the behaviour ones (the policy that sampled the tokens) for every row,
        free.
        """
        behaviour = resp.behaviour_logprobs  # (B, T)
        decoupled = self.algo.rollout_correction != "none"
        use_behaviour = torch.zeros_like(resp.stale) if decoupled else resp.stale  # (B,)
        # ranks run the same passes whatever their rows: a pass of a sharded model is a collective
        all_behaviour = self.collective is None and bool(use_behaviour.all())
        if self.pair_loss or self.bypass or all_behaviour:
            return behaviour, 0
        if self.old_model is None or (
            self._steps_this_iteration == 0 and self.params.reuse_old_logprobs
        ):  # no step taken yet this iteration: the old policy is the policy itself
            start, passes = logprobs.detach(), 0
        else:
            start, passes = self._frozen_logprobs(self.old_model, layout, resp), 1
        return torch.where(use_behaviour[:, None], behaviour, start), passes  # (B, T)

    def _responses(self, scored: list[Scored], device: torch.device) -> Responses:
        for s in scored:
            if s.group.policy_version > self.version:
                raise ValueError(
                    f"group {s.group.prompt.uid} has policy_version {s.group.policy_version}, "
                    f"newer than the learner's version {self.version}"
                )
        return responses(scored, self.pad_id, self.version, device)

    @torch.no_grad()
    def _frozen_logprobs(self, model, layout: Layout, resp: Responses) -> torch.Tensor:
        return self._logprobs(model, layout, resp, with_entropy=False)[0]

    def _logprobs(self, model, layout: Layout, resp: Responses, with_entropy: bool):
        """Log-probs (and entropy) of each response token under softmax(logits / temperature)."""
        return token_logprobs(model, layout, resp.tokens, self.params.temperature, with_entropy)

    def _normaliser(self, sums: StepSums) -> float:
        if self.pair_loss:  # the mean over the global batch's pairs; none (all ties): grads are 0
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


def choose_layout(model: torch.nn.Module, params: LearnerParams, pad_id: int) -> str:
    """The micro-batch layout: the shared-prompt one asked for, unless `check_layout` finds the
    model does not reproduce its unpacked log-probs in it (then "unpacked", with a warning)."""
    if not params.shared_prompt:
        return "unpacked"
    name = params.shared_prompt_impl
    if name not in LAYOUTS or name == "unpacked":
        raise ValueError(f"unknown shared_prompt_impl {name!r}; allowed: prefix, dense")
    reason = check_layout(model, name, pad_id)
    if reason is None:
        return name
    warnings.warn(
        f"shared-prompt packing ('{name}') is off for this model: {reason}. Training uses the "
        "unpacked layout (each response repeats its prompt; same result, more compute). "
        "Set learner.shared_prompt = false to silence this.",
        stacklevel=3,
    )
    return "unpacked"


def _prepare(model, ref_model, params: LearnerParams, pad_id: int, wrapped: bool) -> None:
    """Dropout off, layers checkpointed, log-prob heads in place (a rank's `wrapped` model has
    its checkpointing and heads already)."""
    models = [m for m in (model, ref_model) if m is not None]
    if params.disable_dropout:
        for m in models:
            disable_dropout(m)
    if params.activation_checkpointing and not wrapped:
        checkpoint_layers(model)
    if params.logits_chunk_tokens and not wrapped:
        for m in models:
            install_checked_head(m, params.logits_chunk_tokens, pad_id)


def disable_dropout(model: torch.nn.Module) -> None:
    """Dropout off everywhere in `model` (its Dropout modules, a LoRA adapter's among them, and
    the attention's own rate): with it on, the learner's log-probs of a token change from pass to
    pass, and the first micro-batch's ratio is not 1."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
