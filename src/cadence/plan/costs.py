"""What each piece of work costs on one device: the planner's throughput model and its formulas.

Read on: docs/planner.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace


@dataclass(frozen=True)
class ModelShape:
    params: float  # N
    layers: int  # L
    hidden: int  # h
    kv_dim: int | None = None  # width of keys (= values) per layer; hidden unless GQA
    bytes_per_param: float = 2.0  # bf16 weights, KV cache and gradients
    intermediate: int | None = None  # MLP width (i); 4 h unless given
    vocab: int = 0  # output vocabulary (V): the logits' memory; 0 leaves them out

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * (self.kv_dim or self.hidden) * self.bytes_per_param


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator described by its peak rates, and the fractions of them that work reaches."""

    name: str
    flops: float  # peak dense FLOP/s at the training/inference precision
    mem_bw: float  # bytes/s
    memory_bytes: float
    mem_efficiency: float = 0.8  # fraction of mem_bw a decode step or copy reaches
    decode_efficiency: float = 0.5  # fraction of flops a decode step's matmuls reach
    prefill_efficiency: float = 0.5
    train_mfu: float = 0.4  # model FLOP utilisation of forward + backward
    network_bw: float = 50e9  # bytes/s per device between nodes (gradient reduction)
    sync_bw: float = 50e9  # bytes/s from the learner to an inference engine
    sync_latency_s: float = 0.05
    host_copy_bw: float = 10e9  # bytes/s of one copy through host memory (serialising, the store)
    step_overhead_s: float = 0.001  # per decode step: scheduling, sampling, launches
    kv_memory_fraction: float = 0.9  # of memory an engine may fill (weights + KV cache)
    train_memory_fraction: float = 0.9  # of memory a training rank's state may fill


