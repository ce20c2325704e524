"""Broken environments, each kind x each way of breaking: whatever an environment does (raises,
hangs, gives NaN, answers more than an episode holds, never ends), the episode it broke ends with
reward 0 and a `reward_error` naming the cause, or the policy reads the failure as a tool error
(counted), or the episode is cut off ("length": a reply too long, no end); the healthy group
beside it in the same rollout is scored as ever; nothing hangs.
verifiers' half is in test_verifiers_failures.py."""

import json
import math
import time
from pathlib import Path

import pytest

import fixtures_envs
import fixtures_tools
from cadence.engine import SamplingParams, ScriptedEngine, derive_seed, derive_turn_seed
from cadence.envs import Budget, ChatFormat, ClassEnv, OpenEnvEnv, ToolEnv, load_factory, load_tools
from cadence.envs.openenv import load_openenv
from cadence.metrics import sample_figures
from cadence.rollout import RolloutWorker
from cadence.types import Prompt

HERMES = (Path(__file__).parents[2] / "configs" / "chat-tools.jinja").read_text()
G, MAX_TURNS = 2, 3
DEADLINE_S = 1.0  # an environment's finish or step past this fails its episode


def _prompts(modes: list[str]) -> list[Prompt]:
    """Row i plays `modes[i]` (its metadata's `mode`, which `reset` reads)."""
    return [
        Prompt(
            f"rows:{i}",
            f"Task {mode}.\nAnswer: ",
            "#### 5",
            i,
            metadata={"mode": mode},
            messages=(("user", f"Task {mode}."),),
        )
        for i, mode in enumerate(modes)
    ]


def _rollout(tokenizer, env, modes: list[str], turn, reward=None, tool_timeout=False):
    """One rollout of a group per mode: turn(mode, t) is the text of turn t (EOS appended by
    `turn` where it wants one)."""
    table = {
        derive_turn_seed(derive_seed(5, 0, i, j), t): (mode, t)
        for i, mode in enumerate(modes)
        for j in range(G)
        for t in range(MAX_TURNS)
    }

    def script(ids, seed):
        return turn(*table[seed])

    engine = ScriptedEngine(
        script, logprob=-0.5, decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    )
    params = SamplingParams(max_new_tokens=64, stop_token_ids=(tokenizer.eos_token_id,))
    reward = reward or (lambda prompt, completion, answer: 0.5)
    worker = RolloutWorker(engine, tokenizer, reward, params, G, run_seed=5, env=env)
    worker.episodes.deadline_s = DEADLINE_S
    start = time.perf_counter()
    groups = worker.rollout(_prompts(modes), iteration=0, version=0)
    elapsed = time.perf_counter() - start
    worker.close()
    assert elapsed < 15  # never a hang
    return {g.prompt.metadata["mode"]: g for g in groups}


def _counted(groups, failed: list[str]) -> None:
    """The failed modes' samples score 0 with their error, counted by the error budget; every
    other sample is scored, finite."""
    for mode, group in groups.items():
        for c in group.completions:
            assert math.isfinite(c.reward)
            if mode in failed:
                assert c.reward == 0.0 and c.reward_error.startswith("environment: "), mode
            else:
                assert c.reward_error is None, (mode, c.reward_error)
    figures = sample_figures(list(groups.values()), version=0, max_staleness=0)
    assert figures["reward_errors"] == G * len(failed)  # what the run's error budget counts


def _tool_call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_a_broken_environment_class_fails_its_episodes_only(tokenizer):
    fixtures_envs.RELEASE.clear()
    eos = tokenizer.eos_token_id
    factory = load_factory("fixtures_envs:Broken")
    env = ClassEnv({None: factory}, ChatFormat(tokenizer, HERMES), Budget(MAX_TURNS, 400), 0.5)

    def turn(mode, t):  # look, then answer; 'never_done' looks on every turn
        text = _tool_call("look") if t == 0 or mode == "never_done" else "#### 5"
        return tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]

    modes = ["healthy", "raises", "nan", "huge", "hangs", "never_done"]
    try:
        groups = _rollout(tokenizer, env, modes, turn)
    finally:
        fixtures_envs.RELEASE.set()
    _counted(groups, ["raises", "nan", "hangs"])
    assert [c.reward for c in groups["healthy"].completions] == [1.0] * G
    errors = {m: groups[m].completions[0].reward_error for m in ("raises", "nan", "hangs")}
    assert "RuntimeError: the grader crashed" in errors["raises"]
    assert "returned nan" in errors["nan"]
    assert f"no answer within {DEADLINE_S:g} s" in errors["hangs"]
    for mode in ("never_done", "huge"):  # cut off at max_turns, or with no room left: truncated
        for c in groups[mode].completions:
            assert c.finish_reason == "length", mode
    assert {c.episode.turns for c in groups["never_done"].completions} == {MAX_TURNS}
    assert {c.episode.turns for c in groups["huge"].completions} == {1}
    assert {c.finish_reason for c in groups["healthy"].completions} == {"eos"}


