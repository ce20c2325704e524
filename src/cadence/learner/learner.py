"""The learner: consumes groups, computes log-probs and the loss, steps the optimizer.

Groups arrive one at a time (streamed or all at once: the learner does not care). They are packed
into micro-batches on group boundaries; each micro-batch's loss is an unnormalised weighted sum, and
gradients are divided by the global-batch normaliser at step time. The update therefore does not
depend on the micro-batch size or the order groups arrive in.

The loss and the advantage estimator come from `algo.registry`; the learner never branches on
algorithm names. With one optimizer step per iteration the old policy is the policy itself, so
`old_logprobs` are its log-probs detached (no extra pass); with several mini-batches they are the
behaviour log-probs the engine recorded.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from cadence.algo import (
    AdvantageContext,
    LossParams,
    PolicyBatch,
    get_advantage,
    get_loss,
    normaliser,
    token_weights,
)
from cadence.metrics.trace import Tracer
from cadence.types import Group


@dataclass(frozen=True)
class LearnerParams:
    lr: float = 1e-4
    warmup_steps: int = 0  # linear learning-rate warm-up over the first optimizer steps
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    loss: str = "ppo_clip"
    advantage: str = "grpo"
    scale_by_std: bool = True
    loss_agg: str = "token-mean"
    micro_batch_groups: int = 4
    mini_batches: int = 1
    max_new_tokens: int = 64  # normaliser of "seq-sum-norm"
    temperature: float = 1.0  # log-probs are of softmax(logits / temperature), as sampled


@dataclass
class _Packed:
    ids: torch.Tensor  # (B, L) right-padded [prompt | response]
    attn: torch.Tensor  # (B, L)
    starts: torch.Tensor  # (B,) position of each row's first response token
    loss_mask: torch.Tensor  # (B, T) response tokens, aligned from each row's start
    behaviour_logprobs: torch.Tensor  # (B, T) recorded by the engine at sampling time
    advantages: torch.Tensor  # (B,)


class _Sums:
    """Running sums over one optimizer step's micro-batches."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def add(self, **kv: float) -> None:
        for k, v in kv.items():
            self.values[k] = self.values.get(k, 0.0) + float(v)

    def __getitem__(self, k: str) -> float:
        return self.values.get(k, 0.0)


