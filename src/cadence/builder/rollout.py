"""The builder's rollout side: from the config to engines, rollout workers and held-out evaluation.

`cadence train` builds its engine, worker and evaluator here, and so do the recipes that act
with a policy without training it (`cadence eval`, `plan --calibrate`, `bench`): one wiring. Every
worker, colocated, in a process or evaluating, is `rollout.build_worker` of a spec made by
`params.worker_spec`; engines come from the engine factory, and whether an engine needs the
learner's weights brought to it is its own answer (`owns_weights`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import cast

from cadence.backend import RewardProcesses, learner_sync
from cadence.builder.checks import require_engine
from cadence.builder.params import engine_options, reward_spec, sampling_params, worker_spec
from cadence.builder.tasks import env_error, heldout_set
from cadence.config import Config
from cadence.engine import (
    Engine,
    EngineWeights,
    TakesAdapters,
    keeps_own_copy,
    make_engine,
    open_engine,
    release_cached_memory,
)
from cadence.envs import ChatToolsError
from cadence.metrics import Tracer
from cadence.models import load_tokenizer, max_positions
from cadence.models.lora import adapter_base
from cadence.rewards import RewardRunner, RewardScorer, load_runner
from cadence.rollout import Evaluator, RolloutWorker, WorkerSpec, build_worker, evaluation_spec
from cadence.types import Prompt

Sync = Callable[[int | None], None]


def open_rollout_engine(
    cfg: Config,
    tokenizer,
    model=None,
    model_path: str | Path | None = None,
    kind: str = "",
    lora_rank: int | None = None,
) -> tuple[Engine, EngineWeights]:
    """Engine `kind` (default `rollout.engine`, set up by its own options) over the model in
    `model_path` (default `model.path`), and what new weights load into. An engine that decodes
    with a model object decodes with `model`, loaded here when None. `lora_rank`: vLLM's LoRA
    slots, where not the run's."""
    kind = kind or cfg.rollout.engine
    require_engine(kind)
    return open_engine(
        kind,
        str(model_path or cfg.model.path),
        tokenizer,
        cfg.rollout.max_num_seqs,
        dtype=cfg.model.dtype,
        device=cfg.model.device,
        options=engine_options(cfg, kind, lora_rank),
        model=model,
    )


def learner_engine(cfg: Config, model, tokenizer) -> tuple[Engine, Sync | None]:
    """The engine of the learner's process, and how the learner's weights reach it (None: it
    decodes with the learner's model). Colocated, it is the rollout engine. Beside worker
    processes it serves held-out evaluation only, and an engine that keeps its own copy of the
    model is not opened a second time there (it would take the GPU's memory): cadence's
    continuous engine evaluates on the learner's model instead."""
    kind = cfg.rollout.engine
    if cfg.pipeline.placement == "colocated":
        engine, weights = open_rollout_engine(cfg, tokenizer, model=model, kind=kind)
        verify = cfg.pipeline.verify_weights == "fingerprint"
        return engine, learner_sync(weights, model, verify=verify)
    slots = cfg.train.eval_max_num_seqs or cfg.rollout.max_num_seqs  # it only evaluates
    kind = "continuous" if keeps_own_copy(kind) else kind
    engine = make_engine(kind, model, tokenizer, slots)
    return engine, None


def run_reward(cfg: Config) -> RewardRunner:
    """The run's reward function (`reward.function`, its answer format), run
    `reward.concurrency` calls at a time, each within `reward.timeout_s`."""
    r = cfg.reward
    return load_runner(r.function, r.answer_format, r.timeout_s, r.concurrency)


def rollout_worker(
    cfg: Config,
    engine: Engine,
    tokenizer,
    model_path: str | Path | None = None,
    score: bool = True,
    reward: RewardScorer | None = None,
) -> RolloutWorker:
    """A worker sampling as `cadence train` samples (`rollout.*`, the environment, the run seed)
    on `engine`, stopping where the model in `model_path` (default `model.path`) stops; its
    groups scored by the run's reward unless `score` is False (or a reward stage scores), by
    `reward` where given (reward processes: `reward_processes`)."""
    spec = worker_spec(cfg, sampling_params(cfg, tokenizer, model_path))
    if not score:
        spec = replace(spec, reward="")
    return _build(cfg, spec, engine, tokenizer, reward)


