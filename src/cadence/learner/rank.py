"""The learner as one of N torch.distributed ranks, FSDP2 or DDP: what runs inside each rank.

Read on: docs/ranks.md.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from cadence.algo import AlgoParams, needs_reference
from cadence.learner.checkpointing import checkpoint_layers, decoder_layers
from cadence.learner.distill import DistillParams, Teachers
from cadence.learner.learner import Learner
from cadence.learner.packing import install_checked_head
from cadence.learner.params import Collective, LearnerParams
from cadence.learner.precision import Masters
from cadence.learner.scorer import Scored
from cadence.learner.sharded_state import load_sharded, save_sharded
from cadence.learner.sums import StepSums, peak_memory
from cadence.learner.tensors import is_dtensor, local_tensor, model_bytes, synchronize
from cadence.metrics.trace import Span, Tracer
from cadence.models import DTYPES, load_model
from cadence.types import Completion, Group, Prompt

STRATEGIES = ("fsdp", "ddp")


@dataclass(frozen=True)
class RankSpec:
    """What every rank builds itself from (the same for all ranks of a run)."""

    model_path: str
    params: LearnerParams
    algo: AlgoParams
    pad_id: int
    world_size: int
    strategy: str = "fsdp"
    dtype: str = "float32"  # the compute dtype (model.dtype)
    master_dtype: str = "float32"  # what the optimizer steps (learner.master_dtype)
    threads: int = 1
    timeout_s: float = 300.0
    # on-policy distillation: (task, teacher directory) pairs (task "": every task; directory
    # "": a teacher stage scores the rows) and the advantage's weights; each rank holds each
    # teacher as it holds the reference
    teachers: tuple[tuple[str, str], ...] = ()
    distill: DistillParams = field(default_factory=DistillParams)


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: a torch.distributed init method and environment variables to set
    first (e.g. GLOO_SOCKET_IFNAME=lo to keep gloo on loopback)."""

    init_method: str
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class RoundReply:
    """A rank's answer to one round: the step's figures (when the round ended a step), the spans
    it recorded (on its own clock) and its peak memory so far."""

    step: dict[str, float] | None
    spans: list[Span]
    memory: dict[str, float]


class Rank(Protocol):
    """The calls a driver makes of each rank, in the order it makes them."""

    def begin(self, version: int) -> None:
        """Start an iteration at policy `version`."""
        ...

    def train_round(self, groups: list[Scored], step: bool) -> RoundReply:
        """Train this rank's share of a round (maybe none) and, if `step`, step with the others."""
        ...

    def gather_weights(self) -> dict[str, np.ndarray] | None:
        """The full parameters, gathered by every rank; what rank 0 hands out (or None)."""
        ...

    def save(self, path: str) -> dict[str, Any]:
        """Write this rank's shards under `path`; what of its state is not a tensor."""
        ...

    def load(self, path: str, state: dict[str, Any]) -> None:
        """Read the shards under `path` back, and `state` as `save` returned it."""
        ...

    def describe(self) -> dict[str, Any]:
        """What this rank holds (bytes of training state, FSDP units, devices) and its pid."""
        ...

    def close(self) -> None: ...


def build_rank(
    rank: int,
    spec: RankSpec,
    shared: dict[str, torch.Tensor] | None,
    rendezvous: Rendezvous,
    device: str,
) -> RankLearner:
    """A rank's object as the rank transports build it: `factory(rank, *spawn args, *build
    args)`, the spawn arguments (spec, shared tensors) first."""
    return RankLearner(rank, spec, rendezvous, device, shared)


