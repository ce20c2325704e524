"""Mixed precision in one process: float32 master weights under a low-precision model.

`model.dtype = "bfloat16"` computes in bf16 while the optimizer keeps float32 masters and float32
state, as FSDP2's `MixedPrecisionPolicy` does across ranks: each micro-batch's bf16 gradients are
added into the masters' float32 gradients as they come, the optimizer steps the masters, and the
model (what the passes, the engines and `final/` read) takes the masters rounded to bf16. A
LoRA adapter is already float32 under a bf16 base (peft's way): it is its own master. Pure bf16
parameters (`learner.master_dtype = "bfloat16"`) lose every update smaller than half a bf16 ulp
of its weight. docs/learner.md#mixed-precision.
"""

from __future__ import annotations

import warnings

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Masters:
    """Master copies of a model's trainable parameters (float32): what the optimizer steps.
    `split` makes them and casts the model's own trainable parameters (never its buffers) to the
    compute dtype."""

    def __init__(self, pairs: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        self.pairs = pairs  # (the model's low-precision parameter, its master)
        self.params = [m for _, m in pairs]

    @classmethod
    def split(
        cls, model: torch.nn.Module, compute: torch.dtype, master: torch.dtype = torch.float32
    ) -> Masters | None:
        """Masters in `master` of `model`'s trainable parameters, which then compute in
        `compute`: a parameter loaded in `master` keeps its bits in the master and is cast; one
        loaded in `compute` already is upcast (its master starts from the rounded values). None
        when the two dtypes are one."""
        if compute == master:
            return None
        pairs = []
        for p in model.parameters():
            if p.requires_grad:
                pairs.append((p, p.detach().to(master, copy=True).requires_grad_(True)))
                p.data = p.data.to(compute)
        return cls(pairs) if pairs else None

    def collect_grads(self) -> None:
        """Add the model's gradients (of the micro-batch just backpropagated) into the masters'
        float32 gradients, and free the model's."""
        for p, m in self.pairs:
            if p.grad is None:
                continue
            g = p.grad.to(m.dtype)
            m.grad = g if m.grad is None else m.grad.add_(g)
            p.grad = None

    @torch.no_grad()
    def publish(self) -> None:
        """The model takes the masters, rounded to its dtype."""
        for p, m in self.pairs:
            p.copy_(m)

    def state(self) -> list[torch.Tensor]:
        return [m.detach().clone() for m in self.params]

    @torch.no_grad()
    def load(self, tensors: list[torch.Tensor]) -> None:
        if len(tensors) != len(self.params):
            raise ValueError(f"{len(tensors)} master tensors for {len(self.params)} parameters")
        for m, t in zip(self.params, tensors, strict=True):
            m.copy_(t)
        self.publish()


def warn_pure_low_precision(dtype: str, lr: float) -> None:
    """The warning of `learner.master_dtype = "bfloat16"`: which weights an Adam step of about
    `lr` cannot move at all."""
    floor = lr * 2**9  # bf16 keeps 8 significant bits: half an ulp of |w| is at least |w| * 2^-9
    warnings.warn(
        f"learner.master_dtype = '{dtype}': parameters and optimizer state in {dtype}. An update "
        f"smaller than half a {dtype} ulp of its weight is rounded away: an Adam step of about "
        f"train.lr = {lr:g} cannot move any weight larger than {floor:.3g} in magnitude. Keep "
        "learner.master_dtype = 'float32' (float32 masters, bf16 compute) unless memory forbids",
        stacklevel=3,
    )
