"""The run builder: the one place that turns a whole `Config` into a wired run.

The backend (local processes or Ray) is chosen here and nowhere else, and so is the trainer:
`build_trainer` makes the one-process learner or `learner.ranks` ranks, with a frozen reference
exactly when the algorithm needs one (LoRA's is the adapter switched off), restored from a
checkpoint when resuming; everything after it sees a `Trainer`. Recipes that train without a run
(`plan --calibrate`, `bench`) build theirs with `build_learner`. The runtime it wires
(`cadence.pipeline`) never sees the config.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import cast

import torch

from cadence.algo import needs_reference
from cadence.backend import RewardStage, make_pool
from cadence.backend.teacher_stage import TeacherSpec, TeacherStage
from cadence.builder.checks import check_before_loading, check_sharded
from cadence.builder.params import (
    algo_params,
    distill_params,
    gpu_placement,
    learner_params,
    learner_threads,
    loop_params,
    producer_params,
    rank_spec,
    ray_options,
    reward_spec,
    sampling_params,
    set_threads,
    ships_adapter,
    worker_spec,
)
from cadence.builder.rollout import (
    Sync,
    heldout_evaluator,
    learner_engine,
    reward_processes,
    rollout_worker,
)
from cadence.builder.tasks import heldout_set, make_task, prompt_filter, prompt_render
from cadence.choices import engine_kind
from cadence.config import Config
from cadence.dataplane import Store
from cadence.engine import Engine
from cadence.learner import Learner, LearnerParams, Scorer, Trainer
from cadence.learner.allocator import return_freed_memory
from cadence.learner.distill import Teachers
from cadence.learner.driver import RankedLearner, start_local_ranks, start_ray_ranks
from cadence.learner.precision import Masters, warn_pure_low_precision
from cadence.metrics import Tracer
from cadence.models import DTYPES, load_model, load_tokenizer, max_positions
from cadence.models.lora import (
    AdapterOff,
    AdapterOnly,
    LoraSpec,
    adapter_spec,
    apply_lora,
    is_lora,
    plain_weights,
)
from cadence.pipeline import ColocatedSource, GroupSource, Run, WorkerSource
from cadence.pipeline.checkpoint import (
    Checkpoint,
    check_reference,
    restore_scorer,
    restore_trainer,
    weights_digest,
)
from cadence.pipeline.prompts import PromptStream
from cadence.types import Prompt


def build_source(
    cfg: Config,
    model,
    tokenizer,
    engine: Engine,
    tracer: Tracer,
    stream: PromptStream,
    resume: Checkpoint | None = None,
    sync: Sync | None = None,
) -> GroupSource:
    """Where the run's groups come from; a resumed run's (from `resume`) begins where it stopped.
    Colocated, a worker on `engine` generates, and `sync(version)` brings the engine to the
    learner's weights before each iteration (None: it decodes with the learner's model);
    separate, worker processes (or actors) built from the run's `WorkerSpec`."""
    p = cfg.pipeline
    first_iteration = resume.iteration if resume else 0

    def next_prompts() -> list[Prompt]:
        return stream.next_batch(cfg.train.prompts_per_iteration)

    filter_groups = p.filter_groups == "zero_variance"
    if p.placement == "colocated":
        # reward.stage 'separate': the groups are scored in reward processes, off the engine's
        # thread (in-process vLLM shares its GIL with a reward computed beside it)
        scorer = reward_processes(cfg, tracer) if cfg.reward.stage == "separate" else None
        return ColocatedSource(
            rollout_worker(cfg, engine, tokenizer, reward=scorer),
            tracer,
            next_prompts,
            filter_groups=filter_groups,
            max_oversample=p.max_oversample,
            next_extra=stream.extra,
            sync=sync,
        )
    separate = cfg.reward.stage == "separate"
    spec = worker_spec(cfg, sampling_params(cfg, tokenizer))
    if ships_adapter(cfg):  # vLLM workers keep their base weights and take each adapter
        spec, model = replace(spec, adapter=adapter_spec(model)), AdapterOnly(model)
    else:  # a LoRA policy's merged: the workers' model has no adapter
        model = plain_weights(model)
    pool, store = make_pool(
        p.backend,
        spec,
        model,
        p.num_workers,
        timeout_s=p.worker_timeout_s,
        placement=gpu_placement(cfg),
        **ray_options(p),
    )
    stage = teachers = None
    try:
        stage = reward_stage(cfg, store, tracer) if separate else None
        teachers = teacher_stage(cfg, store, tracer) if cfg.distill.placement == "worker" else None
    except BaseException:
        if stage is not None:
            stage.close()
        pool.close()
        raise
    return WorkerSource(
        pool,
        model,
        tracer,
        next_prompts,
        producer_params(cfg, first_iteration),
        stream=p.mode != "sync",
        store=store,
        reward_stage=stage,
        teacher_stage=teachers,
        filter_groups=filter_groups,
        max_oversample=p.max_oversample,
        next_extra=stream.extra,
        checkpoint_every=cfg.train.checkpoint_every,
        behaviour=resume.run.behaviour_policies if resume else [],
        step_groups=step_groups(cfg),
        verify=cfg.pipeline.verify_weights == "fingerprint",
    )


