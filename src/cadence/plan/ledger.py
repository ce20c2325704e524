"""`cadence plan CONFIG` for a run's own config: what each GPU of the run holds, buffer by buffer.

From the config and the model's shape alone (its `config.json`, or for a model not downloaded
yet a table of common ones: `plan/shapes.py`), before any GPU is touched: the learner ranks'
parameter and gradient shards, float32 masters, AdamW's moments, the layers FSDP2 gathers, the
frozen copies, one micro-batch's activations and logits chunks (`costs.activation_memory`), the
driver's process on GPU 0 (held-out evaluation's transient copy and cache), and each vLLM
worker's share. GPUs are the local backend's placement (`backend/placement.py`: ranks first,
then workers). Figures are the model's, not measurements (docs/planner.md says how far they fall
from measured peaks); a GPU over its memory is named. docs/scaling.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cadence.backend.placement import gpus_needed, place
from cadence.choices import engine_kind, loss_kind
from cadence.config import Config
from cadence.plan.costs import LOGITS_COPIES, ModelShape, activation_memory

CUDA_CONTEXT = 0.6e9  # a process's CUDA context and NCCL's buffers, about
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


PHASES = ("always", "training", "evaluating", "generating")


@dataclass
class GpuLedger:
    """One GPU: who uses it and what each holds, in bytes, and when (`PHASES`: always, or only
    while the learner trains, the driver evaluates or a colocated engine generates)."""

    index: int
    roles: list[str] = field(default_factory=list)
    buffers: dict[str, tuple[str, float]] = field(default_factory=dict)  # name -> (phase, bytes)

    def add(self, name: str, num_bytes: float, phase: str = "always") -> None:
        old = self.buffers.get(name, (phase, 0.0))[1]
        self.buffers[name] = (phase, old + num_bytes)

    def held(self, phase: str) -> float:
        return sum(b for p, b in self.buffers.values() if p == phase)

    @property
    def peak(self) -> float:
        """What is always held, and the heaviest phase's buffers (the phases take turns)."""
        return self.held("always") + max(self.held(p) for p in PHASES[1:])


def layer_params(shape: ModelShape) -> float:
    """Weights of one decoder layer: attention (q and o of h x h, k and v of h x kv), the gated
    MLP (3 h i) and two norms."""
    h, kv, i = shape.hidden, shape.kv_dim or shape.hidden, shape.intermediate or 4 * shape.hidden
    return 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h


def micro_batch_positions(cfg: Config) -> float:
    """The positions one micro-batch computes: the token budget (a sequence longer than it goes
    alone: at most one prompt and response more), or whole groups."""
    r, t = cfg.rollout, cfg.train
    prompt = r.max_prompt_tokens or 512
    if t.micro_batch_tokens:
        return max(t.micro_batch_tokens, prompt + r.max_new_tokens)
    return t.micro_batch_groups * (prompt + r.group_size * r.max_new_tokens)


def learner_buffers(cfg: Config, shape: ModelShape, ranks: int) -> dict[str, float]:
    """What one learner rank (or the one learner process) holds while it trains."""
    n = shape.params
    compute = DTYPE_BYTES[cfg.model.dtype]
    master = DTYPE_BYTES[cfg.learner.master_dtype]
    p, algo, lp = cfg.learner, cfg.algo, cfg.train
    reference = cfg.algo.kl_coef > 0 or loss_kind(algo.loss).pairs
    old = (lp.mini_batches > 1 or not p.reuse_old_logprobs) and not (
        loss_kind(algo.loss).pairs or algo.correction_proximal == "bypass"
    )
    out: dict[str, float] = {}
    if p.strategy == "fsdp" and ranks > 1:
        out[f"parameter shards ({cfg.learner.master_dtype})"] = n * master / ranks
        out["gradient shards"] = n * master / ranks
        out["AdamW moments (float32)"] = 8 * n / ranks
        out[f"gathered layers (2, {cfg.model.dtype})"] = 2 * layer_params(shape) * compute
        out["a layer's unsharded gradient"] = layer_params(shape) * master
        frozen = n * compute / ranks
    else:  # one process, or DDP: the whole model on every rank
        out[f"weights ({cfg.model.dtype})"] = n * compute
        if master != compute:
            out["float32 masters"] = n * 4
            out["masters' gradients"] = n * 4
            out[f"a micro-batch's gradients ({cfg.model.dtype})"] = n * compute
        else:
            out["gradients"] = n * compute
        out["AdamW moments (float32)"] = 8 * n
        frozen = n * compute
    if reference:
        out["frozen reference"] = frozen
    if old:
        out["frozen old policy"] = frozen
    positions = micro_batch_positions(cfg)
    chunk = p.logits_chunk_tokens
    both = activation_memory(shape, positions, p.activation_checkpointing, chunk)
    logits = min(positions, chunk or positions) * shape.vocab * 4 * LOGITS_COPIES
    out[f"activations ({positions:,.0f} positions)"] = both - logits
    out[f"logits ({min(positions, chunk or positions):,.0f} at a time, float32)"] = logits
    out["CUDA context"] = CUDA_CONTEXT
    return out