class RankLearner:
    """One rank: the process group, its (sharded or replicated) models and its `Learner`.

    `device` is this rank's ("cpu", or its own "cuda:i"); `shared` (rank 0 of local ranks only)
    are the driver's parameter tensors in shared memory, which `gather_weights` writes."""

    def __init__(
        self,
        rank: int,
        spec: RankSpec,
        rendezvous: Rendezvous,
        device: str = "cpu",
        shared: dict[str, torch.Tensor] | None = None,
    ) -> None:
        if spec.strategy not in STRATEGIES:
            raise ValueError(f"unknown learner.strategy {spec.strategy!r}; allowed: fsdp, ddp")
        self.rank, self.spec, self.shared = rank, spec, shared
        self.device = torch.device(device)
        torch.set_num_threads(spec.threads)
        _init_group(rank, spec, rendezvous, self.device)
        self.tracer = Tracer()
        self.tracer.origin = 0.0  # spans in time.perf_counter() seconds: the driver rebases them
        self.masters: Masters | None = None  # DDP under mixed precision: float32 masters
        self.model, self.ddp, ref = self._build()
        self.learner = Learner(
            self.model,
            spec.params,
            spec.algo,
            spec.pad_id,
            ref_model=ref,
            tracer=self.tracer,
            collective=Collective(
                reduce_sums=self._reduce_sums, forward_model=self.ddp, old_copy=self._frozen
            ),
            track=f"learner-{rank}",
            masters=self.masters,
            teachers=self._teachers(),
        )
        if spec.strategy == "fsdp":  # the layout check's forward left the root unsharded
            self.model.reshard()
        self.sums = StepSums()

    def _load(self, dtype: str, path: str = "") -> torch.nn.Module:
        """The model (or the one at `path`) in `dtype`, its layers checkpointed and its
        `LogprobHead` in place before any sharding (FSDP2 swaps the parameters of the modules it
        was given)."""
        model = load_model(path or self.spec.model_path, dtype=DTYPES[dtype], device="cpu")
        if self.spec.params.activation_checkpointing:
            checkpoint_layers(model)
        if self.spec.params.logits_chunk_tokens:
            install_checked_head(model, self.spec.params.logits_chunk_tokens, self.spec.pad_id)
        return model

    def _build(self) -> tuple[torch.nn.Module, Any, torch.nn.Module | None]:
        """(policy, its DDP wrapper or None, reference or None). The policy is loaded in the
        master dtype: FSDP2 casts it to the compute dtype for each pass (MixedPrecisionPolicy,
        gradients reduced in float32); DDP splits float32 masters off a model in the compute
        dtype, whose gradients it all-reduces in float32 every round."""
        spec = self.spec
        model = self._load(spec.master_dtype)
        algo = spec.algo  # a reference exactly when the algorithm needs one
        ref = self._frozen(model) if needs_reference(algo.loss, algo.kl_coef) else None
        if spec.strategy == "fsdp":
            mixed = (spec.dtype, spec.master_dtype) if spec.dtype != spec.master_dtype else None
            return _fully_shard(model, self.device, frozen=False, mixed=mixed), None, ref
        from torch.nn.parallel import DistributedDataParallel

        model, self.masters = replicate(model, self.device, spec.dtype, spec.master_dtype)
        cuda = self.device.type == "cuda"
        ddp = DistributedDataParallel(
            model, device_ids=[self.device] if cuda else None, forward_sync_buffers=False
        )
        ddp.register_comm_hook(None, _sum_gradients)
        return model, ddp, ref

    def _frozen(self, model: torch.nn.Module | None, path: str = "") -> torch.nn.Module:
        """A frozen copy as this strategy holds it: the reference, the old policy (whose
        weights `Learner.begin_iteration` loads from the policy's state dict) or the teacher at
        `path`."""
        copy = self._load(self.spec.dtype, path).requires_grad_(False).eval()
        if self.spec.strategy == "fsdp":
            return _fully_shard(copy, self.device, frozen=True)
        return copy.to(self.device)

    def _teachers(self) -> Teachers | None:
        """The spec's teachers, each directory loaded once and held as the reference is
        (sharded under FSDP2, whose passes are collectives: every teacher then scores every
        micro-batch on every rank, so that the ranks' passes match)."""
        if not self.spec.teachers:
            return None
        paths = dict.fromkeys(path for _, path in self.spec.teachers if path)
        loaded = {path: self._frozen(None, path) for path in paths}  # "": a stage's rows
        models = {task: loaded.get(path) for task, path in self.spec.teachers}
        return Teachers(models, self.spec.distill, every_pass=self.spec.strategy == "fsdp")

    # --- calls from the driver ------------------------------------------------------------

    def begin(self, version: int) -> None:
        """Start an iteration at policy `version`."""
        self.learner.begin_iteration(version)

    def train_round(self, groups: list[Scored], step: bool) -> RoundReply:
        """This rank's micro-batch of one round (maybe none), and the optimizer step if the round
        ends one. Returns the step's figures (when stepping), its spans and memory."""
        # DDP all-reduces only in a step's last round, unless float32 masters take each round's
        # gradients as it ends (they must be reduced by then)
        last = self.ddp is not None and (step or self.masters is not None)
        sync = contextlib.nullcontext() if self.ddp is None or last else self.ddp.no_sync()
        with sync:
            if groups:
                self.learner.forward_backward(groups, self.sums)
            elif self.ddp is None or last:  # collectives in this round's passes: join them
                self.learner.forward_backward([self._idle_group()], self.sums, idle=True)
        figures = None
        if step:
            figures, self.sums = self.learner.step(self.sums), StepSums()
        spans, self.tracer.spans = self.tracer.spans, []
        return RoundReply(figures, spans, peak_memory(self.device))

    def _idle_group(self) -> Scored:
        """Two one-token responses after a one-token prompt, rewards 0 and 1 and advantages -1
        and 1 (no tie, so a pair loss reaches every parameter too; the idle pass multiplies the
        loss by 0 anyway), fresh at the learner's version."""
        pad = self.spec.pad_id
        completions = [Completion([pad], [0.0], reward=float(r)) for r in (0, 1)]
        teachers = self.learner.forward.teachers  # placeholder rows some teacher scores
        task = teachers.any_task if teachers is not None else ""
        prompt = Prompt("idle", "", "", task=task)
        group = Group(prompt, [pad], completions, self.learner.version, -1)
        rewards = torch.tensor([0.0, 1.0])  # (2,)
        return Scored(group, rewards, 2 * rewards - 1, torch.ones(2, dtype=torch.bool))

    def _reduce_sums(self, sums: StepSums) -> None:
        """Every rank's step sums added up and maxima the largest, in place; the same names on
        every rank (checked)."""
        import torch.distributed as dist

        names, maxima = sorted(sums.values), sorted(sums.maxima)
        digest = float(zlib.crc32((",".join(names) + "|" + ",".join(maxima)).encode()))
        # one MAX-reduce checks the names and takes the maxima, one SUM-reduce the sums
        top = [digest, -digest, *(sums.maxima[k] for k in maxima)]
        largest = torch.tensor(top, dtype=torch.float64, device=self.device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        if largest[:2].tolist() != [digest, -digest]:
            raise RuntimeError(
                f"rank {self.rank}: the ranks' step sums differ in names: {names}, {maxima}"
            )
        total = torch.tensor(
            [sums.values[k] for k in names], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(total)
        sums.values = dict(zip(names, total.tolist(), strict=True))
        sums.maxima = dict(zip(maxima, largest[2:].tolist(), strict=True))

    @torch.no_grad()
    def gather_weights(self) -> dict[str, np.ndarray] | None:
        """The policy's full parameters: into `shared` (rank 0 with shared tensors; returns
        None), else as numpy arrays from rank 0 (None from the others). Every rank must call
        it: each parameter is all-gathered in turn, so one full tensor is held at a time."""
        out: dict[str, np.ndarray] = {}
        with self.tracer.span("gather_weights", self.learner.track):
            for name, p in self.model.named_parameters():
                full = p.full_tensor() if is_dtensor(p) else p.detach()
                if self.rank != 0:
                    continue
                if self.shared is not None:
                    self.shared[name].copy_(full)
                else:
                    out[name] = _to_numpy(full.to(DTYPES[self.spec.dtype]))
            if self.rank == 0:
                # the copies above are queued on a GPU: the reply must not tell the driver a
                # version is in place while part of it is still the last one
                synchronize(self.device)
        return out if self.rank == 0 and self.shared is None else None

    def save(self, path: str) -> dict[str, Any]:
        """Write this rank's shards under `path` (see learner/sharded_state.py); what is not a
        tensor (the schedule, the bad-step count), the same on every rank, for the driver's
        state."""
        save_sharded(self.model, self.learner.optimizer, Path(path))
        return {
            "scheduler": self.learner.scheduler.state_dict(),
            "bad_steps_in_a_row": self.learner.bad_steps.in_a_row,
        }

    def load(self, path: str, state: dict[str, Any]) -> None:
        """Resume: parameters and optimizer state from the shards under `path`, whatever number
        of ranks wrote them; `state` is what `save` returned."""
        load_sharded(self.model, self.learner.optimizer, Path(path))
        scheduler = self.learner.scheduler
        scheduler.load_state_dict(state["scheduler"])
        # the learning rate the schedule had reached: the shards hold no param_groups
        for group, lr in zip(
            self.learner.optimizer.param_groups, scheduler.get_last_lr(), strict=True
        ):
            group["lr"] = lr
        self.learner.bad_steps.in_a_row = state["bad_steps_in_a_row"]

    def describe(self) -> dict[str, Any]:
        """What this rank holds (its shards, with FSDP), where, and its process id: the FSDP
        units of its policy, the device of its parameters and of its float32 masters (DDP under
        mixed precision), as `make gpu-check` reports them."""
        from torch.distributed.fsdp import FSDPModule

        units = sum(isinstance(m, FSDPModule) for m in self.model.modules())
        where = {"fsdp_units": units, "param_device": str(next(self.model.parameters()).device)}
        if self.masters is not None:
            where["master_device"] = str(self.masters.params[0].device)
        return state_bytes(self.learner) | where | {"pid": os.getpid()}

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def state_bytes(learner: Learner) -> dict[str, int]:
    """Bytes of training state a learner's process holds (a DTensor counts its local shard):
    `param_bytes` of the policy, `optimizer_bytes` of the optimizer's state (none before the
    first step), `frozen_bytes` of the reference and old copies; gradients, while they exist,
    take as much as the parameters."""
    optimizer = 0
    for state in learner.optimizer.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor):
                local = local_tensor(t)
                optimizer += local.numel() * local.element_size()
    return {
        "param_bytes": model_bytes(learner.model),
        "optimizer_bytes": optimizer,
        "frozen_bytes": learner.frozen_copies_bytes,
    }


def _init_group(rank: int, spec: RankSpec, rendezvous: Rendezvous, device: torch.device) -> None:
    import torch.distributed as dist

    os.environ.update(rendezvous.env)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=rendezvous.init_method,
        rank=rank,
        world_size=spec.world_size,
        timeout=datetime.timedelta(seconds=spec.timeout_s),
    )


