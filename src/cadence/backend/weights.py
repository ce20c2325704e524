"""Weight transports: how one version of the learner's parameters reaches the engines, each with
its sending and its receiving half. When a version may move is not decided here (that is the
version gate's, pipeline/gate.py).

- `SharedWeights` / `SharedReceiver` (local backend): one shared-memory copy of every parameter,
  handed to each worker process once at spawn; the learner writes it, a worker loads from it.
- `InMemoryWeights` (the fake): plain tensors, and a record of every version published.
- `LearnerWeights`: an engine with its own copy in the learner's process (colocated vLLM,
  evaluation), loaded straight from the learner's model, a LoRA adapter merged in;
  `LearnerAdapter`: the adapter alone, for such an engine that takes adapters.
- The Ray transports (object store, broadcast) are in ray/weights.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import torch

from cadence.engine import Engine, EngineWeights, TakesAdapters
from cadence.engine.weights import EngineAdapter
from cadence.models.fingerprint import check, fingerprint, published
from cadence.models.lora import adapter_spec, adapter_tensors, is_lora, plain_weights


class WeightSync(Protocol):
    """The sending half: write one version of `model`'s parameters where workers read them."""

    def publish(self, model: torch.nn.Module, version: int) -> None: ...


class Receiver(Protocol):
    """The receiving half, in a worker: `stage` what a sync message carried when it arrives,
    `load` that version into the worker's engine when its loop acts on it."""

    def stage(self, version: int, message: Any) -> None: ...

    def load(self, version: int) -> None: ...


def num_bytes(tensors) -> int:
    """What one version weighs: the bytes of `tensors` (a dict's values, or any tensors)."""
    values = tensors.values() if isinstance(tensors, dict) else tensors
    return sum(t.numel() * t.element_size() for t in values)


class SharedWeights:
    def __init__(self, model: torch.nn.Module) -> None:
        self.tensors: dict[str, torch.Tensor] = {
            name: p.detach().clone().share_memory_() for name, p in model.named_parameters()
        }
        self.version = -1
        self.num_bytes = num_bytes(self.tensors)

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        for name, p in model.named_parameters():
            self.tensors[name].copy_(p)
        # On a GPU the copies are only queued, and the workers read these tensors through CUDA
        # IPC, outside this process's stream order: they must be done before a worker is told.
        devices = {t.device for t in self.tensors.values() if t.is_cuda}
        for device in devices:
            torch.cuda.synchronize(device)
        self.version = version


class SharedReceiver:
    """A worker's half of `SharedWeights` (or of `InMemoryWeights`, in the worker's own
    process): the shared tensors loaded into its engine's weights."""

    def __init__(self, tensors: dict[str, torch.Tensor], weights: EngineWeights) -> None:
        self.tensors, self.weights = tensors, weights

    def stage(self, version: int, message: Any) -> None:
        pass  # every version is read from the same tensors

    def load(self, version: int) -> None:
        self.weights.load(self.tensors, version)


class InMemoryWeights:
    """The fake transport: `tensors` as `SharedWeights` has them (for workers in this process),
    and `versions`, every version published, in order."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.tensors = {name: p.detach().clone() for name, p in model.named_parameters()}
        self.versions: list[int] = []
        self.num_bytes = num_bytes(self.tensors)

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        for name, p in model.named_parameters():
            self.tensors[name].copy_(p)
        self.versions.append(version)


class LearnerWeights:
    """The learner's weights for an engine with its own copy (`owns_weights`, vLLM) in the
    learner's process: colocated rollouts and held-out evaluation. `sync` loads the learner's
    current weights into the engine (names checked against the engine's model) as a plain model
    names them: a LoRA policy's adapter merged in (`plain_weights`). Every path that feeds the
    learner's weights to an engine in its own process comes through here, so none can forget
    the merge."""

    def __init__(self, weights: EngineWeights, model: torch.nn.Module, verify: bool = True) -> None:
        self.weights, self.model = weights, plain_weights(model)
        self.num_bytes = num_bytes(p for _, p in weights.named_parameters())
        self.verify = verify

    def sync(self, version: int | None = None) -> None:
        # a tensor at a time: a LoRA policy's weights are merged as the engine takes them
        tensors = ((n, p.detach()) for n, p in self.model.named_parameters())
        if not self.verify:
            self.weights.load_stream(tensors, version)
            return
        # what it holds now is the learner's, before it samples
        expected = published(self.model, lambda: self.weights.load_stream(tensors, version))
        check(expected, self.weights.held_fingerprint(expected), ENGINE, version or 0)

    __call__ = sync


class LearnerAdapter:
    """A LoRA policy's adapter alone for an engine in the learner's process that takes adapters
    on its own base weights (`TakesAdapters`: colocated vLLM's LoRA requests): each sync hands
    the adapter's tensors (float32, as it trains) to the engine's `EngineAdapter`, as a worker's
    transport does. The base weights never move: they do not train."""

    def __init__(self, engine: TakesAdapters, policy, verify: bool = True) -> None:
        self.policy = policy
        self.target = EngineAdapter(cast(Engine, engine), adapter_spec(policy))
        self.num_bytes = num_bytes(t for _, t in adapter_tensors(policy))
        self.verify = verify

    def sync(self, version: int | None = None) -> None:
        tensors = dict(adapter_tensors(self.policy))
        self.target.load(tensors, version)
        if self.verify:  # the adapter later requests carry is the one just given
            expected = fingerprint(tensors)
            check(expected, self.target.held_fingerprint(expected), ENGINE, version or 0)

    __call__ = sync


ENGINE = "the engine beside the learner"


def learner_sync(
    weights: EngineWeights, model: torch.nn.Module, verify: bool = True
) -> Callable[[int | None], None] | None:
    """How the learner's current weights reach the engine of `weights` in the learner's process:
    None where the engine decodes with the learner's own model (nothing to bring over);
    `LearnerAdapter` for a LoRA policy and an engine that takes adapters; else `LearnerWeights`
    (called with the version; `num_bytes` what each sync moves)."""
    engine = weights.engine
    if not engine.owns_weights:
        return None
    if is_lora(model) and isinstance(engine, TakesAdapters) and engine.takes_adapters:
        return LearnerAdapter(engine, model, verify)
    return LearnerWeights(weights, model, verify)
