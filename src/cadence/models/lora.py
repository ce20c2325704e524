"""LoRA adapters (`model.lora`, through `peft`): what trains, what the reference and the rollout
workers see, and what is saved.

Read on: docs/data.md#lora-modellora.
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cadence.models.io import ModelLoadError, save_pretrained

ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoraError(ModelLoadError):
    """The adapter settings do not fit the model (a target that matches no module, ...)."""


@dataclass(frozen=True)
class LoraSpec:
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")


def _peft():
    try:
        import peft
    except ImportError:
        raise LoraError("model.lora needs peft: pip install 'cadence[lora]'") from None
    return peft


def apply_lora(model: torch.nn.Module, spec: LoraSpec, base_path: str | Path | None = None):
    """`model` with a fresh LoRA adapter on `spec.target_modules` (a peft model)."""
    peft = _peft()
    if base_path is not None:  # recorded in adapter_config.json: absolute, so any cwd finds it
        model.name_or_path = str(Path(base_path).resolve())
    config = peft.LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        task_type="CAUSAL_LM",
    )
    try:
        with warnings.catch_warnings():  # peft asks transformers a deprecated question
            warnings.simplefilter("ignore", FutureWarning)
            return peft.get_peft_model(model, config)
    except ValueError as e:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if _linear(m)})
        raise LoraError(
            f"model.lora.target_modules {list(spec.target_modules)} do not fit this model "
            f"({str(e).splitlines()[0]}); its linear layers are named: {', '.join(linear)}"
        ) from None


def _linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear)


def is_lora(model: Any) -> bool:
    """Whether `model` is a peft model (peft is not imported to find out: unloaded, it is not)."""
    return "peft" in sys.modules and isinstance(model, _peft().PeftModel)


class AdapterOff(torch.nn.Module):
    """The reference model of a LoRA policy: the policy's forward with the adapter disabled.

    It holds the policy outside its own module tree, so it has no parameters of its own; its
    `state_dict` is the base weights (for the reference's digest in checkpoints).
    """

    def __init__(self, policy) -> None:
        super().__init__()
        self.__dict__["policy"] = policy  # not a submodule: no second copy, no parameters

    def forward(self, *args: Any, **kwargs: Any):
        with self.policy.disable_adapter():
            return self.policy(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return dict(base_parameters(self.policy))


def base_parameters(policy) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's parameters of a peft model, under the plain model's names."""
    for name, p in policy.get_base_model().named_parameters():
        if "lora_" not in name:
            yield name.replace(".base_layer", ""), p


def _delta(module, adapter: str) -> torch.Tensor:
    """scale * B @ A of one adapter of one layer, in float32 (peft's `get_delta_weight` returns
    it in the weight's dtype, rounded before it is added)."""
    if module.use_dora.get(adapter, False):
        raise LoraError("DoRA adapters cannot be merged tensor by tensor here")
    a = module.lora_A[adapter].weight.float()
    b = module.lora_B[adapter].weight.float()
    delta = (b @ a) * module.scaling[adapter]
    return delta.T if module.fan_in_fan_out else delta


@torch.no_grad()
def merged_tensors(policy) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight as a plain model names it, with the adapter merged, one at a time: W +
    scale * B @ A summed in float32 and cast to W's dtype once (a bf16 W + a bf16 delta rounds
    twice, and a delta under W's rounding step vanishes); one merged tensor alive at a time."""
    from peft.tuners.lora import LoraLayer

    layers = {
        f"{name}.weight": module
        for name, module in policy.get_base_model().named_modules()
        if isinstance(module, LoraLayer)
    }
    for name, p in base_parameters(policy):
        module = layers.get(name)
        if module is None:
            yield name, p
            continue
        total = p.to(torch.float32, copy=True)  # never the weight itself, for a float32 one
        for adapter in module.active_adapters:
            total += _delta(module, adapter).to(total.device)
        yield name, total.to(p.dtype)


def merged_parameters(policy) -> dict[str, torch.Tensor]:
    """`merged_tensors` all at once."""
    return dict(merged_tensors(policy))


class _PolicyTensors(torch.nn.Module):
    """A view of a peft policy whose `named_parameters()` are `tensors(policy)`, computed at each
    call (the policy held outside the module tree: no parameters of its own)."""

    def __init__(self, policy) -> None:
        super().__init__()
        self.__dict__["policy"] = policy

    @staticmethod
    def tensors(policy) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def named_parameters(self, *args: Any, **kwargs: Any):  # type: ignore[override]
        return self.tensors(self.policy)

    def parameters(self, *args: Any, **kwargs: Any):  # type: ignore[override]
        return (t for _, t in self.tensors(self.policy))


class MergedWeights(_PolicyTensors):
    """What a weight transport publishes for a LoRA policy: `named_parameters()` gives the merged
    weights under the plain model's names (computed at each call from the current adapter, one
    tensor at a time as the transport takes them). Once fingerprints are asked for
    (`weight_fingerprints`, pipeline.verify_weights), each merge records them as the tensors
    pass: a check costs no second merge."""

    tensors = staticmethod(merged_tensors)

    def __init__(self, policy) -> None:
        super().__init__(policy)
        self.__dict__["_adapter"] = [p for n, p in policy.named_parameters() if "lora_" in n]
        self.__dict__["_recorded"] = None  # (the adapter's versions, fingerprints) or None

    def _versions(self) -> tuple[int, ...]:
        return tuple(p._version for p in self._adapter)  # bumped by every in-place change

    def named_parameters(self, *args: Any, **kwargs: Any):  # type: ignore[override]
        if self._recorded is None:
            return merged_tensors(self.policy)
        return self._recording()

    def _recording(self) -> Iterator[tuple[str, torch.Tensor]]:
        from cadence.models.fingerprint import tensor_fingerprint

        versions, record = self._versions(), {}
        for name, t in merged_tensors(self.policy):
            record[name] = tensor_fingerprint(t)
            yield name, t
        self.__dict__["_recorded"] = (versions, record)

    def weight_fingerprints(self) -> dict:
        """The fingerprints of the merged weights now: those the last merge recorded if the
        adapter has not changed since, else merged (and recorded) once more."""
        if self._recorded is None or self._recorded[0] != self._versions():
            self.__dict__["_recorded"] = ((), {})
            for _ in self._recording():
                pass
        return dict(self._recorded[1])


def plain_weights(model: torch.nn.Module) -> torch.nn.Module:
    """What leaves the learner for an engine or a worker: `model`, or for a LoRA policy its
    merged weights under the plain model's names (`MergedWeights`), the only names they know."""
    return MergedWeights(model) if is_lora(model) else model


def save_merged(policy, tokenizer, out: str | Path) -> Path:
    """A whole Hugging Face model directory with the adapter merged in (the policy untouched)."""
    merged = copy.deepcopy(policy).merge_and_unload()
    return save_pretrained(merged, tokenizer, out)


@torch.no_grad()
def load_adapter_into(policy, path: str | Path) -> None:
    """The adapter weights saved in `path` into the peft model `policy` (resuming a run)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    result = set_peft_model_state_dict(policy, load_file(str(Path(path) / ADAPTER_WEIGHTS)))
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise LoraError(
            f"the adapter in {path} does not fit the run's model.lora: missing {missing[:3]}, "
            f"unexpected {list(result.unexpected_keys)[:3]}"
        )


@dataclass(frozen=True)
class AdapterSpec:
    """What a worker needs to rebuild a LoRA adapter from its tensors alone (plain, picklable):
    peft's `adapter_config.json`, and each tensor's name (as peft saves it), shape and dtype."""

    config_json: str
    tensors: tuple[tuple[str, tuple[int, ...], str], ...]


def adapter_tensors(policy) -> Iterator[tuple[str, torch.Tensor]]:
    """A peft policy's adapter tensors under the names peft saves them with (the parameters
    themselves: no copy)."""
    from peft import get_peft_model_state_dict

    yield from get_peft_model_state_dict(policy).items()


def adapter_spec(policy) -> AdapterSpec:
    """The `AdapterSpec` of a peft policy's (only) adapter."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        policy.peft_config[policy.active_adapter].save_pretrained(d)
        config = (Path(d) / "adapter_config.json").read_text()
    tensors = tuple(
        (name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for name, t in adapter_tensors(policy)
    )
    return AdapterSpec(config, tensors)


def save_adapter(directory: Path, spec: AdapterSpec, tensors: dict[str, torch.Tensor]) -> Path:
    """`tensors` and `spec`'s config as a peft adapter directory (what vLLM's LoRA loader and
    `load_adapter_into` read)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(spec.config_json)
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    save_file(cpu, str(directory / ADAPTER_WEIGHTS))
    return directory


class AdapterOnly(_PolicyTensors):
    """What a weight transport publishes for a LoRA policy to engines that take adapters:
    `named_parameters()` gives the adapter's tensors alone, under the names peft saves them
    with."""

    tensors = staticmethod(adapter_tensors)


def adapter_base(path: str | Path) -> tuple[str, int] | None:
    """(the base model's directory, the rank) of the LoRA adapter directory `path` (a LoRA run's
    final/, peft's layout), or None for a whole model's directory."""
    import json

    from cadence.models.io import ADAPTER_CONFIG

    config = Path(path) / ADAPTER_CONFIG
    if (Path(path) / "config.json").is_file() or not config.is_file():
        return None
    fields = json.loads(config.read_text())
    base = fields.get("base_model_name_or_path")
    if not base or not Path(base).is_dir():
        raise LoraError(f"the adapter in {path} names no base model directory here ({base!r})")
    return str(base), int(fields["r"])