def step_groups(cfg: Config) -> int:
    """Periodic with several optimizer steps an iteration: the prompts of one step, released
    together in prompt order (pipeline/steporder.py), so each step trains what sync's would;
    0 otherwise (one step sums everything; off-policy does not equal sync, and periodic with
    dynamic sampling and several steps is refused: config/checks.py)."""
    t, p = cfg.train, cfg.pipeline
    if p.mode != "periodic" or t.mini_batches == 1 or p.filter_groups != "none":
        return 0
    return math.ceil(t.prompts_per_iteration / t.mini_batches)


def reward_stage(cfg: Config, store: Store, tracer: Tracer) -> RewardStage:
    """The reward workers of `reward.stage = "separate"`, started, scorers loaded."""
    r = cfg.reward
    return RewardStage(
        reward_spec(cfg),
        r.num_workers,
        store,
        tracer,
        batch_size=r.batch_size,
        timeout_s=cfg.pipeline.worker_timeout_s,
    )


def teacher_stage(cfg: Config, store: Store, tracer: Tracer) -> TeacherStage | None:
    """The teacher workers of `distill.placement = "worker"`, started, teachers loaded."""
    d = cfg.distill
    if not d.on:
        return None
    spec = TeacherSpec(
        tuple(d.by_task.items()),
        dtype=cfg.model.dtype,
        device=cfg.model.device,
        temperature=cfg.rollout.temperature,
        threads=d.threads_per_worker,
    )
    return TeacherStage(
        spec, d.num_workers, store, tracer, batch_size=d.batch_size,
        timeout_s=cfg.pipeline.worker_timeout_s,
    )  # fmt: skip


