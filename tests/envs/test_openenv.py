"""OpenEnv environments in-process: a text environment gets the policy's turn as its action and
answers as the user, an MCP environment's tools are called in the chat format, rewards add up
over an episode, and a class OpenEnv cannot run is refused with the reason. No server, no
network: openenv-core's own base classes, in this process."""

import json
from pathlib import Path

import pytest

from cadence.builder import env_spec
from cadence.config import ConfigError, load_config
from cadence.data.base import stable_seed
from cadence.envs import (
    Budget,
    ChatFormat,
    ChatToolsError,
    EnvSpec,
    FactoryError,
    OpenEnvEnv,
    load_openenv,
    make_env,
)
from cadence.envs import observation_text as text_of
from cadence.types import Prompt

HERMES = (Path(__file__).parents[2] / "configs" / "chat-tools.jinja").read_text()
QUESTION = (("user", "What is 2 + 3?"),)


def _prompt(uid="rows:0") -> Prompt:
    return Prompt(uid, "rendered elsewhere", "2 + 3 = 5\n#### 5", 0, messages=QUESTION)


def _env(tokenizer, name: str) -> OpenEnvEnv:
    cls = load_openenv(f"fixtures_openenv:{name}")
    return OpenEnvEnv(cls, ChatFormat(tokenizer, HERMES), Budget(6, 400), timeout_s=5.0)


def _call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.mark.parametrize(
    "spec, reason",
    [
        ("fixtures_openenv:NotAnEnvironment", "not an OpenEnv environment"),
        ("fixtures_openenv:NotText", r"fields \['x', 'y'\].*exactly one"),
        ("openenv.core.env_server:Environment", "is abstract"),
        ("no_such_module:Env", "cannot import module"),
    ],
)
def test_a_class_openenv_cannot_run_is_refused_with_the_reason(spec, reason):
    with pytest.raises(FactoryError, match=reason):
        load_openenv(spec)


def test_a_bad_openenv_factory_is_a_config_error(model_dir):
    cfg = load_config(
        None,
        [
            f"model.path='{model_dir}'",
            "data.chat_template='configs/chat-tools.jinja'",
            "env.kind='openenv'",
            "env.factory='fixtures_openenv:NotAnEnvironment'",
        ],
    )
    with pytest.raises(ConfigError, match=r"config key 'env\.factory'.*not an OpenEnv"):
        env_spec(cfg)


def test_a_text_environment_takes_the_turn_as_its_action_and_answers_as_the_user(tokenizer):
    env = _env(tokenizer, "GuessNumber")
    episode = env.start(_prompt())
    assert episode.prompt_text == env.chat.prompt(
        [{"role": "user", "content": "What is 2 + 3? Guess the number."}], None
    )  # reset's observation ends the question; a text environment shows no tools
    assert episode.instance.seeds == [stable_seed("rows:0") % 2**31]  # the row's, not a sample's
    higher = episode.step("I think 3")
    assert higher.text == env.chat.user_reply("higher") and higher.tool_calls == 1
    assert not episode.step("no idea").done  # reward -0.1
    assert episode.step("5").done
    assert episode.finish() == pytest.approx(0.9)  # the sum of the step rewards
    again = env.start(_prompt())
    assert (
        again.instance is episode.instance and again.instance.seeds[-1] == again.instance.seeds[0]
    )
    assert again.finish() is None  # no observation carried a reward


def test_an_mcp_environment_is_called_in_the_chat_format(tokenizer):
    env = _env(tokenizer, "Sums")
    assert [s["function"]["name"] for s in env.schemas] == ["add", "submit"]
    episode = env.start(_prompt())
    assert '"name": "submit"' in episode.prompt_text
    reply = episode.step("First, " + _call("add", a=2, b=3))
    assert reply.text == env.chat.tool_reply([("add", "5")]) and not reply.done
    assert (reply.tool_calls, reply.tool_errors, len(reply.spans)) == (1, 0, 1)
    unknown = episode.step(_call("multiply", a=2, b=3))
    assert unknown.tool_errors == 1 and "Tool multiply not found." in unknown.text
    assert episode.step(_call("submit", answer=5)).done
    assert episode.finish() == 1.0
    quiet = env.start(_prompt())
    assert quiet.step("It is 5.").done and quiet.finish() is None  # the run's reward decides


CHATML = (  # SmolLM2's kind of template: ChatML that ignores tools=
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_text_environment_needs_no_template_that_renders_tools(tokenizer):
    """A text environment's replies are user messages: a chat template without tools carries
    them (SmolLM2's); an MCP environment, whose tools the prompt must show, is refused."""
    tok = tokenizer  # the fixture's own: a fresh one per test
    tok.eos_token = "<|im_end|>"  # the template's end of a turn
    text = make_env(
        EnvSpec("openenv", factory="fixtures_openenv:GuessNumber", chat_template=CHATML), tok
    )
    episode = text.start(_prompt())
    assert episode.prompt_text.endswith("Guess the number.<|im_end|>\n<|im_start|>assistant\n")
    assert episode.step("3").text == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ChatToolsError, match="ignores tools="):
        make_env(EnvSpec("openenv", factory="fixtures_openenv:Sums", chat_template=CHATML), tok)


def test_an_observation_reads_as_its_one_field_or_a_json_object():
    import fixtures_openenv

    one = fixtures_openenv.GuessObservation(feedback="lower", reward=0.0)
    assert text_of(one) == "lower"
    two = fixtures_openenv.TwoFields(x="a", y="b")  # any pydantic record of fields
    assert json.loads(text_of(two)) == {"x": "a", "y": "b"}
