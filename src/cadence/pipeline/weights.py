"""Weight sync: how the learner's parameters reach inference workers.

`SharedWeights` (local backend) holds one shared-memory copy of every parameter. The learner
publishes a version by copying its parameters into it; a worker loads a version by copying out of
it into its own model. The tensors are handed to each worker process once, at spawn; nothing is
pickled per iteration. Publishing and loading must never overlap: the pool's barrier (publish,
then every worker loads and acknowledges, then prompts go out) guarantees that. A worker whose
engine keeps its own copy of the weights (vLLM) loads into the engine (`EngineWeights`).
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


class EngineWeights:
    """The weights of an engine that keeps its own copy of the model (vLLM), seen as a model:
    `named_parameters` describes them (a skeleton of the model on the meta device: names,
    shapes, dtypes, no memory), and `load_into` hands new tensors to the engine."""

    def __init__(self, engine, skeleton: torch.nn.Module) -> None:
        self.engine = engine
        self.skeleton = skeleton

    def named_parameters(self):
        return self.skeleton.named_parameters()

    def parameters(self):
        return self.skeleton.parameters()

    def to(self, device) -> EngineWeights:
        return self  # the engine places its own copy

    def load(self, tensors: dict[str, torch.Tensor], version: int | None) -> None:
        self.engine.load_weights(tensors, version)


@torch.no_grad()
def load_into(
    model: torch.nn.Module | EngineWeights, tensors: dict[str, torch.Tensor], version=None
) -> None:
    """Copy shared tensors into a worker's own model (names must match exactly), or hand them
    to its engine when the engine keeps its own copy (`version` labels them there)."""
    params = dict(model.named_parameters())
    if params.keys() != tensors.keys():
        missing = sorted(set(tensors) ^ set(params))[:5]
        raise ValueError(f"worker model and published weights differ in parameters: {missing}")
    if isinstance(model, EngineWeights):
        model.load(tensors, version)
        return
    for name, p in params.items():
        p.copy_(tensors[name])
