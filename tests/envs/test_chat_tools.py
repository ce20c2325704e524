"""Tool calls in the model's chat format: the prompt shows the tools, calls parse the Hermes way,
replies are what the template itself writes after a call, and a template that cannot carry a
tool conversation is refused with the reason."""

from pathlib import Path

import pytest
from transformers.utils import get_json_schema

from cadence.envs import ChatFormat, ChatToolsError, MalformedToolCall, ToolCall, parse_calls

HERMES = (Path(__file__).parents[2] / "configs" / "chat-tools.jinja").read_text()


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def test_a_template_without_tool_support_is_refused_with_the_reason(tokenizer):
    with pytest.raises(ChatToolsError, match="ignores tools="):
        ChatFormat(tokenizer)  # the embedded model's own template knows no tools


def test_the_tokenizers_own_template_serves_when_it_renders_tools(tokenizer):
    tokenizer.chat_template = HERMES  # as an instruct model's tokenizer ships it
    chat = ChatFormat(tokenizer)
    assert chat.tool_reply([("add", "5")]) == ChatFormat(tokenizer, HERMES).tool_reply(
        [("add", "5")]
    )


def _variant(old: str, new: str) -> str:
    assert old in HERMES
    return HERMES.replace(old, new)


@pytest.mark.parametrize(
    "template, reason",
    [
        (_variant("eos_token", "''"), "ending with the EOS token"),
        (
            _variant(
                """'\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": '""",
                """'\\n{"name": "' + tool_call.name + '", "parameters": '""",
            ).replace("""'}\\n</tool_call>'""", "'}'"),
            "format other than Hermes'",
        ),
        (
            _variant("'\\n<tool_response>\\n' + message.content", "'\\n<tool_response>\\n'"),
            "drops an assistant's tool call or the tool's reply",
        ),
        (
            _variant("'<|assistant|>' }}", "'<|assistant|>' + ('' if loop.last else ' (was)') }}"),
            "not prefix-preserving",
        ),
    ],
)
def test_templates_that_cannot_carry_tool_calls_are_refused(tokenizer, template, reason):
    with pytest.raises(ChatToolsError, match=reason.replace("(", r"\(")):
        ChatFormat(tokenizer, template)


def test_prompt_call_and_reply_concatenate_to_the_templates_own_rendering(tokenizer):
    chat = ChatFormat(tokenizer, HERMES)
    tools = [get_json_schema(add)]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    prompt = chat.prompt(messages, tools)
    assert '"name": "add"' in prompt and prompt.endswith("<|assistant|>\n")
    assert prompt.startswith("<|system|>\nBe brief.")
    # what the policy writes, then EOS, then the environment's reply: exactly the template's
    # rendering of the whole conversation, up to the next assistant message's opening
    written = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    call = ToolCall("add", {"a": 2, "b": 3})
    assert parse_calls(written) == [call]
    reply = chat.tool_reply([("add", "5")])
    assert reply == "\n<|user|>\n<tool_response>\n5\n</tool_response><|endoftext|>\n<|assistant|>\n"
    whole = [
        *messages,
        {"role": "assistant", "content": "", "tool_calls": [call.message()]},
        {"role": "tool", "name": "add", "content": "5"},
    ]
    assert prompt + written + tokenizer.eos_token + reply == chat.render(
        whole, add_generation_prompt=True, tools=tools
    )
    two = chat.tool_reply([("add", "5"), ("add", "7")])
    assert two.count("<tool_response>") == 2 and two.count("<|user|>") == 1
    assert chat.user_reply("higher") == "\n<|user|>\nhigher<|endoftext|>\n<|assistant|>\n"


def test_calls_parse_the_hermes_way_and_malformed_ones_say_why():
    assert parse_calls("the answer is 5") == []
    turn = (
        'first <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> then '
        '<tool_call>\n{"name": "echo", "arguments": "{\\"text\\": \\"hi\\"}"}\n</tool_call>'
    )
    assert parse_calls(turn) == [
        ToolCall("add", {"a": 1, "b": 2}),
        ToolCall("echo", {"text": "hi"}),
    ]
    assert parse_calls('<tool_call>{"name": "noop"}</tool_call>') == [ToolCall("noop", {})]
    bad = {
        "<tool_call>{nope}</tool_call>": "not JSON",
        '<tool_call>{"arguments": {}}</tool_call>': "needs",
        '<tool_call>{"name": "add", "arguments": [1]}</tool_call>': "not a JSON object",
        '<tool_call>{"name": "add", "arguments": {}}': "not closed",
    }
    for text, why in bad.items():
        with pytest.raises(MalformedToolCall, match=why):
            parse_calls(text)
