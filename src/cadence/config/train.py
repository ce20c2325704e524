"""`[train]`, `[learner]`, `[pipeline]`, `[sft]`, `[metrics]`: the optimisation, how the learner
computes, how generation and training overlap, the warm start, where figures go."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from cadence.config.base import Section, changed, check_custom_resources


class TrainConfig(Section):
    iterations: int = Field(100, ge=1)
    """Optimizer rounds (policy versions)."""
    seed: int = 0
    """Run seed: data order, sampling seeds, initialisation."""
    prompts_per_iteration: int = Field(16, ge=1)
    """Groups per iteration."""
    lr: float = Field(1e-4, gt=0.0)
    """AdamW learning rate."""
    warmup_iterations: int = Field(0, ge=0)
    """Linear learning-rate warm-up over the first N optimizer steps."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Gradient clipping norm."""
    micro_batch_groups: int = Field(4, ge=1)
    """Groups per forward/backward (when train.micro_batch_tokens is 0)."""
    micro_batch_tokens: int = Field(0, ge=0)
    """Micro-batches packed up to this many tokens (each group's prompt once, its responses),
    instead of micro_batch_groups whole groups: a group over the budget is split across
    micro-batches by its responses (its prompt repeated in each part), so one group of long
    responses need not fit one pass; the update is the same. The knob for long responses. 0:
    off. Pair losses (online_dpo) keep their groups whole."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per iteration."""
    eval_every: int = Field(0, ge=0)
    """Held-out eval every N iterations (0: ends)."""
    eval_max_num_seqs: int = Field(0, ge=0)
    """Sequences held-out evaluation decodes at once where it has an engine of its own (beside
    worker processes; 0: rollout.max_num_seqs): its KV cache is this many x (prompt +
    max_new_tokens) per layer while it runs, freed after."""
    threads: int = Field(0, ge=0)
    """torch threads (0: OMP_NUM_THREADS if set, else every core this process may run on)."""
    checkpoint_every: int = Field(10, ge=0)
    """Write a checkpoint (policy, optimizer, RNG, data cursor, version, metrics offset) every N
    iterations and at the end, for `cadence train --resume`; 0: never."""
    keep_checkpoints: int = Field(2, ge=1)
    """Newest checkpoints kept on disk."""
    max_minutes: float = Field(0.0, ge=0.0)
    """Stop after the first iteration that ends this many minutes into the loop (held-out
    evaluations and checkpoints count; loading and starting workers do not), even if fewer than
    train.iterations have run: the final model, summary and (with checkpoints on) a checkpoint
    are written as at the end. A learning-rate schedule is not stretched to it. 0: no limit."""
    max_bad_steps: int = Field(3, ge=0)
    """An optimizer step whose loss or gradient is NaN or inf is skipped (weights untouched) and
    counted; one more than this many in a row stops the run."""


