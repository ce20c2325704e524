"""The builder's refusals: settings that validate key by key but cannot run together, refused
before any weight loads (a `ConfigError`, exit code 2) with the keys and the fix.

What one section can check of itself is the config's (config/); what needs the model, the
installed packages or a checkpoint is here. Nothing here builds a component.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from cadence.algo import ADVANTAGES, AdvantageContext, get_advantage, is_pair_loss
from cadence.choices import LOSSES, engine_kind, loss_kind
from cadence.config import Config, ConfigError
from cadence.engine.vllm import INSTALL_HINT
from cadence.pipeline.checkpoint import Checkpoint
from cadence.pipeline.checkpoint_files import CheckpointError


def check_before_loading(cfg: Config) -> None:
    """What can be refused before any weight loads: a group size the algorithm cannot learn
    from, an engine that is not installed, a response budget that leaves no room for a prompt
    in the model's positions (read from its config.json)."""
    check_group_size(cfg)
    check_teachers(cfg)
    require_engine(cfg.rollout.engine)
    max_prompt_tokens(cfg, model_positions(cfg.model.path))


def check_teachers(cfg: Config) -> None:
    """[distill]: a loss that reads per-token advantages, and teachers whose tokenizer is the
    student's (vocabulary and special tokens compared from the tokenizer files alone, before any
    weight loads)."""
    d = cfg.distill
    if not d.on:
        return
    if not loss_kind(cfg.algo.loss).token_advantages:
        works = ", ".join(k for k in LOSSES if loss_kind(k).token_advantages)
        raise ConfigError(
            f"distillation gives each token its own advantage; algo.loss = '{cfg.algo.loss}' "
            f"reads one per sequence (or none): use one of {works}"
        )
    from cadence.models import load_tokenizer

    student = load_tokenizer(cfg.model.path)
    for path in d.paths:
        if not (Path(path) / "config.json").is_file():
            raise ConfigError(f"distill teacher {path!r} is not a model directory (no config.json)")
        differs = tokenizer_difference(student, load_tokenizer(path))
        if differs:
            raise ConfigError(
                f"distill teacher {path!r} does not share the student's tokenizer "
                f"({cfg.model.path!r}): {differs}. Its log-probs would score other tokens."
            )


def tokenizer_difference(a, b) -> str:
    """What differs between two tokenizers ('' when nothing): vocabulary, special tokens."""
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        only = sorted(set(va).symmetric_difference(vb))[:3]
        moved = sum(1 for t in set(va) & set(vb) if va[t] != vb[t])
        return (
            f"vocabularies differ ({len(va)} and {len(vb)} tokens, e.g. {only}, {moved} ids moved)"
        )
    for name in ("bos_token", "eos_token", "pad_token"):
        if getattr(a, name) != getattr(b, name):
            return f"{name} differs ({getattr(a, name)!r} and {getattr(b, name)!r})"
    return ""


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


def require_engine(kind: str) -> None:
    """An engine whose package is not installed (`rollout.engine = 'vllm'` without vLLM) is a
    config error naming the install."""
    extra = engine_kind(kind).extra
    if extra and not installed(extra):
        raise ConfigError(
            f"rollout.engine = '{kind}' needs the package '{extra}', which is not installed: "
            f"{INSTALL_HINT}"
        )


def installed(package: str) -> bool:
    """Whether `package` can be imported (without importing it)."""
    return importlib.util.find_spec(package) is not None


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


def check_sharded(ckpt: Checkpoint, ranks: int) -> None:
    """Refuse a checkpoint whose optimizer state the learner cannot read: sharded state (DCP)
    needs learner ranks, one process's state needs one process. Any N > 1 reads any N > 1."""
    written_by = ckpt.trainer["ranks"]  # every trainer's state says (learner.TRAINER_KEYS)
    if written_by > 1 and ranks == 1:
        raise CheckpointError(
            f"{ckpt.path} was written by {written_by} learner ranks (sharded optimizer "
            "state): resume it with --set learner.ranks=N, any N > 1"
        )
    if written_by == 1 and ranks > 1:
        raise CheckpointError(
            f"{ckpt.path} was written by a single-process learner: resume it with "
            "learner.ranks = 1 (its optimizer state is not sharded)"
        )


def check_trackers(cfg: Config) -> None:
    """A tracker asked for (`metrics.wandb`, `metrics.mlflow`) must be installed."""
    for tracker in ("wandb", "mlflow"):
        if getattr(cfg.metrics, tracker) and importlib.util.find_spec(tracker) is None:
            raise ConfigError(
                f"metrics.{tracker} = true needs {tracker}: pip install 'cadence[{tracker}]'"
            )


def require_ray() -> None:
    """`pipeline.backend = 'ray'` (or Ray learner ranks) without Ray installed."""
    if importlib.util.find_spec("ray") is None:
        raise ConfigError("pipeline.backend = 'ray' needs Ray: pip install 'cadence[ray]'")