def reward_processes(cfg: Config, tracer: Tracer | None = None) -> RewardProcesses:
    """The reward processes that score a colocated worker's groups (`reward.stage =
    "separate"`, placement colocated), started, scorers built."""
    return RewardProcesses(
        reward_spec(cfg),
        cfg.reward.num_workers,
        batch_size=cfg.reward.batch_size,
        timeout_s=cfg.pipeline.worker_timeout_s,
        tracer=tracer,
    )


def _build(
    cfg: Config, spec: WorkerSpec, engine: Engine, tokenizer, reward: RewardScorer | None = None
) -> RolloutWorker:
    """`build_worker` on `engine`; a chat template that cannot carry tool calls is a config
    error naming the template."""
    try:
        return build_worker(spec, engine, tokenizer, reward)[1]
    except ChatToolsError as err:
        if reward is not None:
            reward.close()
        raise env_error(cfg, err) from None


def heldout_evaluator(
    cfg: Config,
    model,
    engine: Engine,
    tokenizer,
    prompts: list[Prompt],
    sync: Sync | None = None,
    model_path: str | Path | None = None,
) -> Evaluator:
    """Held-out accuracy of `model` generated by `engine`, greedy, with the run's environment and
    the run's reward function, stopping where the model in `model_path` (default `model.path`)
    stops; `sync` first brings an engine with its own copy to the model's weights."""
    spec = worker_spec(cfg, sampling_params(cfg, tokenizer, model_path))
    spec = evaluation_spec(spec, cfg.reward.function)
    _build(cfg, spec, engine, tokenizer).close()  # a broken environment fails before training
    evaluator = Evaluator(model, engine, lambda e: _build(cfg, spec, e, tokenizer), prompts, sync)
    on_gpu = cfg.model.device.startswith("cuda")
    if on_gpu and next(model.parameters()).device.type == "cpu":  # the driver's host copy
        most = cfg.train.eval_max_num_seqs or cfg.rollout.max_num_seqs
        slots = min(most, max(len(prompts), 1))
        evaluator.open_engine = lambda: transient_engine(model, tokenizer, slots, "cuda")
    return evaluator


def transient_engine(
    model, tokenizer, slots: int, device: str
) -> tuple[Engine, Callable[[], None]]:
    """A continuous engine on a copy of `model` on `device`, with `slots` sequences (the prompts
    evaluated, at most rollout.max_num_seqs), and what frees both: held-out evaluation of a
    policy kept in host memory (learner ranks' driver) holds the GPU only while it runs."""
    copy_on_device = copy.deepcopy(model).to(device).eval()
    engine = make_engine("continuous", copy_on_device, tokenizer, slots)

    def close() -> None:
        nonlocal copy_on_device, engine
        del copy_on_device, engine
        release_cached_memory()

    return engine, close


def eval_engine(cfg: Config, tokenizer, model_dir: str | Path) -> tuple[Engine, EngineWeights]:
    """The engine `cadence eval` decodes the model in `model_dir` with: `open_rollout_engine`'s;
    for a LoRA run's final/ (an adapter) on an engine that takes adapters (vLLM, which cannot
    load an adapter directory as a model), its base with the adapter as its LoRA request."""
    adapter = adapter_base(model_dir) if keeps_own_copy(cfg.rollout.engine) else None
    if adapter is None:
        return open_rollout_engine(cfg, tokenizer, model_path=model_dir)
    base, rank = adapter
    engine, weights = open_rollout_engine(cfg, tokenizer, model_path=base, lora_rank=rank)
    cast(TakesAdapters, engine).load_adapter(str(model_dir), "adapter")
    return engine, weights


def evaluate_model(cfg: Config, model_dir: str | Path) -> dict[str, float]:
    """`cadence eval`: the held-out accuracy of the model in `model_dir`, evaluated as `cadence
    train` evaluates (its engine, prompts, sampling, environment and reward)."""
    tokenizer = load_tokenizer(model_dir)
    engine, weights = eval_engine(cfg, tokenizer, model_dir)
    prompts = heldout_set(cfg, tokenizer, max_positions(weights.model))
    evaluator = heldout_evaluator(
        cfg, weights.model, engine, tokenizer, prompts, model_path=model_dir
    )
    return {"num_prompts": len(prompts)} | evaluator.results()