def _fully_shard(
    model: torch.nn.Module,
    device: torch.device,
    frozen: bool,
    mixed: tuple[str, str] | None = None,
) -> torch.nn.Module:
    """FSDP2 over each decoder layer and the root, on `device`'s kind, gradients reduced with a
    plain SUM (the learner divides by the global normaliser itself). A frozen copy reshards its
    root after each forward too: it has no backward to do it. `mixed` = (compute, reduce)
    dtypes: shards kept in the loaded dtype, passes in the compute dtype, gradients reduced in
    float32 (`MixedPrecisionPolicy`)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy()
    if mixed is not None:
        policy = MixedPrecisionPolicy(param_dtype=DTYPES[mixed[0]], reduce_dtype=torch.float32)
    for layer in decoder_layers(model):  # checkpointed or not: each is a unit of its own
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=True if frozen else None, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def replicate(
    model: torch.nn.Module, device: torch.device, dtype: str, master_dtype: str
) -> tuple[torch.nn.Module, Masters | None]:
    """A DDP rank's model on its `device`, computing in `dtype`, and its masters in
    `master_dtype` (None when the two are one). Moved first, split after: the masters, their
    gradients and the optimizer's state live on the parameters' device (masters made on the
    load device would take a GPU's gradients on the CPU, and AdamW would step them there)."""
    model.to(device)
    return model, Masters.split(model, DTYPES[dtype], DTYPES[master_dtype])


def _sum_gradients(state, bucket):  # unannotated: DDP checks annotations by identity
    """DDP communication hook: all-reduce with SUM instead of DDP's mean, in float32 whatever
    the gradients' dtype (a bf16 model's are summed in float32, then rounded once)."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    wide = buffer if buffer.dtype == torch.float32 else buffer.float()
    work = dist.all_reduce(wide, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0].to(buffer.dtype))


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """numpy has no bfloat16: such a tensor travels as its int16 bits."""
    t = t.detach().cpu()
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
