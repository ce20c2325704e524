"""The checks across sections: settings each valid on its own that cannot run together. Each is
a plain function of the whole config that raises ValueError naming the keys and the fix;
`check_all` runs them in order (the root's one validator)."""

from __future__ import annotations

from typing import Protocol

from cadence.choices import CHAT_KINDS, ENGINES, engine_kind, env_kind
from cadence.config.algo import AlgoConfig
from cadence.config.base import changed, check_custom_resources
from cadence.config.data import DataConfig
from cadence.config.distill import DistillConfig
from cadence.config.env import EnvConfig
from cadence.config.model import ModelConfig
from cadence.config.reward import RewardConfig
from cadence.config.rollout import RolloutConfig
from cadence.config.train import LearnerConfig, PipelineConfig


class Sections(Protocol):
    """What the checks read of the whole config (config/root.py's `Config`)."""

    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig
    reward: RewardConfig
    algo: AlgoConfig
    learner: LearnerConfig
    pipeline: PipelineConfig
    env: EnvConfig
    distill: DistillConfig

    @property
    def max_policy_tokens(self) -> int: ...

    @property
    def response_budget(self) -> tuple[int, str]: ...


def check_reasoning_gym_rows(cfg: Sections) -> None:
    if cfg.reward.function == "reasoning_gym" and cfg.data.task != "reasoning_gym":
        raise ValueError(
            "reward.function = 'reasoning_gym' scores reasoning-gym rows with their own "
            f"metadata: it needs data.task = 'reasoning_gym', not '{cfg.data.task}'"
        )


def check_chat_environments_need_a_chat_template(cfg: Sections) -> None:
    if env_kind(cfg.env.kind).chat and cfg.data.chat_template is False:
        raise ValueError(
            f"env.kind = '{cfg.env.kind}' writes tool calls and replies in the model's chat "
            "template: set data.chat_template = true (the tokenizer's, if it renders tools) "
            "or to a Jinja file that does (configs/chat-tools.jinja)"
        )


def check_correction_needs_sampled_logprobs(cfg: Sections) -> None:
    mode = cfg.algo.rollout_correction
    if cfg.rollout.temperature == 0 and (mode != "none" or cfg.algo.tis_cap > 0):
        raise ValueError(
            f"algo.rollout_correction = '{mode if mode != 'none' else 'token_truncate'}' "
            "weighs by pi_old / pi_behaviour, but with rollout.temperature = 0 the engine "
            "decodes greedily: the log-probs it records are not those of the policy that "
            "chose the tokens (greedy gives each probability 1). Sample (rollout.temperature "
            "> 0) or set algo.rollout_correction = 'none' and algo.tis_cap = 0"
        )


def check_reward_stage_needs_workers(cfg: Sections) -> None:
    r, placement, env = cfg.reward, cfg.pipeline.placement, cfg.env.kind
    if r.stage != "separate":
        return
    if r.kind == "model" and placement != "separate":
        raise ValueError(
            "reward.kind = 'model' scores in a reward stage beside the rollout workers: set "
            "pipeline.placement = 'separate'"
        )
    if placement == "separate" and env in CHAT_KINDS:  # their rewards come with the episode
        raise ValueError(
            f"reward.stage = 'separate' with pipeline.placement = 'separate' scores every "
            f"response with reward.function, and env.kind = '{env}' gives rewards of its own, "
            "which would be dropped: set reward.stage = 'worker'"
        )


def check_teacher_stage_needs_workers(cfg: Sections) -> None:
    d = cfg.distill
    if d.on and d.placement == "worker" and cfg.pipeline.placement != "separate":
        raise ValueError(
            "distill.placement = 'worker' scores rows in a teacher stage as they reach the "
            "sample store, which rollout workers fill: set pipeline.placement = 'separate', or "
            "distill.placement = 'learner'"
        )


