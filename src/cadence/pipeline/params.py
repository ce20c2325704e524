"""From the config to the plain parameters components take: the one place these translations
live, shared by the run builder and by `cadence bench`, `plan` and `study`, which build parts of
a run themselves. Only the CLI, the builder and these helpers read the config tree.
"""

from __future__ import annotations

import os

import torch

from cadence.algo import LossParams, needs_reference
from cadence.backend import WorkerSpec
from cadence.config import Config
from cadence.data import load_task
from cadence.engine import SamplingParams
from cadence.learner import LearnerParams
from cadence.learner.ranks import RankSpec
from cadence.pipeline.prompts import PromptFilter


def set_threads(threads: int) -> None:
    """torch threads of this process (0: every core)."""
    torch.set_num_threads(threads or os.cpu_count() or 1)


def make_task(cfg: Config):
    """The configured task (procedural, or a JSONL file), seeded by the run seed."""
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
    """How rollouts sample: EOS and the configured stop strings end a response."""
    r = cfg.rollout
    return SamplingParams(
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        stop_token_ids=(tokenizer.eos_token_id,),
        stop=tuple(r.stop),
    )


def prompt_filter(cfg: Config, tokenizer) -> PromptFilter:
    """`rollout.max_prompt_tokens` and `rollout.on_long_prompt`, on the tokenizer's counts."""

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return PromptFilter(encode, cfg.rollout.max_prompt_tokens, cfg.rollout.on_long_prompt)


def learner_params(cfg: Config) -> tuple[LearnerParams, LossParams]:
    """The learner's and the loss's hyper-parameters."""
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
    """torch threads of the learner: the cores the workers leave it, unless set."""
    p = cfg.pipeline
    if p.placement == "colocated":
        return cfg.train.threads
    cores = os.cpu_count() or 1
    others = p.num_workers * p.threads_per_worker
    if cfg.reward.stage == "separate":
        others += cfg.reward.num_workers * cfg.reward.threads_per_worker
    return p.learner_threads or max(1, cores - others)


def rank_threads(cfg: Config) -> int:
    """torch threads of each learner rank: the learner's threads shared among its ranks."""
    threads = learner_threads(cfg) or os.cpu_count() or 1
    return cfg.learner.threads_per_rank or max(1, threads // cfg.learner.ranks)


def rank_spec(cfg: Config, pad_id: int) -> RankSpec:
    """What each of the `learner.ranks` ranks builds itself from."""
    params, loss = learner_params(cfg)
    return RankSpec(
        model_path=cfg.model.path,
        params=params,
        loss=loss,
        pad_id=pad_id,
        world_size=cfg.learner.ranks,
        strategy=cfg.learner.strategy,
        dtype=cfg.model.dtype,
        needs_reference=needs_reference(cfg.algo.loss, cfg.algo.kl_coef),
        threads=rank_threads(cfg),
        timeout_s=cfg.pipeline.worker_timeout_s,
    )


def max_staleness(cfg: Config) -> int:
    """Versions a trained group may lag the learner: 0 except in off-policy mode."""
    return cfg.pipeline.max_staleness if cfg.pipeline.mode == "offpolicy" else 0


def worker_spec(cfg: Config, sampling: SamplingParams) -> WorkerSpec:
    """What each rollout worker builds itself from; it scores only without a reward stage."""
    return WorkerSpec(
        model_path=cfg.model.path,
        dtype=cfg.model.dtype,
        reward="" if cfg.reward.stage == "separate" else cfg.reward.function,
        sampling=sampling,
        group_size=cfg.rollout.group_size,
        run_seed=cfg.train.seed,
        threads=cfg.pipeline.threads_per_worker,
        max_num_seqs=cfg.rollout.max_num_seqs,
        engine=cfg.rollout.engine,
    )
