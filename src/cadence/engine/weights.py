"""What new weights load into: an engine's weights, seen as a model.

An engine either decodes with a model object (`owns_weights` False), and new weights are copied
into that model's parameters; or keeps a copy of its own (vLLM, `owns_weights` True), and new
weights are handed to its `load_weights`, a skeleton of the model (meta device: names, shapes,
dtypes, no memory) describing them. `EngineWeights` is the one view of both: `named_parameters`
says what a transport must deliver (its buffers are shaped from it), `load` refuses tensors whose
names differ and puts them where the engine reads them. It must not know where the tensors came
from (a transport, the learner's own model): that is backend/'s and the builder's.
`EngineAdapter` is the same view where what arrives is a LoRA adapter alone (vLLM's LoRA
requests).
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import cast

import torch

from cadence.engine.base import Engine, TakesAdapters, WeightOwner
from cadence.models.fingerprint import Fingerprints, held


@torch.no_grad()
def load_into(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy `tensors` into `model`'s parameters; the names must match exactly."""
    params = dict(model.named_parameters())
    _check_names(params, tensors)
    for name, p in params.items():
        p.copy_(tensors[name])


def _check_names(params: Mapping[str, object], tensors: Mapping[str, torch.Tensor]) -> None:
    if params.keys() != tensors.keys():
        differ = sorted(set(tensors) ^ set(params))[:5]
        raise ValueError(f"the engine's model and the weights sent differ in parameters: {differ}")


class EngineWeights:
    """The weights `engine` decodes with, as a model: `model` is the model it decodes with, or
    for an engine that keeps its own copy, a skeleton of that model."""

    def __init__(self, engine: Engine, model: torch.nn.Module) -> None:
        self.engine, self.model = engine, model

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return self.model.named_parameters()

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return self.model.parameters()

    def to(self, device: str | torch.device) -> EngineWeights:
        """Move the model the engine decodes with (an engine's own copy places itself)."""
        if not self.engine.owns_weights:
            self.model.to(device)
        return self

    @torch.no_grad()
    def load_stream(
        self, tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> None:
        """`load` from (name, tensor) pairs as they arrive (a broadcast's buckets): each is put
        in place before the next is asked for, so a sender may reuse the memory behind it. Every
        parameter must come once; a missing or unknown name raises (after what came was put)."""
        params = dict(self.model.named_parameters())
        seen: set[str] = set()

        def checked() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in tensors:
                if name not in params or name in seen:
                    raise ValueError(
                        f"the weights sent hold {name!r} twice or unknown to the engine"
                    )
                seen.add(name)
                yield name, t
            if missing := sorted(params.keys() - seen)[:5]:
                raise ValueError(f"the weights sent lacked parameters: {missing}")

        if not self.engine.owns_weights:
            for name, t in checked():
                params[name].copy_(t)
            return
        cast(WeightOwner, self.engine).load_weights(checked(), version)

    def load(self, tensors: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Put `tensors` where the engine reads its weights; `version` labels them in an engine
        that keeps its own copy."""
        if not self.engine.owns_weights:
            load_into(self.model, tensors)
            return
        _check_names(dict(self.model.named_parameters()), tensors)
        cast(WeightOwner, self.engine).load_weights(tensors, version)

    def held_fingerprint(self, expected: Fingerprints) -> Fingerprints:
        """The fingerprints of what the engine decodes with now (models/fingerprint.py): the
        model's parameters, or what an engine with its own copy says it holds."""
        if not self.engine.owns_weights:
            return held(self.model, expected)
        return cast(WeightOwner, self.engine).held_fingerprint(expected)


class EngineAdapter(EngineWeights):
    """The weights of an engine that takes a LoRA adapter on its own base weights (vLLM's LoRA
    requests), when what arrives is the adapter alone (`spec`, a `models.lora.AdapterSpec`):
    `named_parameters` describes the adapter's tensors (meta: names, shapes, dtypes), and each
    version loaded is saved with the adapter's config to a directory of its own, which the
    engine reads before the load returns, and which goes after."""

    def __init__(self, engine: Engine, spec) -> None:
        super().__init__(engine, torch.nn.Module())
        self.spec = spec
        self.meta = {
            name: torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
            for name, shape, dtype in spec.tensors
        }
        self._dir = Path(tempfile.mkdtemp(prefix="cadence-adapter-"))
        weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return iter(cast(dict[str, torch.nn.Parameter], self.meta).items())

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return (p for _, p in self.named_parameters())

    def to(self, device: str | torch.device) -> EngineWeights:
        return self  # the engine places its own copy

    def load_stream(
        self, tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> None:
        self.load(dict(tensors), version)

    def held_fingerprint(self, expected: Fingerprints) -> Fingerprints:
        """The fingerprints of the adapter later requests decode with, as the engine read it."""
        return cast(TakesAdapters, self.engine).adapter_fingerprint()

    def load(self, tensors: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        from cadence.models.lora import save_adapter

        _check_names(self.meta, tensors)
        path = save_adapter(self._dir / f"version-{version}", self.spec, dict(tensors))
        try:
            cast(TakesAdapters, self.engine).load_adapter(str(path), version)
        finally:
            shutil.rmtree(path, ignore_errors=True)