class LearnerConfig(Section):
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype of the weights the optimizer steps and of its state. float32 (the default): with
    model.dtype = 'bfloat16' the learner computes in bf16 and steps float32 masters, rounded to
    bf16 for the passes and the engines (on ranks, FSDP2's MixedPrecisionPolicy, gradients
    reduced in float32). bfloat16: pure bf16 parameters and Adam state (half the memory), which
    round away every update smaller than half a bf16 ulp of its weight: a warning names the
    weights train.lr cannot move. Needs model.dtype = 'bfloat16'."""
    logits_chunk_tokens: int = Field(1024, ge=0)
    """Log-probs and entropy are computed from the last hidden states this many response tokens
    at a time (the vocabulary projection recomputed per chunk in the backward), so no [B, T, V]
    float32 logits tensor is ever held; 0: the whole micro-batch's logits at once (the old
    way). A model whose head does more than a linear projection falls back to 0, with a
    warning."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input during the forward and recompute the layer in the
    backward (torch.utils.checkpoint, non-reentrant): activation memory falls from every layer's
    intermediates to one per layer, for about a third more compute. Works with every
    shared-prompt layout and with LoRA."""
    return_freed_memory: bool = False
    """CPU (Linux, glibc): blocks of 1 MiB or more that the process frees go back to the OS at once
    (a fixed mmap threshold), instead of staying in the C heap, where they fragment and the peak
    grows with every longer response. On SmolLM2 with checkpointing, peak RSS per response token
    0.87 -> about 0.07 MB, for about a third more time per iteration (docs/learner.md). No effect
    on GPU memory."""
    disable_dropout: bool = True
    """Turn dropout off in the policy and its reference (every Dropout module, a LoRA adapter's
    among them, and the attention's rate), as TRL does for RL: with it on, each pass draws its
    own mask, so the learner's log-probs differ from the engine's (engines decode in eval mode)
    and from any other pass over the same tokens (an old-policy or reference pass), and the
    importance ratios and KL carry that noise. (Before an iteration's first step the old log-probs
    are the policy pass's own, detached: that ratio is 1 whether dropout is on or not.)"""
    shared_prompt: bool = True
    """Pack each group as [prompt | r1 | ... | rG] so its prompt is computed once for its G
    responses (same log-probs as the unpacked forward)."""
    shared_prompt_impl: Literal["prefix", "dense", "packed"] = "prefix"
    """prefix: run the prompts once and let the responses attend to their keys and values (no
    quadratic mask; every response padded to the longest); dense: one row per group with a 4-D
    mask (every group padded to the longest); packed: padding-free, the micro-batch's groups end
    to end in one row, positions restarting per group, each group attending only to itself
    (attention by segments: no padding, no row x row mask; docs/learner.md)."""
    reuse_old_logprobs: bool = True
    """Before an iteration's first optimizer step the old policy is the policy: use its log-probs
    detached instead of a pass of the frozen old copy."""
    ranks: int = Field(1, ge=1)
    """Learner ranks: 1 trains in the driver process; N > 1 trains as N torch.distributed processes
    (gloo on CPU, NCCL on GPUs; local processes, or Ray actors with pipeline.backend = 'ray'), each
    on its share of every iteration's groups, one optimizer step together: the same update as one
    rank."""
    strategy: Literal["fsdp", "ddp"] = "fsdp"
    """With ranks > 1: fsdp (FSDP2: parameters, gradients and optimizer state sharded per decoder
    layer across the ranks) or ddp (each rank a whole replica, gradients all-reduced)."""
    threads_per_rank: int = Field(0, ge=0)
    """torch threads of each rank (0: the learner's threads / ranks)."""
    num_cpus_per_rank: float = Field(1.0, ge=0)
    """ray: CPUs each learner rank actor reserves (Ray's num_cpus)."""
    num_gpus_per_rank: float = Field(0.0, ge=0)
    """GPUs each learner rank takes. ray: its actor's num_gpus; above 0 the ranks train on their
    GPU over NCCL. local (model.device = 'cuda'): the ranks take the first GPUs, one each (0 means
    1; a fraction shares one with the next processes), each rank process seeing only its own
    (CUDA_VISIBLE_DEVICES); rank 0 is the driver when learner.ranks = 1."""
    ray_rank_resources: dict[str, float] = Field(default_factory=dict)
    """ray: custom Ray resources each learner rank actor reserves besides its CPUs and GPUs, e.g. {
    trainer = 1 }: the ranks then run only on nodes started with that resource (`ray start
    --resources='{"trainer": 2}'`). Names a node's role; {}: any node with the CPUs and GPUs."""


class PipelineConfig(Section):
    mode: Literal["sync", "periodic", "offpolicy"] = "sync"
    """sync: train once the whole batch is generated; periodic: train on groups as they finish,
    weights synced once per iteration (on-policy, same update as sync); offpolicy: generation
    runs up to max_staleness policy versions ahead of the learner."""
    max_staleness: int = Field(1, ge=0)
    """offpolicy: most versions a trained group may lag the learner (admission control: no prompt
    starts that could exceed it). 1 = one-step off-policy; 0 = periodic."""
    partial_rollout: bool = False
    """offpolicy: workers load each new version between two decode steps instead of waiting until
    their sequences finish; a sequence in flight goes on under the new weights and each token
    records the version that sampled it (token_versions). max_staleness then bounds a
    trajectory's oldest token. Continuous or vLLM engine (vLLM: keep only), single-turn only
    (docs/partial-rollouts.md)."""
    behaviour_gap_max: float = Field(0.0, ge=0.0)
    """The sampler-learner gap a run tolerates: the mean over an iteration's fresh tokens of
    |engine's log-prob - learner's| (behaviour_logprob_abs_diff_mean), in nats. 0: the model's
    dtype's own (float32 1e-3, bfloat16 and float16 2e-2; correct runs measured 1e-6 and 3.5e-4 on
    a CPU, a stale engine 0.1 and more: docs/reliability.md)."""
    on_behaviour_gap: Literal["stop", "warn", "off"] = "stop"
    """Past behaviour_gap_max: stop the run (exit 1), warn in the log, or do not watch."""
    verify_weights: Literal["fingerprint", "off"] = "fingerprint"
    """fingerprint: every version a worker's engine loads, or an engine beside the learner that
    keeps its own copy (vLLM), is checked before it samples: a fingerprint of what it holds (a
    hash of a fixed sample of each tensor's elements) against what the learner published; a
    difference (a load that did nothing, an older version, weights lost) stops the run naming
    the worker, the engine, the version and the tensors. off: not checked (docs/reliability.md)."""
    partial_rollout_kv: Literal["keep", "recompute"] = "keep"
    """partial_rollout: what a sequence in flight keeps when new weights arrive: keep (the keys and
    values computed under the old weights, PipelineRL) or recompute (prefill prompt and tokens so
    far again under the new weights, AReaL and verl; continuous engine only)."""
    staleness_strategy: Literal["drop", "wait"] = "drop"
    """A trajectory whose oldest token is more than max_staleness versions behind: drop (the learner
    drops it and counts it in dropped_groups, as without partial rollouts) or wait (partial_rollout:
    a worker defers new weights while loading them would leave such a trajectory in flight; verl's
    max_off_policy_strategy)."""
    placement: Literal["colocated", "separate"] = "colocated"
    """colocated: generate with the learner's own weights in its thread; separate: num_workers
    inference worker processes."""
    num_workers: int = Field(1, ge=1)
    """Inference worker processes (separate)."""
    threads_per_worker: int = Field(1, ge=1)
    """torch threads in each worker."""
    learner_threads: int = Field(0, ge=0)
    """torch threads of the learner when separate (0: cores - workers, at most
    OMP_NUM_THREADS if set)."""
    prompts_per_task: int = Field(4, ge=1)
    """Prompts sent to a worker as one task (the unit of assignment)."""
    tasks_in_flight: int = Field(0, ge=0)
    """Tasks queued at each worker at once (bounded concurrency). 0: enough to fill the worker's
    engine, ceil(rollout.max_num_seqs / (prompts_per_task x rollout.group_size)), but no more
    than the worker's share of the tasks generation may hold (an iteration's, times 1 + the
    staleness off-policy), and at least 2; 2 with rollout.engine = 'static'."""
    queue_size: int = Field(0, ge=0)
    """periodic: most groups waiting in the sample store for the learner; while that many wait, the
    producer hands out no new task (0: no bound)."""
    filter_groups: Literal["none", "zero_variance"] = "none"
    """Dynamic sampling (DAPO): zero_variance trains no group whose rewards are all equal and draws
    one more prompt for each such group, until the iteration has train.prompts_per_iteration
    informative groups (or max_oversample extra prompts were drawn; then the earliest filtered
    groups fill the iteration). Periodic still equals sync, with one optimizer step an iteration
    (train.mini_batches = 1; with more, the groups of each step would depend on the order they
    finish in, and the pair is refused). Counted as filtered_groups and oversampled_prompts in
    metrics.jsonl."""
    max_oversample: int = Field(128, ge=0)
    """filter_groups: most prompts drawn beyond train.prompts_per_iteration in one iteration."""
    worker_timeout_s: float = Field(300.0, gt=0)
    """Longest wait for a worker to start or acknowledge weights."""
    max_worker_restarts: int = Field(3, ge=0)
    """A worker process that dies is replaced (it loads the current weights and is sent again the
    prompts it had not returned) up to this many times per worker slot; one more death stops the
    run."""
    backend: Literal["local", "ray"] = "local"
    """Where separate workers run: local (spawned processes on this machine, shared-memory weights)
    or ray (Ray actors, on this machine or a cluster; needs the 'ray' extra)."""
    ray_address: str | None = None
    """ray: address of a running cluster to join ('auto', or 'HEAD_IP:6379'); unset: start a Ray on
    this machine for the run, listening on loopback only."""
    ray_num_cpus: int = Field(0, ge=0)
    """ray: CPUs the Ray started for the run offers (0: all cores)."""
    num_cpus_per_worker: float = Field(1.0, ge=0)
    """ray: CPUs each worker actor reserves (Ray's num_cpus)."""
    num_gpus_per_worker: float = Field(0.0, ge=0)
    """GPUs each rollout worker takes; above 0 the worker generates on its GPU. ray: its actor's
    num_gpus. local: the workers take the GPUs after the learner's (whole GPUs from 1 up, a
    fraction shares one), each worker process seeing only its own (CUDA_VISIBLE_DEVICES); a CUDA
    run with separate placement needs it above 0. More than the machine shows is refused."""
    ray_worker_resources: dict[str, float] = Field(default_factory=dict)
    """ray: custom Ray resources each worker actor reserves besides its CPUs and GPUs, e.g. {
    rollout = 1 }: workers then run only on nodes started with that resource (`ray start
    --resources='{"rollout": 4}'`), and a worker that dies is replaced on such a node; none left
    alive stops the run naming the resource. {}: any node with the CPUs and GPUs."""
    weight_sync: Literal["object_store", "broadcast"] = "object_store"
    """ray: how a new version reaches the workers: object_store (put once into Ray's object store,
    every worker reads the same object) or broadcast (torch.distributed broadcast from the learner:
    NCCL when model.device is a GPU, gloo otherwise)."""

    @model_validator(mode="after")
    def _periodic_needs_workers(self) -> PipelineConfig:
        if self.mode in ("periodic", "offpolicy") and self.placement != "separate":
            raise ValueError(
                f"pipeline.mode = '{self.mode}' needs pipeline.placement = 'separate' "
                "(colocated generation cannot overlap with training)"
            )
        self._partial_rollout_keys()
        if self.queue_size and self.mode != "periodic":
            raise ValueError(
                "pipeline.queue_size bounds how far generation runs ahead of a streaming "
                f"learner: it applies to pipeline.mode = 'periodic' only, not '{self.mode}'"
            )
        if self.backend == "ray" and self.placement != "separate":
            raise ValueError(
                "pipeline.backend = 'ray' runs the inference workers as Ray actors: set "
                "pipeline.placement = 'separate'"
            )
        if self.backend == "local":
            for key in changed(self, RAY_ONLY):
                raise ValueError(
                    f"pipeline.{key} applies to pipeline.backend = 'ray' only: set the "
                    f"backend or leave pipeline.{key} out"
                )
        check_custom_resources("pipeline.ray_worker_resources", self.ray_worker_resources)
        if self.ray_address and self.ray_num_cpus:
            raise ValueError(
                "pipeline.ray_num_cpus sizes the Ray started for the run; a cluster joined with "
                "pipeline.ray_address has its own: leave pipeline.ray_num_cpus out"
            )
        return self

    def _partial_rollout_keys(self) -> None:
        if self.partial_rollout and self.mode != "offpolicy":
            raise ValueError(
                "pipeline.partial_rollout = true needs pipeline.mode = 'offpolicy' (got "
                f"'{self.mode}'): a sequence that takes new weights mid-way holds tokens of "
                "two versions, which only the off-policy mode trains"
            )
        if self.partial_rollout and self.max_staleness == 0:
            raise ValueError(
                "pipeline.partial_rollout = true needs pipeline.max_staleness >= 1: a sequence "
                "that spans two versions is at least one version stale when trained"
            )
        for key, value in (
            ("partial_rollout_kv", self.partial_rollout_kv != "keep"),
            ("staleness_strategy", self.staleness_strategy != "drop"),
        ):
            if value and not self.partial_rollout:
                raise ValueError(
                    f"pipeline.{key} applies to pipeline.partial_rollout = true only: set it or "
                    f"leave pipeline.{key} out"
                )


RAY_ONLY = (
    "ray_address",
    "ray_num_cpus",
    "num_cpus_per_worker",
    "weight_sync",
    "ray_worker_resources",
)


class SFTConfig(Section):
    base: str = "runs/base"
    """Model directory SFT starts from."""
    out: str = "runs/sft"
    """Where the SFT model is written (cached)."""
    steps: int = Field(300, ge=1)
    """Optimizer steps."""
    batch_size: int = Field(32, ge=1)
    """Examples per step."""
    lr: float = Field(2e-3, gt=0.0)
    """Peak learning rate (cosine decay)."""
    warmup_steps: int = Field(20, ge=0)
    """Linear warm-up steps."""


class MetricsConfig(Section):
    tensorboard: bool = False
    """Also write TensorBoard event files."""
    progress: bool = True
    """Progress on the console: a live bar on a terminal, else a plain line every twentieth of
    the run (and at its end)."""
    wandb: bool = False
    """Log to Weights & Biases (the 'wandb' extra): the figures of metrics.jsonl, the config, the
    summary and timeline.png, under OUT/wandb; WANDB_MODE=offline needs no network, WANDB_PROJECT
    names the project (default 'cadence')."""
    mlflow: bool = False
    """Log to MLflow (the 'mlflow' extra), the same figures and files: to MLFLOW_TRACKING_URI if
    set, else a local file store in ./mlruns; MLFLOW_EXPERIMENT_NAME names the experiment
    (default 'cadence')."""
