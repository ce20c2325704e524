"""Environment classes on TRL's contract: what makes a class one (and the reason when it is not),
the row `reset` gets, tools called on the episode's own instance with replies in the tool role,
get_reward, instances reused, a mix picked by the row's `environment`, and the calculator."""

import time
from pathlib import Path

import pytest
from transformers.utils import get_json_schema

import fixtures_envs
from cadence.builder import env_spec
from cadence.config import ConfigError, load_config
from cadence.envs import (
    Budget,
    Calculator,
    ChatFormat,
    ClassEnv,
    FactoryError,
    load_factory,
    reset_row,
)
from cadence.types import Prompt

HERMES = (Path(__file__).parents[2] / "configs" / "chat-tools.jinja").read_text()
QUESTION = (("system", "Use the tools."), ("user", "What is 2 + 3?"))


def _prompt(metadata=None, uid="rows:0") -> Prompt:
    return Prompt(
        uid, "rendered elsewhere", "2 + 3 = 5\n#### 5", 0, metadata=metadata, messages=QUESTION
    )


def _one(tokenizer, spec: str, timeout_s=5.0) -> ClassEnv:
    return ClassEnv(
        {None: load_factory(spec)}, ChatFormat(tokenizer, HERMES), Budget(4, 200), timeout_s
    )


def _call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.mark.parametrize(
    "spec, reason",
    [
        ("fixtures_envs.Adder", "must be 'package.module:Class'"),
        ("no_such_module:Env", "cannot import module 'no_such_module'"),
        ("fixtures_envs:Missing", "has no 'Missing'"),
        ("fixtures_envs:not_a_class", "is a function, not a class"),
        ("fixtures_envs:NoReset", "has no reset"),
        ("fixtures_envs:NoTools", "has no tools"),
        ("fixtures_envs:NoHints", "tool 'add' has no JSON schema.*missing a type hint"),
        (
            "fixtures_envs:NoArgsDoc",
            "tool 'add' has no JSON schema.*no description for the argument",
        ),
    ],
)
def test_a_class_off_the_contract_is_refused_with_the_reason(spec, reason):
    with pytest.raises(FactoryError, match=reason):
        load_factory(spec)


def test_bad_factories_are_config_errors_before_any_worker_starts(model_dir):
    base = [f"model.path='{model_dir}'", "data.chat_template='configs/chat-tools.jinja'"]
    for key, value, reason in [
        ("env.factory", "'fixtures_envs:NoTools'", "config key 'env.factory'.*has no tools"),
        ("env.factories", "{ a = 'fixtures_envs:NoHints' }", "'env.factories'.*env.factories.a"),
    ]:
        cfg = load_config(None, [*base, "env.kind='class'", f"{key}={value}"])
        with pytest.raises(ConfigError, match=reason):
            env_spec(cfg)


def test_public_methods_are_the_tools_with_transformers_schemas():
    adder = load_factory("fixtures_envs:Adder")
    assert adder.tools == ("add", "hang") and adder.has_reward
    assert adder.schemas[0] == get_json_schema(fixtures_envs.Adder.add)
    assert adder.schemas[0]["function"]["parameters"]["required"] == ["a", "b"]
    echo = load_factory("fixtures_envs:Echo")
    assert echo.tools == ("echo",) and not echo.has_reward
    assert load_factory("cadence.envs.calculator:Calculator").tools == ("calculator",)


def test_reset_gets_the_row_and_its_text_ends_the_prompts_last_message(tokenizer):
    env = _one(tokenizer, "fixtures_envs:Adder")
    fixtures_envs.Adder.resets.clear()
    episode = env.start(_prompt({"hint": " (call add)", "level": 3, "answer": "5"}))
    (row,) = fixtures_envs.Adder.resets
    conversation = [{"role": r, "content": c} for r, c in QUESTION]
    assert row == {"prompt": conversation, "answer": "5", "hint": " (call add)", "level": 3}
    assert row == reset_row(_prompt({"hint": " (call add)", "level": 3, "answer": "5"}))
    assert "What is 2 + 3? (call add)<|endoftext|>\n<|assistant|>\n" in episode.prompt_text
    assert '"name": "add"' in episode.prompt_text and '"name": "hang"' in episode.prompt_text
    # without a hint, reset returns None and the prompt is the row's conversation with the tools
    quiet = env.start(_prompt())
    assert quiet.prompt_text == env.chat.prompt(conversation, list(env.factories[None].schemas))