def check_prompt_fits_vllm(cfg: Sections) -> None:
    """rollout.vllm.max_model_len caps prompt and response together: a response budget that
    leaves no prompt room is refused here (the model's own positions once it is read)."""
    r, cap = cfg.rollout, cfg.rollout.vllm.max_model_len
    if not cap:
        return
    reply, what = cfg.response_budget
    where = f"rollout.vllm.max_model_len = {cap}"
    if cap - reply < 1:
        raise ValueError(f"{what} = {reply} leaves no room for a prompt in {where}: lower it")
    if r.max_prompt_tokens > cap - reply:
        raise ValueError(
            f"rollout.max_prompt_tokens = {r.max_prompt_tokens} plus {what} = {reply} "
            f"exceeds {where}: set rollout.max_prompt_tokens <= {cap - reply}, or 0 for "
            "that limit"
        )


def check_overlong_buffer_fits(cfg: Sections) -> None:
    buffer, longest = cfg.reward.overlong_buffer, cfg.max_policy_tokens
    limits = ("max_turns", "max_total_tokens")
    if buffer and cfg.env.kind == "verifiers" and not changed(cfg.env, limits):
        raise ValueError(
            f"reward.overlong_buffer = {buffer} with env.kind = 'verifiers': the penalty ramps up "
            "to the episode's cap, which the environment sets; state it with env.max_turns "
            "and/or env.max_total_tokens (the environment's own limits), or set "
            "reward.overlong_buffer = 0"
        )
    if buffer > longest:
        what = "rollout.max_new_tokens"
        if env_kind(cfg.env.kind).answers:
            what = "the episode's cap (env.max_turns x rollout.max_new_tokens, at most "
            what += "env.max_total_tokens)"
        raise ValueError(
            f"reward.overlong_buffer = {buffer} is longer than {what} = {longest}: the "
            "penalty ramps over the last policy tokens before that cap; set "
            f"reward.overlong_buffer <= {longest}"
        )


def check_learner_ranks(cfg: Sections) -> None:
    ranks, backend = cfg.learner, cfg.pipeline.backend
    if backend != "ray":
        ray_keys = ("num_cpus_per_rank", "ray_rank_resources")
        for key in changed(ranks, ray_keys):
            raise ValueError(
                f"learner.{key} applies to pipeline.backend = 'ray' only: set the "
                f"backend or leave learner.{key} out"
            )
    check_custom_resources("learner.ray_rank_resources", ranks.ray_rank_resources)
    on_gpu = cfg.model.device.startswith("cuda")
    if ranks.ranks > 1 and backend == "ray" and on_gpu and ranks.num_gpus_per_rank == 0:
        raise ValueError(
            f"learner.ranks = {ranks.ranks} on Ray with model.device = "
            f"'{cfg.model.device}': set learner.num_gpus_per_rank > 0 (each rank "
            "trains on a GPU of its own)"
        )
    if ranks.ranks > 1 and on_gpu and cfg.pipeline.placement == "colocated":
        raise ValueError(
            f"learner.ranks = {ranks.ranks} with pipeline.placement = 'colocated' on "
            f"model.device = '{cfg.model.device}': colocated generation runs in the driver, on "
            "one GPU, while the ranks train on theirs, so one GPU would generate for all of "
            "them; set pipeline.placement = 'separate' (workers on GPUs of their own: "
            "pipeline.num_gpus_per_worker) or learner.ranks = 1"
        )
    share = ranks.num_gpus_per_rank
    if ranks.ranks > 1 and 0 < share < 1:
        raise ValueError(
            f"learner.ranks = {ranks.ranks} with learner.num_gpus_per_rank = {share:g}: ranks "
            "would share a GPU, and NCCL refuses two ranks of one group on one device; give "
            "each rank a whole GPU (learner.num_gpus_per_rank = 1) or train with "
            "learner.ranks = 1"
        )
    if ranks.ranks > 1 and cfg.model.lora is not None:
        raise ValueError(
            f"learner.ranks = {ranks.ranks} with model.lora: the ranks shard a full model; "
            "train a LoRA adapter with learner.ranks = 1"
        )


