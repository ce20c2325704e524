"""The plain renderer verifiers uses for a model without a chat template: messages tokenised one
by one and concatenated, tool calls and results in cadence's call syntax, completions parsed
back into tool calls, and each next turn bridged onto the sampled tokens unchanged."""

import json

import pytest

from cadence.models import load_tokenizer

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "arithmetic",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


@pytest.fixture(scope="module")
def renderer(model_dir):
    from cadence.envs.verifiers.render import PlainRenderer

    return PlainRenderer(load_tokenizer(model_dir))


def _ids(renderer, text):
    return renderer.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_messages_are_their_texts_tokenised_one_by_one(renderer):
    messages = [
        {"role": "system", "content": "Add."},
        {"role": "user", "content": "Question: 3 + 4?\nAnswer: "},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c0", "function": {"name": "calculator", "arguments": '{"e": "3 + 4"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c0", "content": "7"},
    ]
    out = renderer.render(messages, tools=[CALC], add_generation_prompt=True)
    pieces = [
        "Add.",
        "Question: 3 + 4?\nAnswer: ",
        "<call>calculator: 3 + 4</call>",
        "<result>7</result>",
    ]
    assert out.token_ids == [t for p in pieces for t in _ids(renderer, p)]
    sizes = [len(_ids(renderer, p)) for p in pieces]
    assert out.message_indices == [i for i, n in enumerate(sizes) for _ in range(n)]
    assert out.sampled_mask == [i == 2 for i, n in enumerate(sizes) for _ in range(n)]
    assert renderer.get_stop_token_ids() == [renderer.tokenizer.eos_token_id]


def test_a_completion_with_a_call_is_a_tool_call_filling_the_first_parameter(renderer):
    from renderers.base import ToolCallParseStatus

    eos = renderer.tokenizer.eos_token_id
    plain = renderer.parse_response([*_ids(renderer, "#### 7"), eos], tools=[CALC])
    assert plain.content == "#### 7" and plain.tool_calls == []
    text = "so <call>calculator: 12 * 3</call>"
    parsed = renderer.parse_response(_ids(renderer, text), tools=[CALC])
    assert parsed.content == "so "
    (call,) = parsed.tool_calls
    assert call.status == ToolCallParseStatus.OK
    assert (call.name, call.arguments) == ("calculator", {"expression": "12 * 3"})
    # the call round-trips through the renderer's own rendering of it
    wire = {"function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
    again = renderer.render([{"role": "assistant", "content": "so ", "tool_calls": [wire]}])
    assert again.token_ids == _ids(renderer, "so ") + _ids(renderer, text[3:])


@pytest.mark.parametrize(
    ("text", "status"),
    [
        ("<call>search: cats</call>", "UNKNOWN_TOOL"),
        ("<call>calculator 1 + 1</call>", "MALFORMED_STRUCTURE"),
        ("<call>calculator: 1 +", "UNCLOSED_BLOCK"),
    ],
)
def test_a_call_that_cannot_run_is_reported_not_raised(renderer, text, status):
    from renderers.base import ToolCallParseStatus

    (call,) = renderer.parse_response(_ids(renderer, text), tools=[CALC]).tool_calls
    assert call.status == ToolCallParseStatus[status] and call.raw == text


def test_the_next_turn_extends_the_sampled_tokens_unchanged(renderer):
    prompt, completion = _ids(renderer, "Question: 3 + 4?\nAnswer: "), [5, 9, 2, 7]
    reply = [{"role": "tool", "tool_call_id": "c0", "content": "7"}]
    bridged = renderer.bridge_to_next_turn(prompt, completion, reply, tools=[CALC])
    assert bridged.token_ids == prompt + completion + _ids(renderer, "<result>7</result>")
    assert not any(bridged.sampled_mask)
    assert bridged.message_indices[: len(prompt) + 4] == [-1] * (len(prompt) + 4)
    assert renderer.is_prefix_stable
    # an assistant message would re-tokenise sampled text: the bridge refuses it
    again = [{"role": "assistant", "content": "hi"}]
    assert renderer.bridge_to_next_turn(prompt, completion, again) is None
