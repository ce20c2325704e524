"""The builder's task side: from the config to the run's tasks, prompts, environment and the warm
start's segments.

Whether the environment brings its own tasks, renders its own prompts, fits its own prompt
lengths or has reference answers is asked of its kind (`choices.env_kind`), never compared by
name. Only the builder and the CLI call these; they read the config tree, nothing else does.
"""

from __future__ import annotations

from itertools import islice
from pathlib import Path

from cadence.builder.checks import max_prompt_tokens
from cadence.choices import env_kind
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
from cadence.envs import (
    ChatToolsError,
    EnvSpec,
    check_env,
    demonstration,
)
from cadence.pipeline.prompts import PromptFilter, heldout_prompts
from cadence.types import Prompt


def make_task(cfg: Config):
    """The configured task (procedural, a local data set, or a reasoning-gym mix): its training
    stream seeded by the run seed (a reasoning-gym mix: by its own seed if set), its held-out
    split by `data.seed`. A reasoning-gym mix builds each of its datasets here, so a bad name or
    config key stops the run before it trains (a `DataError`, exit code 2)."""
    d = cfg.data
    if env_kind(cfg.env.kind).own_tasks:
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
    if env_kind(cfg.env.kind).own_tasks:
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


def prompt_filter(cfg: Config, tokenizer, max_positions: int | None = None) -> PromptFilter:
    """`rollout.max_prompt_tokens` (see `max_prompt_tokens`) and `rollout.on_long_prompt`, on
    the tokenizer's counts."""

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    if env_kind(cfg.env.kind).own_tasks:  # it refuses a rendered prompt that cannot fit
        return PromptFilter(None)
    limit = max_prompt_tokens(cfg, max_positions)
    return PromptFilter(encode, limit, cfg.rollout.on_long_prompt)


def env_spec(cfg: Config) -> EnvSpec:
    """The episode settings workers build their environment from; tools or environment classes
    that cannot be loaded, or break their contract, are a config error here, before any worker
    starts. The chat kinds carry `data.chat_template`'s Jinja text when it names a file."""
    e, kind = cfg.env, env_kind(cfg.env.kind)
    if not kind.answers:
        return EnvSpec()
    if kind.own_tasks:
        renderer = "model" if cfg.data.chat_template else "plain"
        return EnvSpec(e.kind, factory=e.factory or "", renderer=renderer)
    template = None
    if kind.chat and isinstance(cfg.data.chat_template, str):
        path = Path(cfg.data.chat_template)
        if not path.is_file():
            raise ConfigError(f"data.chat_template '{path}': no such Jinja template file")
        template = path.read_text(encoding="utf-8")
    spec = EnvSpec(
        e.kind,
        tuple(e.tools) if kind.syntax_tools else (),
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
        key = "env.factories" if e.factories else "env.factory"
        key = "env.tools" if kind.syntax_tools else key
        raise ConfigError(f"config key '{key}': {err}") from None
    return spec


def env_error(cfg: Config, err: ChatToolsError) -> ConfigError:
    """What a run says when its chat template cannot carry the environment's tool calls."""
    own = not isinstance(cfg.data.chat_template, str)
    where = "the model's tokenizer" if own else f"data.chat_template '{cfg.data.chat_template}'"
    return ConfigError(
        f"env.kind = '{cfg.env.kind}' needs a chat template that carries tool calls, and "
        f"{where} has none: {err}"
    )


def sft_segments(cfg: Config):
    """How the warm start splits an answer into (text, trained) pieces: with the calculator among
    the tools, each worked step becomes a call (trained) and its result (not trained); else the
    whole answer is trained. A verifiers taskset has no reference answers to train on."""
    kind = env_kind(cfg.env.kind)
    if not kind.reference_answers:
        raise ConfigError(
            "cadence sft trains on a task's reference answers, and a verifiers taskset has none: "
            "warm-start with the config of a cadence task in the same format (configs/"
            "verifiers.toml warm-starts with configs/calculator.toml)"
        )
    if kind.syntax_tools and "calculator" in cfg.env.tools:
        return lambda example: demonstration(example.answer)
    return lambda example: [(example.answer, True)]


def tokenizer_corpus(cfg: Config, n: int) -> list[str]:
    """Texts to train the embedded model's tokenizer on: the task's, and with tools its
    demonstrations too (so the call syntax gets tokens of its own)."""
    task = make_task(cfg)
    corpus = task.corpus(n)
    if env_kind(cfg.env.kind).syntax_tools:
        split = sft_segments(cfg)
        examples: list[Example] = list(islice(task.train_iter(), n))
        template = cfg.data.prompt_template
        corpus += [
            make_prompt(e.question, template) + "".join(t for t, _ in split(e)) for e in examples
        ]
    return corpus


def heldout_set(cfg: Config, tokenizer, positions: int | None, task=None) -> list[Prompt]:
    """The task's held-out prompts (of `task`, default the configured one), rendered and fitted
    to `positions` as training's are."""
    fit = prompt_filter(cfg, tokenizer, positions)
    render = prompt_render(cfg, tokenizer)
    return heldout_prompts(task or make_task(cfg), render, cfg.data.task, fit)
