"""From the config to the plain parameters components take: the one place these translations
live, shared by the run builder and by `cadence bench`, `plan` and `study`, which build parts of
a run themselves. Only the CLI, the builder and these helpers read the config tree.
"""

from __future__ import annotations

import json
import os
from itertools import islice
from pathlib import Path

import torch

from cadence.algo import (
    ADVANTAGES,
    AdvantageContext,
    AlgoParams,
    get_advantage,
    is_pair_loss,
)
from cadence.config import Config, ConfigError
from cadence.data import (
    ChatRender,
    DataError,
    DatasetChoice,
    Example,
    PlainRender,
    Render,
    load_task,
    make_prompt,
)
from cadence.engine import SamplingParams
from cadence.engine.vllm import INSTALL_HINT, VLLMOptions, vllm_available
from cadence.envs import (
    CHAT_KINDS,
    ChatToolsError,
    Environment,
    EnvSpec,
    VerifiersEnv,
    check_env,
    demonstration,
    make_env,
)
from cadence.learner import LearnerParams
from cadence.learner.rank import RankSpec
from cadence.models import stop_token_ids
from cadence.pipeline.prompts import PromptFilter
from cadence.rollout import PartialRollouts, WorkerSpec


def set_threads(threads: int) -> None:
    """torch threads of this process (0: every core)."""
    torch.set_num_threads(threads or os.cpu_count() or 1)


def make_task(cfg: Config):
    """The configured task (procedural, a local data set, or a reasoning-gym mix): its training
    stream seeded by the run seed (a reasoning-gym mix: by its own seed if set), its held-out
    split by `data.seed`. A reasoning-gym mix builds each of its datasets here, so a bad name or
    config key stops the run before it trains (a `DataError`, exit code 2)."""
    d = cfg.data
    if cfg.env.kind == "verifiers":
        return verifiers_tasks(cfg)
    if d.task == "reasoning_gym" and d.reasoning_gym is not None:
        rg = d.reasoning_gym
        return load_task(
            d.task,
            datasets=[DatasetChoice(n, c.weight, c.config) for n, c in rg.datasets.items()],
            size=rg.size,
            seed=cfg.train.seed if rg.seed is None else rg.seed,
            num_heldout=d.num_heldout,
            heldout_seed=d.seed,
            developer_prompt=rg.developer_prompt,
        )
    if d.task in ("gsm8k", "dataset"):
        fields = {"prompt_field": d.prompt_field, "answer_field": d.answer_field}
        return load_task(
            d.task,
            path=d.path,
            split=d.split,
            heldout_path=d.heldout_path,
            heldout_split=d.heldout_split,
            heldout_fraction=d.heldout_fraction,
            num_heldout=d.num_heldout,
            on_bad_line=d.on_bad_line,
            seed=cfg.train.seed,
            heldout_seed=d.seed,
            **(fields if d.task == "dataset" else {}),
        )
    return load_task(
        d.task,
        difficulty=d.difficulty,
        seed=cfg.train.seed,
        num_heldout=d.num_heldout,
        max_operand=d.max_operand,
        heldout_seed=d.seed,
    )


def verifiers_tasks(cfg: Config):
    """A verifiers environment's taskset as the run's task (envs/verifiers/env.py): its last
    `data.num_heldout` tasks held out, the rest shuffled per epoch by the run seed."""
    try:
        from cadence.envs.verifiers.env import TasksetTask
    except ImportError as e:
        raise ConfigError(
            f"env.kind = 'verifiers' needs verifiers: pip install 'cadence[verifiers]' ({e})"
        ) from None
    try:
        return TasksetTask(cfg.env.factory, cfg.train.seed, cfg.data.num_heldout)
    except DataError:
        raise
    except ValueError as e:  # the factory cannot be imported or returns no environment
        raise ConfigError(f"config key 'env.factory': {e}") from None


def prompt_render(cfg: Config, tokenizer) -> Render:
    """How every prompt of the run is rendered: `data.prompt_template`, or a chat template (a
    verifiers environment renders its own: the prompt's text is the task's, as it is)."""
    d = cfg.data
    if cfg.env.kind == "verifiers":
        return PlainRender("{question}")
    if d.chat_template is False:
        return PlainRender(d.prompt_template)
    template = None
    if isinstance(d.chat_template, str):
        path = Path(d.chat_template)
        if not path.is_file():
            raise ConfigError(
                f"data.chat_template '{path}': no such Jinja template file (true uses the "
                "tokenizer's own template)"
            )
        template = path.read_text(encoding="utf-8")
    return ChatRender(tokenizer, d.prompt_template, d.system_prompt, template)


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


