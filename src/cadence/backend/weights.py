"""Weight sync: how the learner's parameters reach inference workers.

`SharedWeights` (local backend) holds one shared-memory copy of every parameter. The learner
publishes a version by copying its parameters into it; a worker loads a version by copying out of
it into its own model. The tensors are handed to each worker process once, at spawn; nothing is
pickled per iteration. Publishing and loading must never overlap: the pool's barrier (publish,
then every worker loads and acknowledges, then prompts go out) guarantees that.
"""

from __future__ import annotations

from typing import Protocol

import torch


class WeightSync(Protocol):
    def publish(self, model: torch.nn.Module, version: int) -> None: ...


class SharedWeights:
    def __init__(self, model: torch.nn.Module) -> None:
        self.tensors: dict[str, torch.Tensor] = {
            name: p.detach().clone().share_memory_() for name, p in model.named_parameters()
        }
        self.version = -1

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        for name, p in model.named_parameters():
            self.tensors[name].copy_(p)
        self.version = version


@torch.no_grad()
def load_into(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy shared tensors into a worker's own model (names must match exactly)."""
    params = dict(model.named_parameters())
    if params.keys() != tensors.keys():
        missing = sorted(set(tensors) ^ set(params))[:5]
        raise ValueError(f"worker model and published weights differ in parameters: {missing}")
    for name, p in params.items():
        p.copy_(tensors[name])
