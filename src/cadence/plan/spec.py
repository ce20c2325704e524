"""What `cadence plan` is asked: a TOML spec validated by pydantic, with dotted `--set` overrides.

The defaults are the worked example of docs/planner.md: a 7B model (Qwen2.5-7B's shape) on H100s,
512 prompts x 16 samples per iteration, lognormal long-tailed responses capped at 8192 tokens.
An unknown key or a bad value raises `ConfigError` naming the key (the CLI exits with code 2).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cadence.config import ConfigError, apply_overrides


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSpec(_Section):
    params: float = Field(7.6e9, gt=0, description="Parameters (N).")
    layers: int = Field(28, ge=1, description="Transformer layers (L).")
    hidden: int = Field(3584, ge=1, description="Hidden size (h).")
    kv_dim: int | None = Field(
        512, ge=1, description="Key (= value) width per layer; hidden unless grouped-query."
    )
    bytes_per_param: float = Field(2.0, gt=0, description="Bytes per weight and KV value.")
    intermediate: int | None = Field(
        18944, ge=1, description="MLP width (i): activation memory; unset: 4 x hidden."
    )
    vocab: int = Field(152064, ge=0, description="Output vocabulary (V): the logits' memory.")


class ResponseSpec(_Section):
    kind: Literal["fixed", "uniform", "lognormal", "empirical"] = Field(
        "lognormal", description="Response-length distribution."
    )
    tokens: int = Field(512, ge=1, description="fixed: every response's length.")
    low: int = Field(1, ge=1, description="uniform: shortest response.")
    high: int = Field(1024, ge=1, description="uniform: longest response.")
    mean: float = Field(1500.0, gt=0, description="lognormal: mean length before the cap.")
    sigma: float = Field(1.0, ge=0, description="lognormal: standard deviation of log length.")
    path: str | None = Field(
        None, description="empirical: metrics.jsonl, a run directory, or per-sample lengths."
    )

    @model_validator(mode="after")
    def _consistent(self) -> ResponseSpec:
        if self.kind == "uniform" and self.low > self.high:
            raise ValueError(f"low ({self.low}) must be <= high ({self.high})")
        if self.kind == "empirical" and not self.path:
            raise ValueError("kind = 'empirical' needs workload.response.path")
        return self


class WorkloadSpec(_Section):
    prompts_per_iteration: int = Field(512, ge=1, description="Groups per iteration.")
    group_size: int = Field(16, ge=1, description="Responses per prompt (G).")
    prompt_tokens: int = Field(256, ge=1, description="Prompt length in tokens (P).")
    max_new_tokens: int = Field(8192, ge=1, description="Longest response: lengths are capped.")
    micro_batch_groups: int = Field(32, ge=1, description="Groups per forward/backward.")
    micro_batch_tokens: int = Field(
        16384,
        ge=0,
        description="Tokens per forward/backward (train.micro_batch_tokens); 0: "
        "micro_batch_groups whole groups, each its prompt and G responses of max_new_tokens "
        "(the longest micro-batch: what memory must hold).",
    )
    activation_checkpointing: bool = Field(
        True,
        description="learner.activation_checkpointing: one saved input per layer, each layer "
        "run again in the backward (a third more training compute).",
    )
    logits_chunk_tokens: int = Field(
        1024, ge=0, description="learner.logits_chunk_tokens: logits held for this many tokens."
    )
    shared_prompt: bool = Field(True, description="Learner computes each prompt once per group.")
    layout: Literal["packed", "prefix", "dense"] = Field(
        "packed",
        description="learner.shared_prompt_impl: the positions the learner computes and is timed "
        "by: packed and dense a group's prompt and responses, prefix every response padded to "
        "its group's longest.",
    )
    reference_model: bool = Field(True, description="A frozen reference forward (KL term).")
    response: ResponseSpec = Field(default_factory=ResponseSpec)


class HardwareSpec(_Section):
    profile: str | None = Field(
        None,
        description="Throughput profile JSON (from --calibrate, or written by hand); "
        "when set, the peak rates below are not used.",
    )
    name: str = Field("H100-SXM-80GB", description="Label in the outputs.")
    flops: float = Field(989e12, gt=0, description="Peak dense bf16 FLOP/s per device.")
    mem_bw: float = Field(3.35e12, gt=0, description="Memory bandwidth per device, bytes/s.")
    memory_gb: float = Field(80.0, gt=0, description="Device memory, GB (1e9 bytes).")
    mem_efficiency: float = Field(0.8, gt=0, le=1, description="Reached fraction of mem_bw.")
    decode_efficiency: float = Field(0.5, gt=0, le=1, description="Decode matmul FLOP fraction.")
    prefill_efficiency: float = Field(0.5, gt=0, le=1, description="Prefill FLOP fraction.")
    train_mfu: float = Field(0.4, gt=0, le=1, description="Training model FLOP utilisation.")
    network_bw: float = Field(50e9, gt=0, description="Bytes/s per device for gradients.")
    sync_bw: float = Field(50e9, gt=0, description="Bytes/s from learner to an engine.")
    sync_latency_s: float = Field(0.05, ge=0, description="Fixed cost of one weight load.")
    host_copy_bw: float = Field(
        10e9, gt=0, description="Bytes/s of one copy through host memory (the object store's)."
    )
    step_overhead_s: float = Field(0.001, ge=0, description="Per decode step (scheduling).")
    kv_memory_fraction: float = Field(
        0.9, gt=0, le=1, description="Fraction of memory an engine fills (weights + KV cache)."
    )
    train_memory_fraction: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Fraction of memory a training rank may fill: its state (weights, "
        "gradients, optimizer state, frozen reference) and one micro-batch's activations and "
        "logits; the rest is left to the allocator's slack.",
    )


class ClusterSpec(_Section):
    devices: list[int] = Field(
        default_factory=lambda: [16, 64], description="Cluster sizes to plan (devices each)."
    )
    engine_devices: int = Field(1, ge=1, description="Devices per inference engine (TP).")
    colocated_engine_devices: int = Field(
        0,
        ge=0,
        description="Devices per engine when colocated (0: engine_devices; a CPU "
        "machine's colocated engine is one process on all its cores).",
    )
    max_num_seqs: int = Field(256, ge=1, description="Most sequences an engine holds.")
    samples_in_flight: int = Field(
        0,
        ge=0,
        description="Separate engines: most samples a worker is sent at once (the local "
        "backend's tasks_in_flight x prompts_per_task x group_size); 0: no bound.",
    )
    batching: Literal["continuous", "static"] = Field(
        "continuous", description="continuous (vLLM-like) or static (the local worker backend)."
    )
    learner_strategy: Literal["fsdp", "ddp"] = Field(
        "fsdp",
        description="How the training devices (the learner's ranks) hold the model: fsdp "
        "shards the training state over them, ddp gives each a whole copy.",
    )
    prompts_per_task: int = Field(4, ge=1, description="static: prompts per engine batch.")
    weight_sync: Literal["broadcast", "object_store", "shm"] = Field(
        "broadcast",
        description="How separate engines get a version (pipeline.weight_sync; shm: the local "
        "backend's shared memory): the learner's and each engine's seconds, the copies made "
        "and a broadcast's bucket of engine memory (docs/planner.md). Not used with "
        "hardware.profile, whose times are measured.",
    )

    @field_validator("devices")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if not v or any(d < 1 for d in v):
            raise ValueError(f"devices must be a non-empty list of positive counts; got {v}")
        return v


_MODE = re.compile(
    r"^(sync-colocated|sync|periodic|(offpolicy|partial)-([1-9][0-9]*)(-recompute)?)$"
)
MODE_NAMES = "sync-colocated, sync, periodic, offpolicy-N, partial-N, partial-N-recompute"


class PlanSettings(_Section):
    modes: list[str] = Field(
        default_factory=lambda: [
            "sync-colocated",
            "sync",
            "periodic",
            "offpolicy-1",
            "offpolicy-2",
        ],
        description="Modes to simulate: sync-colocated, sync, periodic, offpolicy-N (N >= 1), "
        "partial-N (offpolicy-N with partial rollouts, keeping the KV cache) and "
        "partial-N-recompute (re-prefilling it).",
    )
    iterations: int = Field(
        5, ge=1, description="Iterations measured per mode and split, after the pipeline fills."
    )
    seed: int = Field(0, description="Seed of the response-length draws.")
    splits: list[int] = Field(
        default_factory=list,
        description="Inference device counts to simulate (empty: search every cluster size).",
    )

    @field_validator("modes")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        bad = [m for m in v if not _known(m)]
        if bad or not v:
            raise ValueError(f"unknown mode(s) {bad}; allowed: {MODE_NAMES}")
        return v


class PlanSpec(_Section):
    model: ModelSpec = Field(default_factory=ModelSpec)
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec)
    hardware: HardwareSpec = Field(default_factory=HardwareSpec)
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    plan: PlanSettings = Field(default_factory=PlanSettings)

    @model_validator(mode="after")
    def _fits(self) -> PlanSpec:
        r, w = self.workload.response, self.workload
        if r.kind == "fixed" and r.tokens > w.max_new_tokens:
            raise ValueError(
                f"workload.response.tokens ({r.tokens}) exceeds workload.max_new_tokens "
                f"({w.max_new_tokens})"
            )
        return self


def _format_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(root)"
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        lines.append(f"plan key '{key}': {msg}")
    return "\n".join(lines)


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` laid on `base`, section by section (a new dict; neither input changes)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_spec(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    base: dict[str, Any] | None = None,
) -> PlanSpec:
    """`base` (e.g. derived from a training config), then the TOML file, then the overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"plan file '{p}' does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"plan file '{p}' is not valid TOML: {e}") from e
    data = merge(base or {}, data)
    apply_overrides(data, overrides or [])
    try:
        return PlanSpec.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None


def _known(name: str) -> bool:
    m = _MODE.match(name)
    return m is not None and not (m.group(2) == "offpolicy" and m.group(4))  # no offpolicy-1-rec.


def parse_mode(name: str) -> tuple[str, str, int, str]:
    """A mode name as (mode, placement, N, partial): 'offpolicy-2' -> ('offpolicy', 'separate',
    2, ''); 'partial-1-recompute' -> ('offpolicy', 'separate', 1, 'recompute')."""
    m = _MODE.match(name)
    if m is None or not _known(name):
        raise ConfigError(f"plan key 'plan.modes': unknown mode {name!r}; allowed: {MODE_NAMES}")
    if name == "sync-colocated":
        return "sync", "colocated", 0, ""
    if m.group(2):
        partial = ("recompute" if m.group(4) else "keep") if m.group(2) == "partial" else ""
        return "offpolicy", "separate", int(m.group(3)), partial
    return name, "separate", 0, ""