def check_verifiers_env(cfg: Sections) -> None:
    """A verifiers environment brings its tasks, prompts and rewards: the keys that would
    choose them otherwise are refused rather than ignored."""
    if cfg.env.kind != "verifiers":
        return
    if changed(cfg.data, ["task"]):
        raise ValueError(
            "env.kind = 'verifiers' takes its tasks from the environment's taskset: leave "
            "data.task out"
        )
    if isinstance(cfg.data.chat_template, str):
        raise ValueError(
            "env.kind = 'verifiers': data.chat_template = true renders with the model's own "
            "template (verifiers' renderer for it), false with cadence's plain renderer; a "
            "template file is not supported"
        )
    if cfg.reward.stage == "separate":
        raise ValueError(
            "env.kind = 'verifiers' scores each episode with the environment's rubric in "
            "the rollout worker: set reward.stage = 'worker'"
        )


def check_partial_rollout_engine(cfg: Sections) -> None:
    """Partial rollouts need an engine that takes weights between decode steps and stamps
    each token's version, and responses of one turn."""
    if not cfg.pipeline.partial_rollout:
        return
    engine, kv = cfg.rollout.engine, cfg.pipeline.partial_rollout_kv
    offered = engine_kind(engine).in_flight
    if not offered:
        takers = " or ".join(f"'{n}'" for n, k in ENGINES.items() if k.in_flight)
        raise ValueError(
            f"pipeline.partial_rollout = true with rollout.engine = '{engine}': it decodes a "
            "whole batch in one call, with no step between tokens to load weights at; use "
            f"rollout.engine = {takers}"
        )
    if cfg.rollout.vllm.engine_args.get("async_scheduling"):
        raise ValueError(
            "pipeline.partial_rollout = true with rollout.vllm.engine_args.async_scheduling = "
            "true: a step scheduled before a weight load would compute under the old weights and "
            "be stamped with the new version; leave async_scheduling out (cadence turns it off)"
        )
    if kv not in offered:
        takers = " or ".join(f"'{n}'" for n, k in ENGINES.items() if kv in k.in_flight)
        raise ValueError(
            f"pipeline.partial_rollout_kv = '{kv}' with rollout.engine = '{engine}': the engine "
            f"keeps the keys and values of requests in flight as {' or '.join(offered)} only; "
            f"use partial_rollout_kv = '{offered[0]}', or rollout.engine = {takers} to {kv}"
        )
    if env_kind(cfg.env.kind).answers:
        raise ValueError(
            f"pipeline.partial_rollout = true with env.kind = '{cfg.env.kind}': partial "
            "rollouts load weights between decode steps of single responses, not inside "
            "multi-turn episodes; use env.kind = 'single_turn' or turn partial_rollout off"
        )


def check_periodic_steps_with_dynamic_sampling(cfg: Sections) -> None:
    """Periodic makes sync's update: with dynamic sampling, which groups fill the iteration
    depends on the order they finish in, so several optimizer steps could not be cut as sync's
    are; the combination is refused rather than run unlike sync."""
    p, steps = cfg.pipeline, cfg.train.mini_batches
    if p.mode == "periodic" and p.filter_groups != "none" and steps > 1:
        raise ValueError(
            f"pipeline.mode = 'periodic' with pipeline.filter_groups = '{p.filter_groups}' and "
            f"train.mini_batches = {steps}: dynamic sampling keeps groups in the order they "
            "finish, so the groups of each optimizer step would not be sync's; set "
            "train.mini_batches = 1, or pipeline.mode = 'sync'"
        )


def check_broadcast_devices(cfg: Sections) -> None:
    p = cfg.pipeline
    on_gpu = cfg.model.device.startswith("cuda")
    if p.weight_sync == "broadcast" and on_gpu and p.num_gpus_per_worker == 0:
        raise ValueError(
            f"pipeline.weight_sync = 'broadcast' with model.device = '{cfg.model.device}' "
            "broadcasts over NCCL, GPU to GPU: set pipeline.num_gpus_per_worker > 0 or use "
            "pipeline.weight_sync = 'object_store'"
        )


