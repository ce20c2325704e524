"""The one-process trainer: consumes scored groups, computes log-probs and the loss, steps the
optimizer. It satisfies the Trainer seam (learner/trainer.py); each of a sharded learner's ranks
runs one too (learner/rank.py).

Groups arrive one at a time, scored (learner/scorer.py: shaped rewards, advantages), streamed or
all at once: the learner does not care. They are packed into micro-batches on group boundaries;
each micro-batch's loss is an unnormalised weighted sum, and gradients are divided by the
global-batch normaliser at step time. The update therefore does not depend on the micro-batch
size or the order groups arrive in.

A micro-batch's layout (learner/packing.py) is built once and shared by every model that reads it:
by default each group's prompt is computed once for its G responses (`shared_prompt`). The loss
needs three log-probs per token, from as few passes as the algorithm allows (the unified
tri-model): `logprobs` from the policy, with grad; `old_logprobs` from the policy as it was at the
iteration's start, which before the iteration's first optimizer step *is* the policy, so they are
its log-probs detached and cost no pass (a frozen old copy, refreshed each iteration, is evaluated
only after a step, i.e. with `mini_batches` > 1, or when `reuse_old_logprobs` is off); and
`ref_logprobs` from the frozen reference, under no_grad. The loss comes from `algo.registry`; the
learner never branches on algorithm names, and of the algorithm's settings (`AlgoParams`) it
reads only what the loss takes, the aggregation and the cap (seq-sum-norm's constant). Rewards
and advantages are the Scorer's: the learner never computes them.

Stale data: a group whose `policy_version` is older than the learner's `version` was sampled by
older weights, so the policy at the iteration's start is not its behaviour policy. For such a row
`old_logprobs` are the behaviour log-probs the engine recorded at sampling time (chosen per row:
a micro-batch may mix fresh and stale groups). With a rollout correction
(`algo.rollout_correction`, algo/correction.py) every row keeps the iteration-start log-probs as
`old_logprobs` and the loss weighs each token by the mode's weight of pi_old / pi_behaviour
instead (decoupled); with `correction_proximal = "bypass"` every row, fresh or stale, takes the
behaviour log-probs as `old_logprobs`, and no old pass or frozen old copy is ever needed. The
correction's sums and largest values are added up over the step like the loss's, and the step
reports verl's figures from them (`correction_figures`).
"""

from __future__ import annotations

import copy
import logging
import math
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cadence.algo import (
    CORRECTION_MAXIMA,
    CORRECTION_SUMS,
    COUNT_METRICS,
    TOKEN_METRICS,
    AlgoParams,
    PolicyBatch,
    correction_figures,
    get_loss,
    is_pair_loss,
    needs_reference,
    normaliser,
    token_weights,
)
from cadence.learner.batch import Responses, responses
from cadence.learner.packing import LAYOUTS, Layout, check_layout
from cadence.learner.scorer import Scored
from cadence.learner.sums import (
    TOTALS,
    StepSums,
    behaviour_figures,
    behaviour_sums,
    iteration_stats,
    peak_memory,
)
from cadence.metrics.trace import Tracer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LearnerParams:
    """How the learner steps and lays out its work; the algorithm is `AlgoParams`."""

    lr: float = 1e-4
    warmup_steps: int = 0  # linear learning-rate warm-up over the first optimizer steps
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch_groups: int = 4
    mini_batches: int = 1
    temperature: float = 1.0  # log-probs are of softmax(logits / temperature), as sampled
    shared_prompt: bool = True  # compute each group's prompt once for its G responses
    shared_prompt_impl: str = "prefix"  # "prefix" (prompt K/V reused) or "dense" (4-D mask)
    reuse_old_logprobs: bool = True  # before the first step, old_logprobs = policy's, detached
    max_bad_steps: int = 3  # steps in a row with a non-finite loss or gradient before giving up