def test_a_broken_openenv_environment_fails_its_episodes_only(tokenizer):
    pytest.importorskip("openenv")
    import fixtures_openenv

    fixtures_openenv.RELEASE.clear()
    eos = tokenizer.eos_token_id
    cls = load_openenv("fixtures_openenv:Broken")
    env = OpenEnvEnv(cls, ChatFormat(tokenizer, HERMES), Budget(MAX_TURNS, 200), timeout_s=0.5)

    def turn(mode, t):
        return tokenizer("my answer", add_special_tokens=False)["input_ids"] + [eos]

    modes = ["healthy", "raises", "nan", "huge", "hangs", "never_done"]
    try:
        groups = _rollout(tokenizer, env, modes, turn)
    finally:
        fixtures_openenv.RELEASE.set()
    _counted(groups, ["nan"])
    assert [c.reward for c in groups["healthy"].completions] == [1.0] * G
    assert {(c.finish_reason, c.episode.turns) for c in groups["huge"].completions} == {
        ("length", 1)
    }
    assert "non-finite reward nan" in groups["nan"].completions[0].reward_error
    for mode, counter in (("raises", "tool_errors"), ("hangs", "tool_timeouts")):
        for c in groups[mode].completions:  # the policy read the failure, every turn; counted
            assert getattr(c.episode, counter) == MAX_TURNS and c.finish_reason == "length"
    for c in groups["never_done"].completions:
        assert c.finish_reason == "length" and c.episode.turns == MAX_TURNS


def test_a_broken_tool_fails_its_episodes_only(tokenizer):
    fixtures_tools.RELEASE.clear()
    eos = tokenizer.eos_token_id
    tools = load_tools(["calculator", *(f"fixtures_tools:{n}" for n in ("boom", "hang", "huge"))])
    env = ToolEnv(tools, Budget(MAX_TURNS, 200), timeout_s=0.5)
    calls = {"raises": "boom", "hangs": "hang", "huge": "huge", "never_done": "calculator"}

    def turn(mode, t):
        if mode in calls and (t == 0 or mode == "never_done"):
            return tokenizer(f"<call>{calls[mode]}: 1 + 1</call>")["input_ids"]
        return tokenizer("\n#### 5", add_special_tokens=False)["input_ids"] + [eos]

    def reward(prompt, completion, answer):  # the run's reward function: NaN for one row
        return float("nan") if "Task nan" in prompt else 1.0

    modes = ["healthy", "raises", "nan", "huge", "hangs", "never_done"]
    try:
        groups = _rollout(tokenizer, env, modes, turn, reward=reward)
    finally:
        fixtures_tools.RELEASE.set()
    for c in groups["nan"].completions:  # the reward function's NaN: counted as its error
        assert c.reward == 0.0 and "nan" in c.reward_error.lower()
    assert {(c.finish_reason, c.episode.turns) for c in groups["huge"].completions} == {
        ("length", 1)
    }
    assert [c.episode.tool_errors for c in groups["raises"].completions] == [1] * G
    assert [c.episode.tool_timeouts for c in groups["hangs"].completions] == [1] * G
    for mode in ("healthy", "raises", "hangs"):
        assert [c.reward for c in groups[mode].completions] == [1.0] * G, mode
    for c in groups["never_done"].completions:
        assert c.finish_reason == "length" and c.episode.turns == MAX_TURNS


@pytest.mark.parametrize("max_turns", [1, 3])
def test_the_last_turn_max_turns_allows_is_graded_by_the_environment(tokenizer, max_turns):
    pytest.importorskip("openenv")
    eos = tokenizer.eos_token_id
    cls = load_openenv("fixtures_openenv:GuessNumber")
    env = OpenEnvEnv(cls, ChatFormat(tokenizer, HERMES), Budget(max_turns, 200), timeout_s=5.0)

    def turn(mode, t):  # wrong until the last turn allowed, then right (the row's answer is 5)
        guess = "5" if t == max_turns - 1 else "9"
        return tokenizer(guess, add_special_tokens=False)["input_ids"] + [eos]

    def reward(prompt, completion, answer):  # must not be asked: the environment graded it
        return -7.0

    groups = _rollout(tokenizer, env, ["any"], turn, reward=reward)
    for c in groups["any"].completions:
        assert c.reward == 1.0 and c.episode.turns == max_turns and c.finish_reason == "eos"
