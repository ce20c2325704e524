"""Environment classes and OpenEnv environments through a whole run: the shipped configs train two
iterations on the tiny model with finite figures, an environment's own reward reaches the
learner, and what cannot run stops the command with exit code 2 and the reason."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cadence.builder import build_run, train
from cadence.cli import main
from cadence.config import ConfigError, load_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
SMALL = [
    "train.iterations=2",
    "train.prompts_per_iteration=2",
    "train.micro_batch_groups=2",
    "train.eval_every=1",
    "rollout.group_size=2",
    "data.num_heldout=4",
    "train.checkpoint_every=0",
    "metrics.progress=false",
]


def _sets(*overrides: str) -> list[str]:
    return [x for kv in overrides for x in ("--set", kv)]


def _lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _finite(record: dict) -> bool:
    return all(math.isfinite(v) for v in record.values() if isinstance(v, int | float))


def _template() -> str:
    return f"data.chat_template='{ROOT / 'configs' / 'chat-tools.jinja'}'"


def test_the_env_class_config_trains_two_iterations(model_dir, tmp_path):
    out = tmp_path / "run"
    config = str(ROOT / "configs" / "env-class.toml")
    sets = _sets(f"model.path='{model_dir}'", _template(), "rollout.max_new_tokens=12", *SMALL)
    assert main(["train", config, "--out", str(out), *sets]) == 0
    lines = _lines(out)
    assert [r["iteration"] for r in lines] == [0, 1]
    assert all(_finite(r) for r in lines)
    assert all(r["turns_mean"] >= 1 and r["tool_errors"] >= 0 for r in lines)
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["accuracy_after"] <= 1.0


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_an_environment_classes_own_reward_is_what_the_learner_gets(model_dir, tmp_path, placement):
    workers = ["pipeline.placement='separate'", "pipeline.num_workers=1"]
    cfg = load_config(
        None,
        [
            *(workers if placement == "separate" else []),  # the class loads in a worker process
            f"model.path='{model_dir}'",
            _template(),
            "env.kind='class'",
            "env.factory='fixtures_envs:Constant'",  # get_reward() is 1, whatever was written
            "env.max_total_tokens=24",
            "rollout.max_new_tokens=12",
            *SMALL,
        ],
    )
    summary = train(build_run(cfg), tmp_path)
    lines = _lines(tmp_path)
    assert [r["reward_mean"] for r in lines] == [1.0, 1.0] and _finite(summary)
    # held out too: the math reward would give a random model's answers 0
    assert summary["accuracy_before"] == summary["accuracy_after"] == 1.0


def test_the_openenv_config_trains_two_iterations_of_multi_turn_episodes(
    model_dir, tokenizer, tmp_path, monkeypatch
):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    out = tmp_path / "run"
    config = str(ROOT / "configs" / "openenv.toml")
    # a random model seldom writes EOS: a quarter of its vocabulary ends a turn here, so that
    # turns reach the environment and episodes run past one turn
    stops = list(range(0, len(tokenizer), 4))
    sets = _sets(
        f"model.path='{model_dir}'", _template(), f"rollout.stop_token_ids={stops}", *SMALL
    )
    assert main(["train", config, "--out", str(out), *sets]) == 0
    lines = _lines(out)
    assert [r["iteration"] for r in lines] == [0, 1]
    assert all(_finite(r) for r in lines)
    assert max(r["turns_mean"] for r in lines) > 1.0  # the environment answered, the policy went on
    assert min(r["env_token_frac"] for r in lines) > 0.0
    assert sum(r["tool_calls"] for r in lines) > 0  # each step counts as a call
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in lines)


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (["env.factory='fixtures_envs:NoTools'"], "has no tools"),
        (["env.factory='fixtures_envs:NoArgsDoc'"], "tool 'add' has no JSON schema"),
        (["env.factory='fixtures_envs:not_a_class'"], "not a class"),
        (["env.factory='not_a_module:Env'"], "cannot import module 'not_a_module'"),
        (["data.chat_template=true"], "the model's tokenizer has none: the chat template ignores"),
    ],
)
def test_what_cannot_run_exits_2_before_training_with_the_reason(
    model_dir, tmp_path, capsys, overrides, reason
):
    config = str(ROOT / "configs" / "env-class.toml")
    sets = _sets(f"model.path='{model_dir}'", _template(), *SMALL, *overrides)
    assert main(["train", config, "--out", str(tmp_path / "run"), *sets]) == 2
    assert reason in capsys.readouterr().err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_chat_environments_need_a_chat_template():
    with pytest.raises(ConfigError, match=r"set data\.chat_template"):
        load_config(None, ["env.kind='openenv'", "env.factory='a:B'"])