class Learner:
    def __init__(
        self,
        model: torch.nn.Module,
        params: LearnerParams,
        loss_params: LossParams,
        pad_id: int,
        ref_model: torch.nn.Module | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.model = model
        self.ref_model = ref_model
        self.params = params
        self.loss_params = loss_params
        self.pad_id = pad_id
        self.tracer = tracer or Tracer()
        self.loss_fn = get_loss(params.loss)
        self.advantage_fn = get_advantage(params.advantage)
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=params.lr,
            weight_decay=params.weight_decay,
        )
        warmup = max(params.warmup_steps, 1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup)
        )
        self.version = 0  # policy version: number of iterations trained
        self.baseline = 0.0  # previous iteration's mean reward (for "reinforce")
        if loss_params.kl_coef > 0 and ref_model is None:
            raise ValueError("algo.kl_coef > 0 needs a reference model")

    def train_iteration(self, groups: Iterable[Group], num_groups: int) -> dict[str, float]:
        """Train on `num_groups` groups as they come; step after each mini-batch's last group."""
        per_step = math.ceil(num_groups / self.params.mini_batches)
        self.model.train()
        buffer: list[Group] = []
        sums, steps, rewards = _Sums(), [], []
        for i, group in enumerate(groups, start=1):
            buffer.append(group)
            rewards.extend(group.rewards)
            end_of_step = i % per_step == 0 or i == num_groups
            if len(buffer) == self.params.micro_batch_groups or end_of_step:
                self._forward_backward(buffer, sums)
                buffer = []
            if end_of_step:
                steps.append(self._step(sums))
                sums = _Sums()
        if not steps or len(rewards) == 0:
            raise RuntimeError(f"learner got no groups (expected {num_groups})")
        self.version += 1
        self.baseline = sum(rewards) / len(rewards)
        return {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]} | {
            "num_tokens": float(sum(s["num_tokens"] for s in steps)),
            "optimizer_steps": float(len(steps)),
        }

    def _forward_backward(self, groups: list[Group], sums: _Sums) -> None:
        with self.tracer.span("forward_backward", "learner"):
            packed = self._pack(groups)
            ids, attn, starts, mask = packed.ids, packed.attn, packed.starts, packed.loss_mask
            logits = self.model(input_ids=ids, attention_mask=attn).logits  # (B, L, V)
            logprobs, entropy = self._response_logprobs(logits, ids, starts, mask)
            ref_logprobs = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref_logits = self.ref_model(input_ids=ids, attention_mask=attn).logits
                    ref_logprobs, _ = self._response_logprobs(
                        ref_logits, ids, starts, mask, with_entropy=False
                    )
            batch = PolicyBatch(
                logprobs=logprobs,
                # one step per iteration: the old policy is the policy at the iteration's start
                old_logprobs=logprobs.detach()
                if self.params.mini_batches == 1
                else packed.behaviour_logprobs,
                advantages=packed.advantages,
                loss_mask=mask,
                token_weights=token_weights(mask, self.params.loss_agg),
                ref_logprobs=ref_logprobs,
            )
            loss, metrics = self.loss_fn(batch, self.loss_params)
            loss.backward()
        sums.add(
            loss=loss.item(),
            **{k: v.item() for k, v in metrics.items()},
            entropy_sum=float((entropy * mask).sum()),
            num_response_tokens=float(mask.sum()),
            num_seqs=float(mask.shape[0]),
            num_tokens=float(sum(g.num_tokens for g in groups)),
        )

    def _pack(self, groups: list[Group]) -> _Packed:
        """Right-padded [prompt | response] rows; response-aligned tensors for the loss."""
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)  # (N, G)
        ctx = AdvantageContext(scale_by_std=self.params.scale_by_std, baseline=self.baseline)
        adv = self.advantage_fn(rewards, ctx)  # (N, G)
        rows = [(g.prompt_ids, c) for g in groups for c in g.completions]
        width = max(len(p) + len(c.token_ids) for p, c in rows)
        resp_len = max(max(len(c.token_ids) for _, c in rows), 1)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)  # (B, L)
        attn = torch.zeros((len(rows), width), dtype=torch.long)  # (B, L)
        behaviour = torch.zeros((len(rows), resp_len))  # (B, T)
        mask = torch.zeros((len(rows), resp_len))  # (B, T)
        for b, (p, c) in enumerate(rows):
            n = len(p) + len(c.token_ids)
            ids[b, :n] = torch.tensor(p + c.token_ids)
            attn[b, :n] = 1
            behaviour[b, : len(c.token_ids)] = torch.tensor(c.logprobs)
            mask[b, : len(c.token_ids)] = 1
        starts = torch.tensor([len(p) for p, _ in rows])  # (B,) first response position
        device = next(self.model.parameters()).device
        return _Packed(*(t.to(device) for t in (ids, attn, starts, mask, behaviour, adv.flatten())))

    def _response_logprobs(self, logits, ids, starts, mask, with_entropy: bool = True):
        """Log-probs (and entropy) of each response token, aligned to (B, T)."""
        steps = torch.arange(mask.shape[1], device=ids.device)  # (T,)
        targets = (starts[:, None] + steps[None, :]).clamp(max=ids.shape[1] - 1)  # (B, T)
        pred = (
            logits.gather(1, (targets - 1)[:, :, None].expand(-1, -1, logits.shape[-1])).float()
            / self.params.temperature
        )  # (B, T, V)
        log_z = pred.logsumexp(-1)  # (B, T)
        token_ids = ids.gather(1, targets)  # (B, T)
        logprobs = pred.gather(-1, token_ids[:, :, None]).squeeze(-1) - log_z  # (B, T)
        if not with_entropy:
            return logprobs, None
        with torch.no_grad():
            p = torch.softmax(pred, -1)  # (B, T, V)
            entropy = log_z - (p * pred).sum(-1)  # (B, T)
        return logprobs, entropy

    def _step(self, sums: _Sums) -> dict[str, float]:
        with self.tracer.span("optimizer_step", "learner"):
            norm = normaliser(
                self.params.loss_agg,
                num_tokens=int(sums["num_response_tokens"]),
                num_seqs=int(sums["num_seqs"]),
                max_new_tokens=self.params.max_new_tokens,
            )
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(norm)
            grad_norm = torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), self.params.max_grad_norm
            )
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        out = {k: sums[k] / norm for k in ("loss", "pg_loss", "kl", "clip_frac", "ratio")}
        out["entropy"] = sums["entropy_sum"] / max(sums["num_response_tokens"], 1.0)
        out["grad_norm"] = float(grad_norm)
        out["num_tokens"] = sums["num_tokens"]
        out["num_response_tokens"] = sums["num_response_tokens"]
        return out