def test_tools_run_on_the_episodes_instance_and_reply_in_the_tool_role(tokenizer):
    env = _one(tokenizer, "fixtures_envs:Adder")
    episode = env.start(_prompt())
    reply = episode.step("Let me add. " + _call("add", a=2, b=3))
    assert reply.text == env.chat.tool_reply([("add", "5")]) and not reply.done
    assert (reply.tool_calls, reply.tool_errors, len(reply.spans)) == (1, 0, 1)
    assert episode.instance.last == 5
    both = episode.step(_call("add", a=1, b=1) + _call("nope") + _call("add", a=1))
    assert both.text == env.chat.tool_reply(
        [
            ("add", "2"),
            ("nope", "{'error': 'Tool nope not found.'}"),
            (
                "add",
                "{'error': \"TypeError: Adder.add() missing 1 required positional argument: 'b'\"}",
            ),
        ]
    )
    assert (both.tool_calls, both.tool_errors) == (3, 2)
    malformed = episode.step("<tool_call>{oops</tool_call>")
    assert (malformed.tool_calls, malformed.tool_errors) == (1, 1) and "not JSON" in malformed.text
    assert episode.step("The answer is 2.").done  # a turn without a call is the final answer
    assert episode.finish() == 0.0  # get_reward: the last sum (2) is not the answer (5)
    right = env.start(_prompt())
    right.step(_call("add", a=2, b=3))
    assert right.finish() == 1.0


def test_an_episode_without_get_reward_leaves_the_reward_to_the_run(tokenizer):
    episode = _one(tokenizer, "fixtures_envs:Echo").start(_prompt())
    assert "echo hi" in episode.step(_call("echo", text="hi")).text
    assert episode.finish() is None
    wordy = _one(tokenizer, "fixtures_envs:WordyReward").start(_prompt())
    with pytest.raises(ValueError, match="returned str, not a number"):
        wordy.finish()


def test_async_tools_and_rewards_are_awaited(tokenizer):
    episode = _one(tokenizer, "fixtures_envs:Slow").start(_prompt())
    reply = episode.step(_call("double", x=4) + _call("double", x=5))
    assert reply.text == episode.env.chat.tool_reply([("double", "8"), ("double", "10")])
    assert episode.finish() == 2.0


def test_instances_are_reused_but_one_a_call_hung_in_is_dropped(tokenizer):
    fixtures_envs.RELEASE.clear()
    env = _one(tokenizer, "fixtures_envs:Adder", timeout_s=0.2)
    first = env.start(_prompt())
    first.finish()
    second = env.start(_prompt())
    assert second.instance is first.instance  # construct once, reset often
    start = time.monotonic()
    reply = second.step(_call("hang"))
    assert time.monotonic() - start < 5
    assert (reply.tool_errors, reply.tool_timeouts) == (
        1,
        1,
    ) and "timed out after 0.2s" in reply.text
    second.finish()
    assert env.start(_prompt()).instance is not first.instance  # the hung call may still use it
    fixtures_envs.RELEASE.set()


def test_rows_pick_their_class_by_environment_and_see_its_tools_only(tokenizer):
    chat = ChatFormat(tokenizer, HERMES)
    factories = {
        "adder": load_factory("fixtures_envs:Adder"),
        "echo": load_factory("fixtures_envs:Echo"),
    }
    env = ClassEnv(factories, chat, Budget(4, 200))
    fixtures_envs.Adder.resets.clear()
    echo = env.start(_prompt({"environment": "echo", "answer": "5"}))
    assert '"name": "echo"' in echo.prompt_text and '"name": "add"' not in echo.prompt_text
    adder = env.start(_prompt({"environment": "adder", "answer": "5"}))
    assert '"name": "add"' in adder.prompt_text and '"name": "echo"' not in adder.prompt_text
    assert "environment" not in fixtures_envs.Adder.resets[-1]  # a control field, as in TRL
    assert "{'error': 'Tool add not found.'}" in echo.step(_call("add", a=1, b=2)).text
    with pytest.raises(ValueError, match=r"environment = 'chess', not one of env\.factories"):
        env.start(_prompt({"environment": "chess"}))


def test_the_calculator_is_an_environment_class(tokenizer):
    episode = _one(tokenizer, "cadence.envs.calculator:Calculator").start(_prompt())
    assert episode.step(
        _call("calculator", expression="123 + 456")
    ).text == episode.env.chat.tool_reply([("calculator", "579")])
    refused = episode.step(_call("calculator", expression="__import__('os')"))
    assert refused.tool_errors == 1 and "CalculatorError" in refused.text
    assert Calculator().calculator("7 / 2") == "3.5" and episode.finish() is None
