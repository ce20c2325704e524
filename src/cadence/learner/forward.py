"""What one micro-batch computes before its backward: the layout of its groups, the policy's
log-probs (with grad), the old policy's and the reference's as the algorithm needs them, and the
loss, not yet backpropagated.

Log-probs come from as few passes as the algorithm allows: the old policy's are the policy's own,
detached, before the iteration's first step (one step an iteration needs no old pass at all), the
behaviour ones for stale rows and under the bypass; the reference's are a no-grad pass over the
same layout. It never branches on an algorithm's name and never steps an optimizer (the
Learner's). docs/learner.md.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch

from cadence.algo import (
    AlgoParams,
    PolicyBatch,
    get_loss,
    is_pair_loss,
    needs_reference,
    token_weights,
)
from cadence.learner.batch import Responses, responses
from cadence.learner.checkpointing import checkpoint_layers
from cadence.learner.distill import Teachers
from cadence.learner.logprobs import token_logprobs
from cadence.learner.packing import (
    LAYOUTS,
    Layout,
    check_layout,
    group_tokens,
    install_checked_head,
)
from cadence.learner.params import Collective, LearnerParams
from cadence.learner.scorer import Scored
from cadence.learner.sums import Passes
from cadence.learner.tensors import frozen_copy, model_bytes


class Forward:
    """The passes of a learner's micro-batches over `model` (and the frozen copies they need)."""

    def __init__(
        self,
        model: torch.nn.Module,
        params: LearnerParams,
        algo: AlgoParams,
        pad_id: int,
        ref_model: torch.nn.Module | None = None,
        collective: Collective | None = None,
        teachers: Teachers | None = None,
    ) -> None:
        self.model, self.params, self.algo, self.pad_id = model, params, algo, pad_id
        self.teachers = teachers
        self.ref_model, self.collective = ref_model, collective
        self.forward_model = (collective and collective.forward_model) or model
        self.loss_fn = get_loss(algo.loss)
        self.pair_loss = is_pair_loss(algo.loss)
        if needs_reference(algo.loss, algo.kl_coef) and ref_model is None:
            why = "algo.kl_coef > 0" if algo.kl_coef > 0 else f"algo.loss = {algo.loss!r}"
            raise ValueError(f"{why} needs a reference model")
        _prepare(model, ref_model, params, pad_id, wrapped=collective is not None)
        self.layout = choose_layout(model, params, pad_id)
        if teachers is not None:
            self._prepare_teachers(teachers)
        self.bypass = algo.correction_proximal == "bypass"  # old log-probs: the behaviour ones
        after_a_step = params.mini_batches > 1 or not params.reuse_old_logprobs
        # pair losses read no old log-probs; the bypass reads the behaviour ones
        needs_old = after_a_step and not (self.pair_loss or self.bypass)
        old_copy = (collective and collective.old_copy) or frozen_copy
        self.old_model = old_copy(model) if needs_old else None
        self.frozen_copies_bytes = model_bytes(ref_model) + model_bytes(self.old_model)

    def _prepare_teachers(self, teachers: Teachers) -> None:
        """Each teacher as the reference is prepared (dropout off, log-prob head), and checked to
        give its unpacked log-probs in the policy's layout."""
        params = replace(self.params, activation_checkpointing=False)
        held = [m for m in teachers.models.values() if m is not None]  # None: a stage's
        for teacher in {id(m): m for m in held}.values():
            _prepare(teacher, None, params, self.pad_id, wrapped=False)
            if self.layout != "unpacked":
                reason = check_layout(teacher, self.layout, self.pad_id)
                if reason is not None:
                    raise ValueError(
                        f"a teacher gives wrong log-probs in '{self.layout}': {reason}"
                    )

    def begin_iteration(self) -> None:
        """Training mode; the old copy (if any) becomes the policy at the iteration's start."""
        self.forward_model.train()
        if self.old_model is not None:
            self.old_model.load_state_dict(self.model.state_dict())

    def passes(self, scored: list[Scored], version: int, stepped: bool) -> Passes:
        """The micro-batch's layout, its passes (policy with grad; old and reference as the
        algorithm needs them) and the loss, not yet backpropagated, at policy `version`;
        `stepped`: an optimizer step was taken this iteration already."""
        device = next(self.model.parameters()).device
        tokens = [group_tokens(s.group) for s in scored]
        layout = LAYOUTS[self.layout](tokens, self.pad_id).to(device)
        resp = self._responses(scored, version, device)
        logprobs, entropy = self._logprobs(self.forward_model, layout, resp, True)
        old_logprobs, old_passes, reused = self._old_logprobs(logprobs, layout, resp, stepped)
        count = 1 + old_passes
        ref_logprobs = None
        if self.ref_model is not None:
            ref_logprobs = self._frozen_logprobs(self.ref_model, layout, resp)
            count += 1
        advantages, distilled = resp.advantages, {}
        if self.teachers is not None:
            tasks = [scored[i].group.prompt.task for i in resp.group_ids.tolist()]
            d = self.teachers.distill(
                tasks,
                logprobs,
                resp.loss_mask,
                resp.advantages,
                lambda teacher: self._frozen_logprobs(teacher, layout, resp),
                resp.teacher_logprobs,
            )
            advantages, distilled = d.advantages, d.sums
            count += d.passes
        batch = PolicyBatch(
            logprobs=logprobs,
            old_logprobs=old_logprobs,
            advantages=advantages,
            loss_mask=resp.loss_mask,
            token_weights=token_weights(resp.loss_mask, self.algo.loss_agg),
            ref_logprobs=ref_logprobs,
            behaviour_logprobs=resp.behaviour_logprobs,
            rewards=resp.rewards,
            group_ids=resp.group_ids,
        )
        loss, metrics = self.loss_fn(batch, self.algo)
        return Passes(
            loss,
            metrics,
            logprobs,
            entropy,
            resp,
            layout.tokens_computed,
            layout.positions_computed,
            count,
            old_logprobs,
            not reused,
            distilled,
        )

    def _old_logprobs(
        self, logprobs: torch.Tensor, layout: Layout, resp: Responses, stepped: bool
    ) -> tuple[torch.Tensor, int, bool]:
        """`old_logprobs` per row, the forward passes they cost (0 or 1), and whether fresh rows
        reuse the policy's own log-probs (detached: their ratio is 1 by construction).

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
            return behaviour, 0, False
        if self.old_model is None or (
            not stepped and self.params.reuse_old_logprobs
        ):  # no step taken yet this iteration: the old policy is the policy itself
            start, passes = logprobs.detach(), 0
        else:
            start, passes = self._frozen_logprobs(self.old_model, layout, resp), 1
        old = torch.where(use_behaviour[:, None], behaviour, start)  # (B, T)
        return old, passes, passes == 0

    def _responses(self, scored: list[Scored], version: int, device: torch.device) -> Responses:
        for s in scored:
            if s.group.policy_version > version:
                raise ValueError(
                    f"group {s.group.prompt.uid} has policy_version {s.group.policy_version}, "
                    f"newer than the learner's version {version}"
                )
        return responses(scored, self.pad_id, version, device)

    @torch.no_grad()
    def _frozen_logprobs(self, model, layout: Layout, resp: Responses) -> torch.Tensor:
        return self._logprobs(model, layout, resp, with_entropy=False)[0]

    def _logprobs(self, model, layout: Layout, resp: Responses, with_entropy: bool):
        """Log-probs (and entropy) of each response token under softmax(logits / temperature)."""
        return token_logprobs(model, layout, resp.tokens, self.params.temperature, with_entropy)


def choose_layout(model: torch.nn.Module, params: LearnerParams, pad_id: int) -> str:
    """The micro-batch layout: the shared-prompt one asked for, unless `check_layout` finds the
    model does not reproduce its unpacked log-probs in it (then "unpacked", with a warning)."""
    if not params.shared_prompt:
        return "unpacked"
    name = params.shared_prompt_impl
    if name not in LAYOUTS or name == "unpacked":
        raise ValueError(f"unknown shared_prompt_impl {name!r}; allowed: prefix, dense, packed")
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
