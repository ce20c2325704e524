"""From the config to the plain parameters components take: the one place these translations
live, shared by the run builder and by `cadence bench`, `plan` and `study`, which build parts of
a run themselves. Only the CLI, the builder and these helpers read the config tree.
"""

from __future__ import annotations

import os
from itertools import islice

import torch

from cadence.algo import LossParams
from cadence.backend import WorkerSpec
from cadence.config import Config, ConfigError
from cadence.data import Example, load_task, make_prompt
from cadence.engine import SamplingParams
from cadence.envs import EnvSpec, demonstration, load_tools
from cadence.learner import LearnerParams
from cadence.pipeline.prompts import PromptFilter


def set_threads(threads: int) -> None:
    """torch threads of this process (0: every core)."""
    torch.set_num_threads(threads or os.cpu_count() or 1)


def make_task(cfg: Config):
    """The configured task (procedural, or a JSONL file): its training stream seeded by the run
    seed, its held-out split by `data.seed`."""
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
        heldout_seed=d.seed,
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
        env=env_spec(cfg),
    )


def env_spec(cfg: Config) -> EnvSpec:
    """The episode settings workers build their environment from; tools that cannot be loaded
    are a config error here, before any worker starts."""
    e = cfg.env
    if e.kind == "single_turn":
        return EnvSpec()
    try:
        load_tools(e.tools)
    except ValueError as err:
        raise ConfigError(f"config key 'env.tools': {err}") from None
    return EnvSpec(e.kind, tuple(e.tools), e.max_turns, e.max_total_tokens, e.tool_timeout_s)


def sft_segments(cfg: Config):
    """How the warm start splits an answer into (text, trained) pieces: with the calculator among
    the tools, each worked step becomes a call (trained) and its result (not trained); else the
    whole answer is trained."""
    if cfg.env.kind == "tool" and "calculator" in cfg.env.tools:
        return lambda example: demonstration(example.answer)
    return lambda example: [(example.answer, True)]


def tokenizer_corpus(cfg: Config, n: int) -> list[str]:
    """Texts to train the embedded model's tokenizer on: the task's, and with tools its
    demonstrations too (so the call syntax gets tokens of its own)."""
    task = make_task(cfg)
    corpus = task.corpus(n)
    if cfg.env.kind == "tool":
        split = sft_segments(cfg)
        examples: list[Example] = list(islice(task.train_iter(), n))
        template = cfg.data.prompt_template
        corpus += [
            make_prompt(e.question, template) + "".join(t for t, _ in split(e)) for e in examples
        ]
    return corpus