def check_local_gpus(cfg: Sections) -> None:
    """On the local backend the GPU shares place processes on GPUs (backend/placement.py): they
    need a CUDA run, a rank trains on one GPU at most, a worker takes a fraction or whole GPUs,
    and separate workers of a CUDA run need a share (0 would leave them on the CPU)."""
    p, ranks = cfg.pipeline, cfg.learner
    if p.backend != "local":
        return
    on_gpu = cfg.model.device.startswith("cuda")
    asked = [
        (key, value)
        for key, value in (
            ("learner.num_gpus_per_rank", ranks.num_gpus_per_rank),
            ("pipeline.num_gpus_per_worker", p.num_gpus_per_worker),
        )
        if value > 0
    ]
    if asked and not on_gpu:
        key, value = asked[0]
        raise ValueError(
            f"{key} = {value:g} with model.device = '{cfg.model.device}': GPU shares place "
            "processes on GPUs; set model.device = 'cuda' or leave the key out"
        )
    if ranks.num_gpus_per_rank > 1:
        raise ValueError(
            f"learner.num_gpus_per_rank = {ranks.num_gpus_per_rank:g} on the local backend: a "
            "rank trains on one GPU (a fraction shares one); more GPUs: more learner.ranks"
        )
    share = p.num_gpus_per_worker
    if share > 1 and share != int(share):
        raise ValueError(
            f"pipeline.num_gpus_per_worker = {share:g}: above 1 a worker takes whole GPUs (an "
            "integer, e.g. 2 for tensor parallel 2); below 1 it shares one"
        )
    if on_gpu and p.placement == "separate" and share == 0:
        raise ValueError(
            f"pipeline.placement = 'separate' with model.device = '{cfg.model.device}' on the "
            "local backend needs pipeline.num_gpus_per_worker: 1 gives each worker a GPU of its "
            "own after the learner's (learner.num_gpus_per_rank, 1 by default); 0.5 with "
            "learner.num_gpus_per_rank = 0.5 shares one GPU between the learner and one worker"
        )


def check_tensor_parallel(cfg: Sections) -> None:
    """A vLLM worker splits its model over the GPUs it holds: tensor parallel N needs N of
    them, and a colocated engine's N GPUs beside one learner process is refused."""
    tp, p = cfg.rollout.vllm.tensor_parallel_size, cfg.pipeline
    splits = engine_kind(cfg.rollout.engine).tensor_parallel
    if tp == 1 or not splits or not cfg.model.device.startswith("cuda"):
        return
    if p.placement == "separate" and p.num_gpus_per_worker < tp:
        raise ValueError(
            f"rollout.vllm.tensor_parallel_size = {tp} with pipeline.num_gpus_per_worker = "
            f"{p.num_gpus_per_worker:g}: each worker's vLLM splits the model over the GPUs it "
            f"holds; set pipeline.num_gpus_per_worker = {tp}"
        )
    if p.placement == "colocated":
        raise ValueError(
            f"rollout.vllm.tensor_parallel_size = {tp} with pipeline.placement = 'colocated': "
            "the colocated engine shares the learner's one GPU, and tensor parallel would "
            "spread it over GPUs that idle while the learner trains; use pipeline.placement = "
            f"'separate' with pipeline.num_gpus_per_worker = {tp}"
        )


def check_master_dtype(cfg: Sections) -> None:
    if cfg.learner.master_dtype == "bfloat16" and cfg.model.dtype != "bfloat16":
        raise ValueError(
            "learner.master_dtype = 'bfloat16' keeps bf16 parameters under a bf16 model: it "
            f"needs model.dtype = 'bfloat16' (got '{cfg.model.dtype}')"
        )


CHECKS = (
    check_master_dtype,
    check_reasoning_gym_rows,
    check_chat_environments_need_a_chat_template,
    check_correction_needs_sampled_logprobs,
    check_reward_stage_needs_workers,
    check_teacher_stage_needs_workers,
    check_prompt_fits_vllm,
    check_overlong_buffer_fits,
    check_learner_ranks,
    check_verifiers_env,
    check_partial_rollout_engine,
    check_periodic_steps_with_dynamic_sampling,
    check_broadcast_devices,
    check_local_gpus,
    check_tensor_parallel,
)


def check_all(cfg: Sections) -> None:
    """Every check across sections, in order."""
    for check in CHECKS:
        check(cfg)
