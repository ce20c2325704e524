"""From the config to the plain parameters components take: the one place these translations
live, shared by the run builder and the recipes (`bench`, `plan`, `study`) that build parts of a
run themselves. Translations only: refusals are checks.py's, tasks and environments tasks.py's.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, TypeVar

import torch

from cadence.algo import AlgoParams
from cadence.backend.placement import Placement, PlacementError, place, visible_gpus
from cadence.builder.checks import check_trackers, require_ray
from cadence.builder.tasks import env_spec
from cadence.choices import engine_kind
from cadence.config import Config, ConfigError, PipelineConfig, to_toml
from cadence.engine import SamplingParams
from cadence.engine.vllm import VLLMOptions
from cadence.learner import LearnerParams
from cadence.learner.distill import DistillParams
from cadence.learner.rank import RankSpec
from cadence.models import stop_token_ids
from cadence.pipeline.producer import ProducerParams
from cadence.pipeline.run import LoopParams
from cadence.rewards import RewardSpec
from cadence.rollout import PartialRollouts, WorkerSpec

T = TypeVar("T")
EngineOptions = VLLMOptions  # the options of each engine that takes some (choices.ENGINES)


def from_sections(cls: type[T], *sections: Any, **given: Any) -> T:
    """Dataclass `cls` with each field the config `sections` have a key of the same name for
    (the first that has it), and the fields `given` (which win): a translation written once
    where the names agree, and by hand where a key means something under another name. A field
    that neither a key nor `given` feeds is refused (TypeError): a parameter no config key can
    set would otherwise keep its default unnoticed."""
    same: dict[str, Any] = {}
    unfed = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        for section in sections:
            if f.name in type(section).model_fields:
                same[f.name] = getattr(section, f.name)
                break
        else:
            if f.name not in given:
                unfed.append(f.name)
    if unfed:
        raise TypeError(
            f"{cls.__name__}: no config key of {[type(s).__name__ for s in sections]} feeds "
            f"{unfed}, and they are not given: name a key after each, or pass it"
        )
    return cls(**(same | given))


def all_threads() -> int:
    """What a thread count of 0 means: OMP_NUM_THREADS where it is set (torchrun and batch
    schedulers set it for each process they start), else the cores this process may run on (its
    CPU affinity: a container's or `taskset`'s share, not the machine's count)."""
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    return usable_cores()


def usable_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def set_threads(threads: int) -> None:
    """torch threads of this process (0: `all_threads()`)."""
    torch.set_num_threads(threads or all_threads())


def sampling_params(cfg: Config, tokenizer, model_path: str | Path | None = None) -> SamplingParams:
    """How rollouts sample. A response ends at the tokenizer's EOS, the ids the generation config
    of the model in `model_path` (default `model.path`) stops at, `rollout.stop_token_ids`, and
    the `rollout.stop` strings."""
    r = cfg.rollout
    bad = [i for i in r.stop_token_ids if not 0 <= i < len(tokenizer)]
    if bad:
        raise ConfigError(
            f"rollout.stop_token_ids: {bad} are not ids of the tokenizer's {len(tokenizer)} tokens"
        )
    path = model_path or cfg.model.path
    return SamplingParams(
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        stop_token_ids=stop_token_ids(tokenizer, path, r.stop_token_ids),
        stop=tuple(r.stop),
    )


def algo_params(cfg: Config) -> AlgoParams:
    """The algorithm: `algo`'s keys, `reward`'s shaping, and the episode's cap on policy tokens
    (`Config.max_policy_tokens`: the overlong penalty's and seq-sum-norm's, not one turn's)."""
    return from_sections(AlgoParams, cfg.algo, cfg.reward, max_policy_tokens=cfg.max_policy_tokens)


def learner_params(cfg: Config) -> LearnerParams:
    """How the learner steps and lays out its work (the algorithm is `algo_params`)."""
    t = cfg.train
    return from_sections(
        LearnerParams,
        t,
        cfg.learner,
        warmup_steps=t.warmup_iterations * t.mini_batches,
        temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
    )


def learner_threads(cfg: Config) -> int:
    """torch threads of the learner: the cores the workers leave it, unless set."""
    p = cfg.pipeline
    if p.placement == "colocated":
        return cfg.train.threads
    others = p.num_workers * p.threads_per_worker
    if cfg.reward.stage == "separate":
        others += cfg.reward.num_workers * cfg.reward.threads_per_worker
    return p.learner_threads or min(all_threads(), max(1, usable_cores() - others))


def rank_threads(cfg: Config) -> int:
    """torch threads of each learner rank: the learner's threads shared among its ranks."""
    threads = learner_threads(cfg) or all_threads()
    return cfg.learner.threads_per_rank or max(1, threads // cfg.learner.ranks)


def distill_params(cfg: Config) -> DistillParams:
    return DistillParams(cfg.distill.coef, cfg.distill.reward_coef)


def rank_teachers(cfg: Config) -> tuple[tuple[str, str], ...]:
    """(task, teacher directory) for each learner rank to hold; directory "" where a teacher
    stage scores the rows instead."""
    d = cfg.distill
    held = d.placement == "learner"
    return tuple((task, path if held else "") for task, path in d.by_task.items()) if d.on else ()


def rank_spec(cfg: Config, pad_id: int) -> RankSpec:
    """What each of the `learner.ranks` ranks builds itself from."""
    return RankSpec(
        model_path=cfg.model.path,
        params=learner_params(cfg),
        algo=algo_params(cfg),
        pad_id=pad_id,
        world_size=cfg.learner.ranks,
        strategy=cfg.learner.strategy,
        dtype=cfg.model.dtype,
        master_dtype=cfg.learner.master_dtype,
        threads=rank_threads(cfg),
        timeout_s=cfg.pipeline.worker_timeout_s,
        teachers=rank_teachers(cfg),
        distill=distill_params(cfg),
    )


def gpu_placement(cfg: Config, visible: list[str] | None = None) -> Placement | None:
    """The GPUs each learner rank and local worker sees, on the local backend of a CUDA run
    (None otherwise: Ray places its actors itself); `visible`: this machine's (read when None).
    More than it shows is a ConfigError naming the keys."""
    p, learner = cfg.pipeline, cfg.learner
    if p.backend != "local" or not cfg.model.device.startswith("cuda"):
        return None
    workers = p.num_workers if p.placement == "separate" else 0
    try:
        return place(
            learner.ranks,
            learner.num_gpus_per_rank or 1.0,  # a CUDA learner always holds a GPU
            workers,
            p.num_gpus_per_worker,
            visible_gpus() if visible is None else visible,
        )
    except PlacementError as e:
        raise ConfigError(str(e)) from None


def max_staleness(cfg: Config) -> int:
    """Versions a trained group may lag the learner: 0 except in off-policy mode."""
    return cfg.pipeline.max_staleness if cfg.pipeline.mode == "offpolicy" else 0


def worker_spec(cfg: Config, sampling: SamplingParams) -> WorkerSpec:
    """What each rollout worker builds itself from; it scores only without a reward stage. A
    worker with a GPU share of a CUDA run holds its model on its GPU (the first it sees)."""
    on_gpu = cfg.model.device.startswith("cuda") and cfg.pipeline.num_gpus_per_worker > 0
    return WorkerSpec(
        model_path=cfg.model.path,
        dtype=cfg.model.dtype,
        device="cuda" if on_gpu else "cpu",
        reward="" if cfg.reward.stage == "separate" else cfg.reward.function,
        sampling=sampling,
        group_size=cfg.rollout.group_size,
        run_seed=cfg.train.seed,
        threads=cfg.pipeline.threads_per_worker,
        max_num_seqs=cfg.rollout.max_num_seqs,
        engine=cfg.rollout.engine,
        engine_options=engine_options(cfg),
        reward_timeout_s=cfg.reward.timeout_s,
        reward_concurrency=cfg.reward.concurrency,
        answer_format=cfg.reward.answer_format,
        env=env_spec(cfg),
        partial=partial_rollouts(cfg),
    )


def partial_rollouts(cfg: Config) -> PartialRollouts | None:
    """How workers take new weights mid-sequence (`pipeline.partial_rollout`; None: they wait
    until their sequences finish). With `staleness_strategy = "wait"` an update waits while it
    would leave a trajectory in flight staler than `max_staleness`."""
    p = cfg.pipeline
    if not p.partial_rollout:
        return None
    lag = max_staleness(cfg) if p.staleness_strategy == "wait" else None
    return PartialRollouts(recompute=p.partial_rollout_kv == "recompute", max_lag=lag)


def engine_options(
    cfg: Config, kind: str = "", lora_rank: int | None = None
) -> EngineOptions | None:
    """The options of engine `kind` (default `rollout.engine`) from its own section under
    `[rollout]` (`choices.ENGINES`), None for an engine that takes none."""
    section = engine_kind(kind or cfg.rollout.engine).options
    return ENGINE_OPTIONS[section](cfg, lora_rank) if section else None


def vllm_options(cfg: Config, lora_rank: int | None = None) -> VLLMOptions:
    """The `[rollout.vllm]` table as the vLLM engine takes it; `lora_rank` (None: the run's)
    sizes its LoRA slots."""
    options = cfg.rollout.vllm.model_dump()
    colocated = cfg.pipeline.placement == "colocated"
    # asleep while the learner trains only beside it: a worker's GPU is its own
    options["sleep_mode"] &= colocated
    if lora_rank is None:
        lora_rank = cfg.model.lora.r if ships_adapter(cfg) else 0
    in_flight = cfg.pipeline.partial_rollout
    return VLLMOptions(**options, in_flight_weights=in_flight, lora_rank=lora_rank)


ENGINE_OPTIONS = {"vllm": vllm_options}  # an options section -> what builds the engine's options


def ships_adapter(cfg: Config) -> bool:
    """Whether a LoRA policy's versions reach its vLLM engines as the adapter alone (their LoRA
    requests): beside the learner, and in local worker processes without partial rollouts
    (which would keep requests of several adapters in flight); else as merged whole weights
    (Ray's transports are not tested with adapters)."""
    if cfg.model.lora is None or not engine_kind(cfg.rollout.engine).adapters:
        return False
    p = cfg.pipeline
    return p.placement == "colocated" or (p.backend == "local" and not p.partial_rollout)


def producer_params(cfg: Config, first_iteration: int = 0) -> ProducerParams:
    """How the producer feeds the workers; a resumed run's begins at `first_iteration`."""
    return from_sections(
        ProducerParams,
        cfg.pipeline,
        cfg.train,
        cfg.rollout,
        max_staleness=max_staleness(cfg),
        first_iteration=first_iteration,
        tasks_in_flight=tasks_in_flight(cfg),
    )


def tasks_in_flight(cfg: Config) -> int:
    """`pipeline.tasks_in_flight`, or where it is 0 the tasks that fill a worker's engine slots
    (vLLM's 256 took 2 tasks of 4 x 8 = 64 sequences before), no more than the worker's share of
    what generation may hold at once, at least 2 (the former default)."""
    p, r = cfg.pipeline, cfg.rollout
    if p.tasks_in_flight:
        return p.tasks_in_flight
    if not engine_kind(r.engine).streams:  # a task is its batch: more queued adds no parallelism
        return 2
    fill = math.ceil(r.max_num_seqs / (p.prompts_per_task * r.group_size))
    held = cfg.train.prompts_per_iteration * (1 + max_staleness(cfg))
    share = math.ceil(held / (p.prompts_per_task * p.num_workers))
    return max(2, min(fill, share))


def ray_options(p: PipelineConfig) -> dict[str, Any]:
    """`RayPool`'s keyword arguments (none for the local backend); Ray must be installed."""
    if p.backend != "ray":
        return {}
    require_ray()
    return {
        "address": p.ray_address,
        "num_cpus": p.ray_num_cpus,
        "num_cpus_per_worker": p.num_cpus_per_worker,
        "num_gpus_per_worker": p.num_gpus_per_worker,
        "custom_resources": p.ray_worker_resources,
        "weight_sync": p.weight_sync,
    }


def loop_params(cfg: Config) -> LoopParams:
    """What the run loop needs to know of the configuration."""
    check_trackers(cfg)
    sections = (cfg.train, cfg.reward, cfg.pipeline, cfg.metrics)
    return from_sections(
        LoopParams,
        *sections,
        max_staleness=max_staleness(cfg),
        slots=cfg.rollout.max_num_seqs,
        reference_path=cfg.model.path,
        config_toml=to_toml(cfg),
        save_merged=cfg.model.lora is not None and cfg.model.lora.save_merged,
        behaviour_gap_max=behaviour_gap_max(cfg),
    )


BEHAVIOUR_GAPS = {"float32": 1e-3, "bfloat16": 2e-2, "float16": 2e-2}  # by model.dtype


def behaviour_gap_max(cfg: Config) -> float:
    """`pipeline.behaviour_gap_max`, or the model's dtype's (0: not watched)."""
    p = cfg.pipeline
    if p.on_behaviour_gap == "off":
        return 0.0
    return p.behaviour_gap_max or BEHAVIOUR_GAPS.get(cfg.model.dtype, 2e-2)


def reward_spec(cfg: Config) -> RewardSpec:
    """What each reward worker of `reward.stage = "separate"` builds its scorer from."""
    r = cfg.reward
    device = r.device or ("cuda" if cfg.model.device.startswith("cuda") else "cpu")
    return from_sections(
        RewardSpec, r, threads=r.threads_per_worker, dtype=cfg.model.dtype, device=device
    )