def prompt_filter(cfg: Config, tokenizer, max_positions: int | None = None) -> PromptFilter:
    """`rollout.max_prompt_tokens` (see `max_prompt_tokens`) and `rollout.on_long_prompt`, on
    the tokenizer's counts."""

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    if cfg.env.kind == "verifiers":  # its endpoint refuses a rendered prompt that cannot fit
        return PromptFilter(None)
    limit = max_prompt_tokens(cfg, max_positions)
    return PromptFilter(encode, limit, cfg.rollout.on_long_prompt)


def max_prompt_tokens(cfg: Config, max_positions: int | None) -> int:
    """The longest prompt a run feeds the model: `rollout.max_prompt_tokens`, or when it is 0
    the positions left once a response has room, so that prompt and response always fit; a
    setting that would not fit is a `ConfigError`. 0 (no limit) only for a model that states no
    limit and no `rollout.vllm.max_model_len`.

    The positions are the model's (`max_positions`), capped by `rollout.vllm.max_model_len`; a
    response is `rollout.max_new_tokens`, or with an environment the whole episode after the
    prompt (`env.max_total_tokens`: every turn and tool reply)."""
    r = cfg.rollout
    positions, where = _engine_positions(cfg, max_positions)
    if positions is None:
        return r.max_prompt_tokens
    reply, what = cfg.response_budget
    room = positions - reply
    if room < 1:
        raise ConfigError(f"{what} = {reply} leaves no room for a prompt in {where}: lower it")
    if r.max_prompt_tokens > room:
        raise ConfigError(
            f"rollout.max_prompt_tokens = {r.max_prompt_tokens} plus {what} = {reply} exceeds "
            f"{where}: set rollout.max_prompt_tokens <= {room}, or 0 for that limit"
        )
    return r.max_prompt_tokens or room


def _engine_positions(cfg: Config, max_positions: int | None) -> tuple[int | None, str]:
    """(the most positions prompt and response may take, what sets them, for messages)."""
    cap = cfg.rollout.vllm.max_model_len
    model = f"the model's {max_positions} positions (max_position_embeddings)"
    if cap and (max_positions is None or cap < max_positions):
        return cap, f"rollout.vllm.max_model_len = {cap}"
    return max_positions, model