@dataclass(frozen=True)
class Throughput:
    """Seconds: decoding, prefill, scoring and weight loads per inference engine (one device,
    or `engine_devices` with tensor parallelism); training per training device."""

    decode_step_s: float  # per decode step, whatever the batch (weights read, overhead)
    decode_per_seq_s: float  # per decode step per active sequence (compute, sampling)
    decode_per_ctx_token_s: float  # per decode step per token held in the KV cache
    prefill_per_token_s: float
    train_per_token_s: float  # per token the learner computes, on one training device
    train_microbatch_s: float = 0.0  # fixed cost of one forward/backward call
    optimizer_update_s: float = 0.0  # optimizer update of the whole model on one device
    allreduce_s: float = 0.0  # gradient reduction per step when training on > 1 device
    publish_s: float = 0.0  # learner copies its weights to where engines load them
    load_s: float = 0.0  # an engine loads a published version
    score_per_sample_s: float = 0.0  # reward of one response (on the engine's host)
    kv_cache_bytes: float = math.inf  # memory an engine has for its KV cache
    kv_bytes_per_token: float = 0.0
    train_state_bytes: float = 0.0  # weights + grads + optimizer state (colocated engines share)
    # under float32 masters, the compute-dtype model each whole copy also holds (DDP, one
    # process), and its gradients for one micro-batch; FSDP2 gathers it layer by layer instead
    compute_copy_bytes: float = 0.0
    frozen_bytes: float = 0.0  # the frozen reference's weights (no gradients, no optimizer state)
    layer_bytes: float = 0.0  # one decoder layer's weights: what FSDP gathers at a time
    gather_s: float = 0.0  # all-gathering the whole weights once over the training network
    train_memory_bytes: float = math.inf  # what a training device may hold (no memory model)
    activation_bytes: float = 0.0  # a micro-batch's activations and logits at their peak
    sync_copies: float = 0.0  # copies of a version between the learner and an engine
    sync_extra_bytes: float = 0.0  # device memory a weight sync adds beside each engine

    def decode_time(self, active: int, context: float, steps: int) -> float:
        """`steps` decode steps of `active` sequences holding `context` tokens at the start.

        Every step adds one token to every sequence, so step i holds context + active x i.
        """
        per_step = self.decode_step_s + self.decode_per_seq_s * active
        kv = self.decode_per_ctx_token_s * (steps * context + active * steps * (steps - 1) / 2)
        return steps * per_step + kv

    def train_time(self, tokens: float, devices: int, strategy: str = "fsdp") -> float:
        """One round: `tokens` computed tokens split evenly over `devices` ranks, each running
        its micro-batch. FSDP gathers each layer's weights for the forward and the backward and
        reduce-scatters its gradients meanwhile (3 W (D - 1) / D per rank), hidden behind the
        compute unless it takes longer; DDP communicates only at the step."""
        compute = tokens * self.train_per_token_s / devices
        if strategy == "fsdp" and devices > 1:
            compute = max(compute, 3 * self.gather_s * (devices - 1) / devices)
        return compute + self.train_microbatch_s

    def optimizer_time(self, devices: int, strategy: str = "fsdp") -> float:
        """The step: each FSDP rank updates its shard, each DDP rank the whole model; plus the
        collectives no compute hides (FSDP: the last round's reduce-scatter and the next
        forward's first gathers; DDP: the gradient all-reduce), about 2 W over the network."""
        update = self.optimizer_update_s / (devices if strategy == "fsdp" else 1)
        return update + (self.allreduce_s if devices > 1 else 0.0)

    def rank_memory(self, devices: int, strategy: str = "fsdp") -> float:
        """Bytes one training rank holds: the training state and the frozen reference, sharded
        over the ranks (FSDP, plus one gathered layer and its gradient) or whole (DDP), and one
        micro-batch's activations and logits (`activation_memory`)."""
        state = self.train_state_bytes + self.frozen_bytes
        if strategy == "ddp":  # 16 bytes a parameter, and the bf16 model and its gradients
            return state + 2 * self.compute_copy_bytes + self.activation_bytes
        return state / devices + 2 * self.layer_bytes + self.activation_bytes

    def fits(self, devices: int, strategy: str = "fsdp") -> bool:
        return self.rank_memory(devices, strategy) <= self.train_memory_bytes

    def slots(self, max_num_seqs: int, seq_tokens: float, colocated_devices: int = 0) -> int:
        """Sequences an engine can hold: max_num_seqs, or fewer when the KV cache runs out.

        `colocated_devices` > 0: training state, sharded over that many devices, stays resident.
        """
        free = self.kv_cache_bytes
        if colocated_devices:
            free -= self.train_state_bytes / colocated_devices
        if math.isinf(free) or self.kv_bytes_per_token <= 0:
            return max_num_seqs
        fit = int(free // (self.kv_bytes_per_token * max(seq_tokens, 1.0)))
        return max(1, min(max_num_seqs, fit))

    def to_dict(self) -> dict[str, float | None]:
        return {k: (None if math.isinf(v) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict) -> Throughput:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown throughput field(s) {unknown}; allowed: {sorted(names)}")
        clean = {k: (math.inf if v is None else float(v)) for k, v in data.items()}
        return cls(**clean)


@dataclass(frozen=True)
class Profile:
    """Costs for separate placement (inference and training on their own devices) and colocated.

    `tpspd_devices`: the device count TPSPD divides by, when it is not the cluster's (a CPU
    machine counts as one device however its cores are split).
    """

    name: str
    separate: Throughput
    colocated: Throughput
    source: str = ""
    tpspd_devices: int | None = None
    extra: dict = field(default_factory=dict)  # calibration measurements, for the record

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "source": self.source,
            "tpspd_devices": self.tpspd_devices,
            "separate": self.separate.to_dict(),
            "colocated": self.colocated.to_dict(),
            "extra": self.extra,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Profile:
        return cls(
            name=str(data.get("name", "profile")),
            separate=Throughput.from_dict(data["separate"]),
            colocated=Throughput.from_dict(data.get("colocated", data["separate"])),
            source=str(data.get("source", "")),
            tpspd_devices=data.get("tpspd_devices"),
            extra=dict(data.get("extra", {})),
        )


# A micro-batch's memory, per token, fitted to a learner's measured peak (benchmarks/
# plan_memory.py: two sdpa Llamas on the CPU, each within 10% of it; docs/planner.md): a decoder
# layer keeps about 8 x hidden (norms, attention inputs and output, residuals) + 4 x
# intermediate (the gated MLP) values; the output projection about 5 float32 [rows, V] tensors
# (logits, their softmax, gradients); checkpointed, a layer run again in the backward holds
# about 0.6 of its values at the worst moment (they are consumed as they are made)
ACT_PER_HIDDEN, ACT_PER_INTERMEDIATE = 8, 4
LOGITS_COPIES = 5
RECOMPUTED = 0.6


def activation_memory(
    model: ModelShape, tokens: float, checkpointing: bool = False, logits_chunk: int = 0
) -> float:
    """Peak bytes one micro-batch of `tokens` tokens adds in its forward and backward, in the
    model's compute dtype: every decoder layer's saved values (with `checkpointing`: each
    layer's input, and part of one layer's values while it runs again), and the output projection's
    float32 logits: of every token, or of `logits_chunk` tokens at a time."""
    inter = model.intermediate or 4 * model.hidden
    one_layer = tokens * (ACT_PER_HIDDEN * model.hidden + ACT_PER_INTERMEDIATE * inter)
    if checkpointing:
        values = tokens * model.layers * model.hidden + RECOMPUTED * one_layer
    else:
        values = model.layers * one_layer
    rows = min(tokens, logits_chunk) if logits_chunk else tokens
    return values * model.bytes_per_param + rows * model.vocab * 4 * LOGITS_COPIES


def train_flops_per_token(
    model: ModelShape, seq_tokens: float, reference_model: bool, checkpointing: bool = False
) -> float:
    """Forward + backward (3 x forward) FLOPs per token, plus a no-grad reference forward, plus
    the forward run again under activation checkpointing."""
    # attention: 4 h FLOPs per token of context per layer, and the mean context is S / 2
    forward = 2 * model.params + 2 * model.layers * model.hidden * seq_tokens
    return forward * (3 + (1 if reference_model else 0) + (1 if checkpointing else 0))


SYNC_BUCKET_BYTES = 64 << 20  # backend/ray/weights.BUCKET_BYTES: a broadcast's unit
TRANSPORTS = ("broadcast", "object_store", "shm")


def sync_costs(transport: str, weight_bytes: float, device: DeviceSpec) -> dict[str, float]:
    """A version's trip from the learner to an engine over `transport` (`pipeline.weight_sync`;
    shm: the local backend's shared memory): the learner's seconds (on its critical path), each
    engine's, the copies made (docs/ray.md counts them) and the device memory added per engine.

    broadcast: a device copy into the learner's snapshot, the wire (`sync_bw`), each 64 MiB
    bucket copied into the engine as the next one arrives (one bucket of extra memory).
    object_store: device to host, the put (a host copy), the transfer to the engine's node
    (`network_bw`), host to device into the engine. shm: into shared host memory, out of it."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown weight transport {transport!r}; allowed: {TRANSPORTS}")
    local = weight_bytes / (device.mem_bw * device.mem_efficiency)
    link, host = weight_bytes / device.sync_bw, weight_bytes / device.host_copy_bw
    lat = device.sync_latency_s
    if transport == "broadcast":
        both = lat + link  # the collective ends for the sender and the receivers together
        return dict(
            publish_s=local + both, load_s=both + local, sync_copies=2.0,
            sync_extra_bytes=float(min(SYNC_BUCKET_BYTES, weight_bytes)),
        )  # fmt: skip
    if transport == "object_store":
        wire = weight_bytes / device.network_bw
        return dict(
            publish_s=lat + link + host, load_s=wire + link, sync_copies=4.0, sync_extra_bytes=0.0
        )
    return dict(publish_s=lat + link, load_s=link, sync_copies=2.0, sync_extra_bytes=0.0)


def from_hardware(
    model: ModelShape,
    device: DeviceSpec,
    *,
    seq_tokens: float,
    reference_model: bool,
    engine_devices: int = 1,
    micro_batch_tokens: float = 0.0,
    checkpointing: bool = False,
    logits_chunk: int = 0,
    weight_sync: str = "broadcast",
) -> Profile:
    """Throughput of `device` for `model` from its peak rates (the formulas in the docstring);
    separate engines take versions over `weight_sync` (`sync_costs`)."""
    f, bw = device.flops, device.mem_bw * device.mem_efficiency
    w = model.weight_bytes
    tp = engine_devices  # an engine spanning tp devices: tp x the rates, 1/tp of the weights each
    sync = sync_costs(weight_sync, w, device)
    kv_free = device.memory_bytes * device.kv_memory_fraction * tp - w
    base = Throughput(
        decode_step_s=w / (tp * bw) + device.step_overhead_s,
        decode_per_seq_s=2 * model.params / (tp * device.decode_efficiency * f),
        decode_per_ctx_token_s=model.kv_bytes_per_token / (tp * bw),
        prefill_per_token_s=2 * model.params / (tp * device.prefill_efficiency * f),
        train_per_token_s=train_flops_per_token(model, seq_tokens, reference_model, checkpointing)
        / (device.train_mfu * f),
        optimizer_update_s=16 * model.params / bw,
        allreduce_s=2 * w / device.network_bw,
        **sync,
        kv_cache_bytes=max(kv_free - sync["sync_extra_bytes"], 0.0),
        kv_bytes_per_token=model.kv_bytes_per_token,
        train_state_bytes=16 * model.params,
        compute_copy_bytes=w if model.bytes_per_param < 4 else 0.0,
        frozen_bytes=w if reference_model else 0.0,
        layer_bytes=w / model.layers,
        gather_s=w / device.network_bw,
        train_memory_bytes=device.memory_bytes * device.train_memory_fraction,
        activation_bytes=activation_memory(model, micro_batch_tokens, checkpointing, logits_chunk),
    )
    colocated = replace(  # reshard in place: one local copy, no transport
        base,
        publish_s=0.0,
        load_s=w / bw,
        sync_copies=1.0,
        sync_extra_bytes=0.0,
        kv_cache_bytes=max(kv_free, 0.0),
    )
    return Profile(
        name=device.name,
        separate=base,
        colocated=colocated,
        source=f"from peak rates: {device.flops / 1e12:g} TFLOP/s, "
        f"{device.mem_bw / 1e12:g} TB/s, {device.memory_bytes / 1e9:g} GB",
    )
