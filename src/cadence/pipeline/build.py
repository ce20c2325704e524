"""The run builder: the one place that turns a whole `Config` into wired components.

Components take plain keyword arguments; only this module (and the CLI) reads the config tree.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch

from cadence.algo import LossParams, needs_reference
from cadence.config import Config, ConfigError, PipelineConfig
from cadence.data import load_task
from cadence.engine import Engine, Request, SamplingParams, make_engine
from cadence.engine.vllm import INSTALL_HINT, VLLMEngine, VLLMOptions, vllm_available
from cadence.learner import Learner, LearnerParams
from cadence.metrics import Tracer
from cadence.models import load_model, load_tokenizer
from cadence.pipeline.checkpoint import Checkpoint, restore_learner, weights_digest
from cadence.pipeline.prompts import PromptFilter, PromptStream, heldout_prompts
from cadence.pipeline.reward_stage import RewardSpec, RewardStage
from cadence.pipeline.source import ColocatedSource, GroupSource, WorkerSource
from cadence.pipeline.store import SampleStore
from cadence.pipeline.weights import SharedWeights
from cadence.pipeline.worker import RolloutWorker
from cadence.pipeline.workers import Pool, WorkerPool, WorkerSpec
from cadence.rewards import RewardFn, load_reward
from cadence.types import Completion, Prompt

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Run:
    cfg: Config
    tokenizer: object
    learner: Learner
    source: GroupSource
    eval_engine: Engine
    reward: RewardFn
    sampling: SamplingParams
    stream: PromptStream
    heldout: list[Prompt]
    tracer: Tracer
    resume: Checkpoint | None = None  # the checkpoint this run continues from
    reference_digest: str | None = None  # identity of the reference weights (for checkpoints)

    @property
    def first_iteration(self) -> int:
        return self.resume.iteration if self.resume else 0

    @property
    def max_staleness(self) -> int:
        return max_staleness(self.cfg)


def set_threads(threads: int) -> None:
    torch.set_num_threads(threads or os.cpu_count() or 1)


def make_task(cfg: Config):
    d = cfg.data
    if d.task == "gsm8k":
        return load_task(
            "gsm8k",
            path=d.path,
            heldout_path=d.heldout_path,
            num_heldout=d.num_heldout,
            on_bad_line=d.on_bad_line,
            seed=cfg.train.seed,
        )
    return load_task(
        d.task,
        difficulty=d.difficulty,
        seed=cfg.train.seed,
        num_heldout=d.num_heldout,
        max_operand=d.max_operand,
    )


def sampling_params(cfg: Config, tokenizer) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        stop_token_ids=(tokenizer.eos_token_id,),
        stop=tuple(r.stop),
    )


def prompt_filter(cfg: Config, tokenizer) -> PromptFilter:
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return PromptFilter(encode, cfg.rollout.max_prompt_tokens, cfg.rollout.on_long_prompt)


def learner_params(cfg: Config) -> tuple[LearnerParams, LossParams]:
    a, t = cfg.algo, cfg.train
    params = LearnerParams(
        lr=t.lr,
        warmup_steps=t.warmup_iterations * t.mini_batches,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        loss=a.loss,
        advantage=a.advantage,
        scale_by_std=a.scale_by_std,
        loss_agg=a.loss_agg,
        micro_batch_groups=t.micro_batch_groups,
        mini_batches=t.mini_batches,
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
        shared_prompt=cfg.learner.shared_prompt,
        shared_prompt_impl=cfg.learner.shared_prompt_impl,
        reuse_old_logprobs=cfg.learner.reuse_old_logprobs,
        max_bad_steps=t.max_bad_steps,
    )
    loss = LossParams(
        clip_low=a.clip_low,
        clip_high=a.clip_high,
        kl_coef=a.kl_coef,
        kl_estimator=a.kl_estimator,
        tis_cap=a.tis_cap,
        dpo_beta=a.dpo_beta,
        dpo_loss=a.dpo_loss,
    )
    return params, loss


def learner_threads(cfg: Config) -> int:
    p = cfg.pipeline
    if p.placement == "colocated":
        return cfg.train.threads
    cores = os.cpu_count() or 1
    others = p.num_workers * p.threads_per_worker
    if cfg.reward.stage == "separate":
        others += cfg.reward.num_workers * cfg.reward.threads_per_worker
    return p.learner_threads or max(1, cores - others)


def build_source(
    cfg: Config,
    model,
    worker: RolloutWorker,
    tracer: Tracer,
    stream: PromptStream,
    first_iteration: int = 0,
) -> GroupSource:
    p = cfg.pipeline

    def next_prompts() -> list[Prompt]:
        return stream.next_batch(cfg.train.prompts_per_iteration)

    if p.placement == "colocated":
        own_copy = isinstance(worker.engine, VLLMEngine)  # loads the learner's weights each time
        sync = LearnerWeights(worker.engine, model).sync if own_copy else None
        return ColocatedSource(worker, tracer, next_prompts, sync=sync)
    separate = cfg.reward.stage == "separate"
    spec = WorkerSpec(
        model_path=cfg.model.path,
        dtype=cfg.model.dtype,
        reward="" if separate else cfg.reward.function,
        sampling=worker.sampling,
        group_size=cfg.rollout.group_size,
        run_seed=cfg.train.seed,
        threads=p.threads_per_worker,
        max_num_seqs=cfg.rollout.max_num_seqs,
        engine=cfg.rollout.engine,
        vllm=vllm_options(cfg) if cfg.rollout.engine == "vllm" else None,
    )
    pool = make_pool(p, spec, model)
    try:
        store = make_store(p)
        stage = reward_stage(cfg, store, tracer) if separate else None
    except BaseException:
        pool.close()
        raise
    return WorkerSource(
        pool,
        model,
        tracer,
        next_prompts,
        stream=p.mode != "sync",
        prompts_per_task=p.prompts_per_task,
        tasks_in_flight=p.tasks_in_flight,
        max_staleness=max_staleness(cfg),
        queue_size=p.queue_size,
        iterations=cfg.train.iterations,
        first_iteration=first_iteration,
        max_worker_restarts=p.max_worker_restarts,
        group_size=cfg.rollout.group_size,
        store=store,
        reward_stage=stage,
    )


def vllm_options(cfg: Config) -> VLLMOptions:
    return VLLMOptions(**cfg.rollout.vllm.model_dump())


def rollout_engine(cfg: Config, model, tokenizer):
    """The engine of the learner's process: the rollout engine when colocated, held-out
    evaluation always. With 'vllm' in worker processes, cadence's own engine evaluates on the
    learner's model (a second vLLM beside the learner would take its GPU's memory)."""
    kind, r = cfg.rollout.engine, cfg.rollout
    if kind == "vllm" and cfg.pipeline.placement == "colocated":
        path, dtype, opts = cfg.model.path, cfg.model.dtype, vllm_options(cfg)
        return make_engine(
            kind, None, tokenizer, r.max_num_seqs, model_path=path, dtype=dtype, vllm=opts
        )
    return make_engine("continuous" if kind == "vllm" else kind, model, tokenizer, r.max_num_seqs)


def require_engine(kind: str) -> None:
    if kind == "vllm" and not vllm_available():
        raise ConfigError(
            f"rollout.engine = 'vllm' needs vLLM, which is not installed: {INSTALL_HINT}"
        )


class LearnerWeights:
    """An engine with its own copy of the weights (vLLM) in the learner's process, brought to
    the learner's current weights before it generates: colocated rollouts (`sync`, given the
    version) and held-out evaluation (`generate`)."""

    def __init__(self, engine, model: torch.nn.Module) -> None:
        self.engine, self.model = engine, model

    def sync(self, version: int | None = None) -> None:
        self.engine.load_weights({n: p.detach() for n, p in self.model.named_parameters()}, version)

    def generate(self, requests: list[Request], params: SamplingParams) -> list[list[Completion]]:
        self.sync()
        return self.engine.generate(requests, params)


def reward_stage(cfg: Config, store: SampleStore, tracer: Tracer) -> RewardStage:
    """The reward workers of `reward.stage = "separate"`, started, scorers loaded."""
    r = cfg.reward
    spec = RewardSpec(
        kind=r.kind,
        function=r.function,
        model_path=r.model_path,
        batch_size=r.batch_size,
        threads=r.threads_per_worker,
        dtype=cfg.model.dtype,
    )
    return RewardStage(
        spec,
        r.num_workers,
        store,
        tracer,
        batch_size=r.batch_size,
        timeout_s=cfg.pipeline.worker_timeout_s,
    )


def make_pool(p: PipelineConfig, spec: WorkerSpec, model) -> Pool:
    """The workers, on the configured backend (Ray imported only when asked for)."""
    if p.backend == "local":
        return WorkerPool(spec, SharedWeights(model), p.num_workers, timeout_s=p.worker_timeout_s)
    if importlib.util.find_spec("ray") is None:
        raise ConfigError("pipeline.backend = 'ray' needs Ray: pip install 'cadence[ray]'")
    from cadence.pipeline.ray_backend import RayPool

    return RayPool(
        spec,
        model,
        p.num_workers,
        timeout_s=p.worker_timeout_s,
        address=p.ray_address,
        num_cpus=p.ray_num_cpus,
        num_cpus_per_worker=p.num_cpus_per_worker,
        num_gpus_per_worker=p.num_gpus_per_worker,
        weight_sync=p.weight_sync,
    )


def make_store(p: PipelineConfig) -> Any:
    """The sample store: in this process, or in a Ray actor on the Ray backend (same class)."""
    if p.backend == "local":
        return SampleStore()
    from cadence.pipeline.ray_backend import ActorStore

    return ActorStore()


def max_staleness(cfg: Config) -> int:
    """Versions a trained group may lag the learner: 0 except in off-policy mode."""
    return cfg.pipeline.max_staleness if cfg.pipeline.mode == "offpolicy" else 0


def build_run(cfg: Config, resume: Checkpoint | None = None) -> Run:
    """Every component of a run, wired; from `resume` on, if given (see pipeline/checkpoint.py)."""
    require_engine(cfg.rollout.engine)
    set_threads(learner_threads(cfg))
    torch.manual_seed(cfg.train.seed)
    dtype, device = DTYPES[cfg.model.dtype], cfg.model.device
    tokenizer = load_tokenizer(cfg.model.path)
    model = load_model(cfg.model.path, dtype=dtype, device=device)
    ref = None
    if needs_reference(cfg.algo.loss, cfg.algo.kl_coef):  # frozen: no grads, no optimizer state
        ref = load_model(cfg.model.path, dtype=dtype, device=device).requires_grad_(False)
    tracer = Tracer()
    params, loss = learner_params(cfg)
    learner = Learner(model, params, loss, tokenizer.pad_token_id, ref_model=ref, tracer=tracer)
    digest = weights_digest(ref) if resume or cfg.train.checkpoint_every else None
    if resume is not None:
        restore_learner(learner, resume, digest)
    engine = rollout_engine(cfg, model, tokenizer)
    reward = load_reward(cfg.reward.function)
    sampling = sampling_params(cfg, tokenizer)
    worker = RolloutWorker(
        engine, tokenizer, reward, sampling, cfg.rollout.group_size, cfg.train.seed
    )
    task = make_task(cfg)
    cursor = resume.state["cursor"] if resume else 0
    fit = prompt_filter(cfg, tokenizer)
    stream = PromptStream(task, cfg.data.prompt_template, cfg.data.task, start=cursor, fit=fit)
    first = resume.iteration if resume else 0
    return Run(
        cfg=cfg,
        tokenizer=tokenizer,
        learner=learner,
        source=build_source(cfg, model, worker, tracer, stream, first_iteration=first),
        eval_engine=LearnerWeights(engine, model) if isinstance(engine, VLLMEngine) else engine,
        reward=reward,
        sampling=sampling,
        stream=stream,
        heldout=heldout_prompts(
            task, cfg.data.prompt_template, cfg.data.task, prompt_filter(cfg, tokenizer)
        ),
        tracer=tracer,
        resume=resume,
        reference_digest=digest,
    )