def build_run(cfg: Config, resume: Checkpoint | None = None) -> Run:
    """Every component of a run, wired; from `resume` on, if given (see pipeline/checkpoint.py)."""
    check_before_loading(cfg)
    gpu_placement(cfg)  # more GPUs asked for than this machine shows: refused before loading
    set_threads(learner_threads(cfg))
    torch.manual_seed(cfg.train.seed)
    tokenizer = load_tokenizer(cfg.model.path)
    model, masters = load_policy(cfg)
    tracer = Tracer()
    beside = cfg.pipeline.placement == "colocated" and engine_kind(cfg.rollout.engine).own_copy
    early = None
    if beside and cfg.learner.ranks == 1:
        # an engine with its own copy takes a share of the GPU's memory when it starts, measured
        # against what is free: the learner's optimizer state must be there already
        early = build_trainer(cfg, model, tokenizer.pad_token_id, tracer, resume, masters=masters)
        cast(Learner, early[0]).allocate_state()
    engine, sync = learner_engine(cfg, model, tokenizer)
    task = make_task(cfg)
    cursor = resume.run.cursor if resume else 0
    positions = max_positions(model)
    fit = prompt_filter(cfg, tokenizer, positions)
    render = prompt_render(cfg, tokenizer)
    replay = resume.run.pending_batches if resume else []
    stream = PromptStream(task, render, cfg.data.task, start=cursor, fit=fit, replay=replay)
    heldout = heldout_set(cfg, tokenizer, positions, task)
    evaluator = heldout_evaluator(cfg, model, engine, tokenizer, heldout, sync)
    source = build_source(cfg, model, tokenizer, engine, tracer, stream, resume, sync=sync)
    try:  # after the source: it may start the Ray that learner ranks run in
        trainer, digest = early or build_trainer(
            cfg, model, tokenizer.pad_token_id, tracer, resume, masters=masters
        )
    except BaseException:
        source.close()
        raise
    return Run(
        params=loop_params(cfg),
        tokenizer=tokenizer,
        trainer=trainer,
        scorer=build_scorer(cfg, resume),
        source=source,
        heldout_accuracy=evaluator,
        heldout_tasks=evaluator.tasks,
        num_heldout=len(heldout),
        stream=stream,
        tracer=tracer,
        resume=resume,
        reference_digest=digest,
    )


def build_trainer(
    cfg: Config,
    model,
    pad_id: int,
    tracer: Tracer,
    resume: Checkpoint | None = None,
    masters: Masters | None = None,
) -> tuple[Trainer, str | None]:
    """The run's trainer, restored from `resume` if given, and the identity of the reference
    weights (None without a reference, or when no checkpoint will need it).

    One process, or `learner.ranks` ranks (local processes or Ray actors, which start here:
    build the source first, it may start the Ray they run in). `model` is the policy as loaded
    (LoRA applied), not yet trained or restored: the reference's digest is taken from it;
    `masters` its float32 masters (`load_policy`)."""
    digest = reference_digest(cfg, model) if resume or cfg.train.checkpoint_every else None
    if resume is not None:  # before any rank starts
        check_sharded(resume, cfg.learner.ranks)
        check_reference(resume, digest)
    trainer: Trainer
    if cfg.learner.ranks > 1:
        trainer = start_ranks(cfg, model, pad_id, tracer)
    else:
        trainer = build_learner(cfg, model, pad_id, tracer, masters=masters)
    if resume is not None:
        try:
            restore_trainer(trainer, resume, digest)
        except BaseException:
            trainer.close()
            raise
    return trainer, digest


def build_learner(
    cfg: Config,
    model,
    pad_id: int,
    tracer: Tracer | None = None,
    params: LearnerParams | None = None,
    masters: Masters | None = None,
) -> Learner:
    """The one-process learner as a run builds it, on `model`, with its reference (see
    `reference_model`); `params` in place of the config's (a recipe's micro-batching). Mixed
    precision without `masters` (a recipe that loaded the model itself) upcasts masters from
    the model's own weights."""
    if cfg.learner.return_freed_memory:
        return_freed_memory()
    ref = reference_model(cfg, model)
    if masters is None and not is_lora(model):
        masters = Masters.split(model, DTYPES[cfg.model.dtype], DTYPES[cfg.learner.master_dtype])
    params = params or learner_params(cfg)
    teachers = load_teachers(cfg)
    return Learner(
        model, params, algo_params(cfg), pad_id, ref, tracer, masters=masters, teachers=teachers
    )


def load_teachers(cfg: Config) -> Teachers | None:
    """[distill]'s teachers, frozen, in the model's dtype on its device (each directory loaded
    once, whatever the tasks it scores); their tasks alone where a teacher stage scores (None
    models); None without distillation."""
    d = cfg.distill
    if not d.on:
        return None
    if d.placement == "worker":  # a teacher stage scores the rows: the learner holds none
        return Teachers(dict.fromkeys(d.by_task), distill_params(cfg))
    dtype, device = DTYPES[cfg.model.dtype], cfg.model.device
    loaded = {
        path: load_model(path, dtype=dtype, device=device).requires_grad_(False) for path in d.paths
    }
    models = {task: loaded[path] for task, path in d.by_task.items()}
    return Teachers(models, distill_params(cfg))