TRAINING_ONLY = (
    "activations",
    "logits",
    "a micro-batch's gradients",
    "a layer's unsharded",
    "gathered layers",
)


def ledger(cfg: Config, shape: ModelShape, gpu_bytes: float) -> list[GpuLedger]:
    """Every GPU of a CUDA run on one node (the local backend's placement)."""
    pipe, ranks = cfg.pipeline, cfg.learner.ranks
    rank_share = cfg.learner.num_gpus_per_rank or 1.0  # a CUDA learner holds a GPU
    colocated = pipe.placement == "colocated"
    workers = 0 if colocated else pipe.num_workers
    count = gpus_needed([rank_share] * ranks + [pipe.num_gpus_per_worker] * workers)
    visible = [str(i) for i in range(max(count, 1))]  # the node the run asks for
    placement = place(ranks, rank_share, workers, pipe.num_gpus_per_worker, visible)
    gpus = [GpuLedger(i) for i in range(max(count, 1))]
    train = learner_buffers(cfg, shape, ranks)
    for r, ids in enumerate(placement.ranks):
        for i in ids:
            gpu = gpus[int(i)]
            gpu.roles.append(f"learner rank {r}" if ranks > 1 else "learner")
            for name, value in train.items():
                phase = "training" if name.startswith(TRAINING_ONLY) else "always"
                gpu.add(name, value, phase)
    driver = gpus[0]
    if ranks > 1 and cfg.data.num_heldout and cfg.train.eval_every:
        slots = min(cfg.train.eval_max_num_seqs or cfg.rollout.max_num_seqs, cfg.data.num_heldout)
        seq = (cfg.rollout.max_prompt_tokens or 512) + cfg.rollout.max_new_tokens
        compute = DTYPE_BYTES[cfg.model.dtype]
        evaluation = shape.params * compute + slots * seq * shape.kv_bytes_per_token
        driver.roles.append("the driver's held-out evaluation")
        driver.add("held-out evaluation: a copy and its cache", evaluation, "evaluating")
        driver.add("the driver's CUDA context", CUDA_CONTEXT)
    vllm = engine_kind(cfg.rollout.engine).own_copy
    share = cfg.rollout.vllm.gpu_memory_utilization * gpu_bytes if vllm else 0.0
    if colocated and vllm:
        gpus[0].roles.append("colocated vLLM (asleep while the learner trains)")
        gpus[0].add("vLLM's share (asleep while the learner trains)", share, "generating")
    for w, ids in enumerate(placement.workers):
        for i in ids:
            gpu = gpus[int(i)]
            gpu.roles.append(f"rollout worker {w}")
            if vllm:
                gpu.add("vLLM's share (weights, KV cache, activations)", share)
            else:
                gpu.add("the worker's model", shape.params * DTYPE_BYTES[cfg.model.dtype])
    return gpus


def ledger_table(gpus: list[GpuLedger], gpu_bytes: float) -> str:
    """The ledger as markdown: a row per buffer, a column per GPU, the peak and the headroom."""
    names: dict[str, str] = {}
    for gpu in gpus:
        for name, (phase, _) in gpu.buffers.items():
            names.setdefault(name, phase)
    header = "| buffer (GB) | held | " + " | ".join(f"GPU {g.index}" for g in gpus) + " |"
    lines = [header, "|---" * (len(gpus) + 2) + "|"]
    for name, phase in names.items():
        cells = [_gb(g.buffers[name][1] if name in g.buffers else None) for g in gpus]
        lines.append(f"| {name} | {phase} | " + " | ".join(cells) + " |")
    lines.append("| **peak** | | " + " | ".join(f"**{g.peak / 1e9:.1f}**" for g in gpus) + " |")
    free = [f"{(gpu_bytes - g.peak) / 1e9:.1f}" for g in gpus]
    lines.append(f"| headroom of {gpu_bytes / 1e9:.0f} GB | | " + " | ".join(free) + " |")
    roles = "\n".join(f"- GPU {g.index}: {', '.join(g.roles) or 'idle'}" for g in gpus)
    return "\n".join(lines) + "\n\n" + roles


def over_memory(gpus: list[GpuLedger], gpu_bytes: float) -> list[int]:
    return [g.index for g in gpus if g.peak > gpu_bytes]


def _gb(value: float | None) -> str:
    return "" if value is None or math.isnan(value) else f"{value / 1e9:.1f}"