def model_positions(path: str | Path) -> int | None:
    """The positions the model in `path` takes, read from its config.json alone (no weights):
    None when it states none, or when `path` holds a LoRA adapter (its base's are checked once
    the model is loaded)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("max_position_embeddings")


def algo_params(cfg: Config) -> AlgoParams:
    """The algorithm: `algo`'s keys, `reward`'s shaping, and the episode's cap on policy tokens
    (`Config.max_policy_tokens`: the overlong penalty's and seq-sum-norm's, not one turn's)."""
    a, r = cfg.algo, cfg.reward
    return AlgoParams(
        loss=a.loss,
        advantage=a.advantage,
        scale_by_std=a.scale_by_std,
        std=a.std,
        std_eps=a.std_eps,
        loss_agg=a.loss_agg,
        clip_low=a.clip_low,
        clip_high=a.clip_high,
        clip_ratio_c=a.clip_ratio_c,
        kl_coef=a.kl_coef,
        kl_estimator=a.kl_estimator,
        kl_clamp=a.kl_clamp,
        rollout_correction=a.rollout_correction,
        correction_clip_min=a.correction_clip_min,
        correction_clip_max=a.correction_clip_max,
        correction_proximal=a.correction_proximal,
        tis_cap=a.tis_cap,
        dpo_beta=a.dpo_beta,
        dpo_loss=a.dpo_loss,
        max_policy_tokens=cfg.max_policy_tokens,
        overlong_buffer=r.overlong_buffer,
        overlong_penalty=r.overlong_penalty,
        mask_truncated=a.mask_truncated,
    )


def learner_params(cfg: Config) -> LearnerParams:
    """How the learner steps and lays out its work (the algorithm is `algo_params`)."""
    t = cfg.train
    return LearnerParams(
        lr=t.lr,
        warmup_steps=t.warmup_iterations * t.mini_batches,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        micro_batch_groups=t.micro_batch_groups,
        mini_batches=t.mini_batches,
        temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
        shared_prompt=cfg.learner.shared_prompt,
        shared_prompt_impl=cfg.learner.shared_prompt_impl,
        reuse_old_logprobs=cfg.learner.reuse_old_logprobs,
        max_bad_steps=t.max_bad_steps,
    )


def check_group_size(cfg: Config) -> None:
    """Refuse `rollout.group_size = 1` with an advantage or loss that compares the samples of a
    group with each other: every advantage would be 0 (loss 0, grad norm 0) and the run would
    train nothing while looking healthy."""
    if cfg.rollout.group_size > 1:
        return
    a = cfg.algo
    works = ", ".join(f"'{name}'" for name in ADVANTAGES if learns_from_one_sample(name))
    if is_pair_loss(a.loss):
        raise ConfigError(
            f"algo.loss = '{a.loss}' pairs each group's best and worst response: it needs "
            "rollout.group_size >= 2 (got 1)"
        )
    if not learns_from_one_sample(a.advantage):
        raise ConfigError(
            f"rollout.group_size = 1 with algo.advantage = '{a.advantage}' trains nothing: a "
            "group-relative advantage is 0 for a group of one sample. Raise rollout.group_size "
            f"to 2 or more, or use an advantage that works with group_size = 1: {works}"
        )


def learns_from_one_sample(advantage: str) -> bool:
    """Whether `advantage` gives a one-sample group a non-zero advantage (asked of the registered
    function itself, reward 1 and the default context: no list of names to keep in step)."""
    try:
        value = get_advantage(advantage)(torch.ones(1, 1), AdvantageContext())
    except ValueError:  # refuses a group of one outright (rloo)
        return False
    return bool(value.abs().sum() > 0)


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
    return RankSpec(
        model_path=cfg.model.path,
        params=learner_params(cfg),
        algo=algo_params(cfg),
        pad_id=pad_id,
        world_size=cfg.learner.ranks,
        strategy=cfg.learner.strategy,
        dtype=cfg.model.dtype,
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
        vllm=vllm_options(cfg),  # read by an engine that takes them (vllm) only
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


def env_spec(cfg: Config) -> EnvSpec:
    """The episode settings workers build their environment from; tools or environment classes
    that cannot be loaded, or break their contract, are a config error here, before any worker
    starts. The chat kinds carry `data.chat_template`'s Jinja text when it names a file."""
    e = cfg.env
    if e.kind == "single_turn":
        return EnvSpec()
    if e.kind == "verifiers":
        renderer = "model" if cfg.data.chat_template else "plain"
        return EnvSpec(e.kind, factory=e.factory or "", renderer=renderer)
    template = None
    if e.kind in CHAT_KINDS and isinstance(cfg.data.chat_template, str):
        path = Path(cfg.data.chat_template)
        if not path.is_file():
            raise ConfigError(f"data.chat_template '{path}': no such Jinja template file")
        template = path.read_text(encoding="utf-8")
    spec = EnvSpec(
        e.kind,
        tuple(e.tools) if e.kind == "tool" else (),
        e.max_turns,
        e.max_total_tokens,
        e.tool_timeout_s,
        factory=e.factory or "",
        factories=tuple((e.factories or {}).items()),
        chat_template=template,
    )
    try:
        check_env(spec)
    except ValueError as err:
        key = "env.tools" if e.kind == "tool" else "env.factories" if e.factories else "env.factory"
        raise ConfigError(f"config key '{key}': {err}") from None
    return spec


def environment(cfg: Config, tokenizer) -> Environment | VerifiersEnv | None:
    """The run's environment, built with `tokenizer` (its chat template, for the chat kinds);
    a template that cannot carry tool calls is a config error naming the reason."""
    try:
        return make_env(env_spec(cfg), tokenizer)
    except ChatToolsError as err:
        own = not isinstance(cfg.data.chat_template, str)
        where = "the model's tokenizer" if own else f"data.chat_template '{cfg.data.chat_template}'"
        raise ConfigError(
            f"env.kind = '{cfg.env.kind}' needs a chat template that carries tool calls, and "
            f"{where} has none: {err}"
        ) from None


def sft_segments(cfg: Config):
    """How the warm start splits an answer into (text, trained) pieces: with the calculator among
    the tools, each worked step becomes a call (trained) and its result (not trained); else the
    whole answer is trained. A verifiers taskset has no reference answers to train on."""
    if cfg.env.kind == "verifiers":
        raise ConfigError(
            "cadence sft trains on a task's reference answers, and a verifiers taskset has none: "
            "warm-start with the config of a cadence task in the same format (configs/"
            "verifiers.toml warm-starts with configs/calculator.toml)"
        )
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


def vllm_options(cfg: Config) -> VLLMOptions:
    """The `[rollout.vllm]` table as the vLLM engine takes it."""
    return VLLMOptions(**cfg.rollout.vllm.model_dump())


def require_engine(kind: str) -> None:
    """`rollout.engine = 'vllm'` without vLLM installed is a config error naming the install."""
    if kind == "vllm" and not vllm_available():
        raise ConfigError(
            f"rollout.engine = 'vllm' needs vLLM, which is not installed: {INSTALL_HINT}"
        )