def load_policy(cfg: Config) -> tuple[torch.nn.Module, Masters | None]:
    """The policy as a run trains it, on `model.device`, LoRA applied, and its float32 masters
    when it computes in bf16 (learner.master_dtype): the weights are read in float32 for the
    masters and cast for the model, which is what the passes, the engines and `final/` read. A
    LoRA adapter is float32 already (its own master); learner ranks keep their masters sharded
    (this model only publishes). With learner ranks the driver's copy is in host memory,
    whatever `model.device`: it trains nothing, and on GPU 0 it sat beside rank 0's shards for
    no pass (what it publishes and saves is read from host memory; held-out evaluation copies it
    to a GPU while it runs: `evaluation_engine`). Pure bf16 (`master_dtype = "bfloat16"`)
    warns."""
    m = cfg.model
    dtype, master = DTYPES[m.dtype], DTYPES[cfg.learner.master_dtype]
    split = m.lora is None and cfg.learner.ranks == 1 and master != dtype
    device = "cpu" if cfg.learner.ranks > 1 else m.device
    model = load_model(m.path, dtype=master if split else dtype, device=device)
    if m.lora is not None:  # only the adapter trains; the reference is the adapter switched off
        spec = LoraSpec(m.lora.r, m.lora.alpha, m.lora.dropout, tuple(m.lora.target_modules))
        model = apply_lora(model, spec, base_path=m.path)
        if master != torch.float32:  # pure low precision: the adapter too
            model.to(master)
    if master == dtype and dtype != torch.float32:
        warn_pure_low_precision(cfg.learner.master_dtype, cfg.train.lr)
    return model, Masters.split(model, dtype, master) if split else None


def reference_model(cfg: Config, model) -> torch.nn.Module | None:
    """The frozen reference exactly when the algorithm needs one (`algo.needs_reference`: the KL
    penalty, or a pair loss): a LoRA policy's is its adapter switched off (no second copy), any
    other the configured weights loaded again (no grads, never in an optimizer)."""
    if not needs_reference(cfg.algo.loss, cfg.algo.kl_coef):
        return None
    if is_lora(model):
        return AdapterOff(model)
    dtype, device = DTYPES[cfg.model.dtype], cfg.model.device
    return load_model(cfg.model.path, dtype=dtype, device=device).requires_grad_(False)


def reference_digest(cfg: Config, model) -> str | None:
    """The identity of the reference weights, which checkpoints record and a resume checks:
    `model`'s as loaded (a LoRA policy's base weights), before any training or restore."""
    if not needs_reference(cfg.algo.loss, cfg.algo.kl_coef):
        return None
    return weights_digest(AdapterOff(model) if is_lora(model) else model)


def build_scorer(cfg: Config, resume: Checkpoint | None = None) -> Scorer:
    """The run's scorer (shaping, advantages, baseline), restored from `resume` if given."""
    scorer = Scorer(algo_params(cfg))
    if resume is not None:
        restore_scorer(scorer, resume)
    return scorer


def start_ranks(cfg: Config, model, pad_id: int, tracer: Tracer) -> RankedLearner:
    """`learner.ranks` ranks as local processes or Ray actors."""
    spec = rank_spec(cfg, pad_id)
    p = cfg.pipeline
    if p.backend == "ray":
        return start_ray_ranks(
            spec,
            model,
            tracer,
            resources={
                "CPU": cfg.learner.num_cpus_per_rank,
                "GPU": cfg.learner.num_gpus_per_rank,
                **cfg.learner.ray_rank_resources,
            },
            address=p.ray_address,
            num_cpus=p.ray_num_cpus,
        )
    return start_local_ranks(spec, model, tracer, gpu_placement(cfg))