class BadStepsError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


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


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy for no_grad passes: no gradient buffers, never in an optimizer, in eval mode."""
    return copy.deepcopy(model).requires_grad_(False).eval()


def model_bytes(model: torch.nn.Module | None) -> int:
    """Bytes of `model`'s parameters and buffers this process holds (a sharded tensor: its
    local shard)."""
    if model is None:
        return 0
    tensors = [local_tensor(t) for t in (*model.parameters(), *model.buffers())]
    return sum(t.numel() * t.element_size() for t in tensors)


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
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=params.lr,
            weight_decay=params.weight_decay,
        )
        warmup = max(params.warmup_steps, 1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup)
        )
        self.layout = self._choose_layout()
        self.bypass = algo.correction_proximal == "bypass"  # old log-probs: the behaviour ones
        after_a_step = params.mini_batches > 1 or not params.reuse_old_logprobs
        # pair losses read no old log-probs; the bypass reads the behaviour ones
        needs_old = after_a_step and not (self.pair_loss or self.bypass)
        old_copy = (collective and collective.old_copy) or frozen_copy
        self.old_model = old_copy(model) if needs_old else None
        self.frozen_copies_bytes = model_bytes(ref_model) + model_bytes(self.old_model)
        self.version = 0  # policy version: number of iterations trained
        self._steps_this_iteration = 0
        self.bad_steps_in_a_row = 0

    def close(self) -> None:
        """Nothing to release: this learner lives in the run's process (or in its rank's)."""

    def state(self, directory: Path) -> dict[str, Any]:
        """The optimizer's state, the schedule, the version and the bad-step count (the policy's
        weights are the checkpoint's own); nothing is written to `directory`."""
        return {
            "ranks": 1,
            "version": self.version,
            "bad_steps_in_a_row": self.bad_steps_in_a_row,
            "optimizer": self.optimizer.state_dict(),
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
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = state["version"]
        self.bad_steps_in_a_row = state["bad_steps_in_a_row"]

    def _choose_layout(self) -> str:
        if not self.params.shared_prompt:
            return "unpacked"
        name = self.params.shared_prompt_impl
        if name not in LAYOUTS or name == "unpacked":
            raise ValueError(f"unknown shared_prompt_impl {name!r}; allowed: prefix, dense")
        reason = check_layout(self.model, name, self.pad_id)
        if reason is None:
            return name
        warnings.warn(
            f"shared-prompt packing ('{name}') is off for this model: {reason}. Training uses the "
            "unpacked layout (each response repeats its prompt; same result, more compute). "
            "Set learner.shared_prompt = false to silence this.",
            stacklevel=3,
        )
        return "unpacked"

    def train_iteration(self, scored: Iterable[Scored], num_groups: int) -> dict[str, Any]:
        """Train on `num_groups` scored groups as they come; step after each mini-batch's last
        group.

        Fewer may come (the pipeline dropped a group staler than allowed): what did is trained
        and stepped when the iterable ends."""
        per_step = math.ceil(num_groups / self.params.mini_batches)
        self.begin_iteration()
        buffer: list[Scored] = []
        sums, steps = StepSums(), []
        for i, group in enumerate(scored, start=1):
            buffer.append(group)
            end_of_step = i % per_step == 0 or i == num_groups
            if len(buffer) == self.params.micro_batch_groups or end_of_step:
                self.forward_backward(buffer, sums)
                buffer = []
            if end_of_step:
                steps.append(self.step(sums))
                sums = StepSums()
        if buffer:
            self.forward_backward(buffer, sums)
        if sums.values:
            steps.append(self.step(sums))
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
        groups = [s.group for s in scored]
        with self.tracer.span("forward_backward", self.track):
            device = next(self.model.parameters()).device
            tokens = [(g.prompt_ids, [c.token_ids for c in g.completions]) for g in groups]
            layout = LAYOUTS[self.layout](tokens, self.pad_id).to(device)
            resp = self._responses(scored, device)
            logprobs, entropy = self._logprobs(self.forward_model, layout, resp, True)
            old_logprobs, old_passes = self._old_logprobs(logprobs, layout, resp)
            passes = 1 + old_passes
            ref_logprobs = None
            if self.ref_model is not None:
                ref_logprobs = self._frozen_logprobs(self.ref_model, layout, resp)
                passes += 1
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
            (loss * 0.0 if idle else loss).backward()
        mask = resp.loss_mask
        # before the iteration's first step the policy is the behaviour policy of fresh rows
        first = self._steps_this_iteration == 0
        on_policy = mask * ~resp.stale[:, None] if first else torch.zeros_like(mask)  # (B, T)
        behaviour, maxima = behaviour_sums(logprobs, resp.behaviour_logprobs, on_policy)
        loss_metrics = {"loss": loss.item(), **{k: v.item() for k, v in metrics.items()}}
        correction = {k: loss_metrics.pop(k) for k in CORRECTION_SUMS if k in loss_metrics}
        maxima |= {k: loss_metrics.pop(k) for k in CORRECTION_MAXIMA if k in loss_metrics}
        own = {
            "entropy_sum": float((entropy * mask).sum()),
            "num_stale_tokens": float(mask[resp.stale].sum()),
            "num_response_tokens": float(mask.sum()),
            "num_seqs": float(mask.shape[0]),  # empty and masked responses count (TRL's way)
            "num_tokens": float(sum(g.num_tokens for g in groups)),
            "tokens_computed": float(layout.tokens_computed),
            "forward_passes": float(passes),
            "micro_batches": 1.0,
            **behaviour,
            **correction,
        }
        if idle:  # every name a real pass records (the ranks add their sums up by name), as 0
            loss_metrics, own = dict.fromkeys(loss_metrics, 0.0), dict.fromkeys(own, 0.0)
            maxima = dict.fromkeys(maxima, 0.0)
        sums.add_loss_metrics(**loss_metrics)
        sums.add(**own)
        sums.add_max(**maxima)

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
        pred = layout.logits(model).float() / self.params.temperature  # (B, T, V)
        log_z = pred.logsumexp(-1)  # (B, T)
        logprobs = pred.gather(-1, resp.tokens[:, :, None]).squeeze(-1) - log_z  # (B, T)
        if not with_entropy:
            return logprobs, None
        with torch.no_grad():
            p = torch.softmax(pred, -1)  # (B, T, V)
            entropy = log_z - (p * pred).sum(-1)  # (B, T)
        return logprobs, entropy

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
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(norm)
            grad_norm = _scalar(
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.params.max_grad_norm)
            )
            bad = not (math.isfinite(grad_norm) and math.isfinite(sums["loss"]))
            if not bad:
                self.optimizer.step()
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self._steps_this_iteration += 1
        self._count_bad_step(bad)
        num_response_tokens = max(sums["num_response_tokens"], 1.0)
        divisor = {k: 1.0 for k in COUNT_METRICS} | {k: num_response_tokens for k in TOKEN_METRICS}
        out = {k: sums[k] / divisor.get(k, norm) for k in sums.loss_metrics}
        out["entropy"] = sums["entropy_sum"] / num_response_tokens
        out["stale_token_frac"] = sums["num_stale_tokens"] / num_response_tokens
        out["grad_norm"] = float(grad_norm)
        out["skipped_steps"] = float(bad)
        out["num_response_tokens"] = sums["num_response_tokens"]
        if self.algo.corrects:
            out |= correction_figures(sums.values, sums.maxima)
        return out | behaviour_figures(sums) | {k: sums[k] for k in TOTALS}

    def _count_bad_step(self, bad: bool) -> None:
        """A step whose loss or gradient is NaN or inf is skipped (weights and optimizer state
        untouched); `max_bad_steps` of them in a row stop training."""
        self.bad_steps_in_a_row = self.bad_steps_in_a_row + 1 if bad else 0
        if self.bad_steps_in_a_row > self.params.max_bad_steps:
            raise BadStepsError(
                f"{self.bad_steps_in_a_row} optimizer steps in a row had a non-finite loss or "
                f"gradient and were skipped (train.max_bad_steps = {self.params.max_bad_steps}); "
                "the weights are those of the last good step"
            )
        if bad:
            log.warning(
                "optimizer step skipped: non-finite loss or gradient (%d in a row, at most %d)",
                self.bad_steps_in_a_row,
                self.params.max_bad_steps,
            )


def _scalar(norm: torch.Tensor) -> float:
    """A gradient norm as a float; a sharded model's is a DTensor, replicated on every rank."""
    return float(norm.full_tensor() if is_dtensor(norm) else norm)


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether `t` is a sharded DTensor. (torch.distributed.tensor is looked up, not imported: it
    costs a second to import, and a DTensor cannot exist before something else imported it.)"""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this process holds: a DTensor's local shard, else `t` itself."""
    return t.to_local() if is_dtensor(t) else t
