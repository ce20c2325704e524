"""`cadence serve` speaks what the `openai` SDK sends (issue 41, item 10): `top_logprobs`,
`stream = true` for chat and completions, `tools` rendered by the model's template with
`tool_calls` parsed back, `/v1/completions` with token ids and log-probs; driven by the SDK
itself on loopback."""

import json
import math
from pathlib import Path

import openai
import pytest

from cadence.engine import ScriptedEngine
from cadence.models import load_tokenizer
from cadence.serve import EngineLoop

PROMPT = "Question: What is 3 + 4?\nAnswer: "
TOOLS_TEMPLATE = Path(__file__).parents[2] / "configs" / "chat-tools.jinja"
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },
    },
}


def _client(url):
    return openai.OpenAI(base_url=url, api_key="sesame", max_retries=0, timeout=60)


def _ask(url, **kw):
    body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8}
    return _client(url).chat.completions.create(**(body | kw))


def test_top_logprobs_are_the_likeliest_tokens_under_the_sampling_distribution(served):
    url, _, _ = served
    greedy = _ask(url, temperature=0, top_logprobs=5, logprobs=True, seed=1)
    (choice,) = greedy.choices
    for token, token_id in zip(choice.logprobs.content, choice.token_ids, strict=True):
        top = token.top_logprobs
        assert len(top) == 5
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        # greedy decoding took the likeliest token: the first alternative is the sampled one
        assert top[0].model_extra["token_id"] == token_id and top[0].token == token.token
        assert abs(top[0].logprob - token.logprob) <= 1e-4
    sampled = _ask(url, temperature=0.05, top_logprobs=20, logprobs=True, seed=5, n=2)
    found = 0
    for choice in sampled.choices:
        for token, token_id in zip(choice.logprobs.content, choice.token_ids, strict=True):
            top = token.top_logprobs
            assert len(top) == 20 and sum(math.exp(t.logprob) for t in top) <= 1 + 1e-5
            same = [t for t in top if t.model_extra["token_id"] == token_id]
            if same:  # the engine's log-prob of the sampled token (temperature applied)
                found += 1
                assert abs(same[0].logprob - token.logprob) <= 1e-4
            else:
                assert token.logprob <= top[-1].logprob + 1e-4
    assert found >= 12  # of 16: at T = 0.05 the sampled token is nearly always the likeliest
    plain = _ask(url, temperature=0, seed=1)
    assert plain.choices[0].logprobs.content[0].top_logprobs == []
    assert plain.choices[0].token_ids == greedy.choices[0].token_ids


def test_a_streamed_chat_answer_is_the_unstreamed_one_in_chunks(served):
    url, _, _ = served
    whole = _ask(url, seed=11, n=2, max_tokens=12)
    usage = {"include_usage": True}
    chunks = list(
        _ask(url, seed=11, n=2, max_tokens=12, stream=True, stream_options=usage, logprobs=True)
    )
    plain = list(_ask(url, seed=11, n=2, max_tokens=12, stream=True))
    assert not any(c.choices[0].logprobs for c in plain if c.choices)  # not asked: none
    assert [c.choices[0].delta for c in plain] == [c.choices[0].delta for c in chunks[:-1]]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    for j, choice in enumerate(whole.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == j]
        assert mine[0].delta.role == "assistant"
        assert "".join(m.delta.content or "" for m in mine) == choice.message.content
        ids = [i for m in mine for i in (m.model_extra or {}).get("token_ids", [])]
        assert ids == choice.token_ids
        logprobs = [t.logprob for m in mine if m.logprobs for t in m.logprobs.content]
        assert logprobs == [t.logprob for t in choice.logprobs.content]
        assert [m.finish_reason for m in mine if m.finish_reason] == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == (
        whole.usage.completion_tokens
    )


def test_completions_take_text_or_ids_and_answer_tokens_logprobs_and_chunks(served):
    url, tokenizer, _ = served
    client = _client(url)
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    by_text = client.completions.create(model="m", prompt=PROMPT, max_tokens=10, seed=3, logprobs=2)
    by_ids = client.completions.create(model="m", prompt=ids, max_tokens=10, seed=3)
    chat = _ask(url, seed=3, max_tokens=10)  # the tiny model has no chat template: same prompt
    (choice,) = by_text.choices
    assert by_text.object == "text_completion" and by_text.model_extra["prompt_token_ids"] == ids
    assert choice.model_extra["token_ids"] == by_ids.choices[0].model_extra["token_ids"]
    assert choice.model_extra["token_ids"] == chat.choices[0].token_ids
    assert choice.text == chat.choices[0].message.content == by_ids.choices[0].text
    lp = choice.logprobs
    assert lp.token_logprobs == [t.logprob for t in chat.choices[0].logprobs.content]
    assert len(lp.tokens) == len(lp.top_logprobs) == len(choice.model_extra["token_ids"])
    assert all(len(top) <= 2 for top in lp.top_logprobs)  # two tokens may decode alike
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert by_ids.choices[0].logprobs.top_logprobs is None  # not asked
    assert by_text.usage.prompt_tokens == len(ids)
    streamed = list(
        client.completions.create(model="m", prompt=PROMPT, max_tokens=10, seed=3, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert streamed[-1].choices[0].finish_reason == choice.finish_reason
    with pytest.raises(openai.BadRequestError, match="2 prompts in one request"):
        client.completions.create(model="m", prompt=["a", "b"], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="echo = True is not honoured"):
        client.completions.create(model="m", prompt="a", max_tokens=4, echo=True)
    with pytest.raises(openai.BadRequestError, match="exceeds the model's maximum context"):
        client.completions.create(model="m", prompt=[5] * 1020, max_tokens=10)


@pytest.fixture(scope="module")
def with_tools(model_dir):
    """A tokenizer whose template renders tools the Hermes way, and the text of a call to `add`."""
    tokenizer = load_tokenizer(model_dir)
    tokenizer.chat_template = TOOLS_TEMPLATE.read_text()
    # 63 tokens of the tiny model's tokenizer + EOS: the tests' server answers 64 at most
    call = 'Sum:<tool_call>{"name":"add","arguments":{"a":3,"b":4}}</tool_call>'
    return tokenizer, call


def _calling(tokenizer, call):
    """An engine that answers every prompt with `call`, then EOS."""
    ids = tokenizer(call, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    decode = lambda t: tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
    return EngineLoop(ScriptedEngine(lambda prompt, seed: ids, decode=decode))


def test_tools_reach_the_template_and_calls_come_back_as_tool_calls(
    with_tools, make_server, start_server
):
    tokenizer, call = with_tools
    server = make_server(loop=_calling(tokenizer, call), tokenizer=tokenizer)
    with start_server(server) as url:
        messages = [{"role": "user", "content": "What is 3 + 4?"}]
        got = _ask(url, messages=messages, tools=[ADD], max_tokens=64)
        (choice,) = got.choices
        assert '"name": "add"' in tokenizer.decode(got.prompt_token_ids)  # the schema is shown
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Sum:"
        (tool_call,) = choice.message.tool_calls
        assert tool_call.type == "function" and tool_call.function.name == "add"
        assert json.loads(tool_call.function.arguments) == {"a": 3, "b": 4}
        # the conversation goes on as an agent harness sends it: the call, then its result
        follow = [
            *messages,
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": tool_call.id, "name": "add", "content": "7"},
        ]
        again = _ask(url, messages=follow, tools=[ADD], max_tokens=64)
        prompt = tokenizer.decode(again.prompt_token_ids)
        assert "<tool_response>\n7\n</tool_response>" in prompt and '"a": 3' in prompt
        # streamed, the SDK's chunks carry the call
        chunks = list(_ask(url, messages=messages, tools=[ADD], max_tokens=64, stream=True))
        calls = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("add", {"a": 3, "b": 4})
        ]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # tool_choice "none": no tools shown, the call stays text
        none = _ask(url, messages=messages, tools=[ADD], tool_choice="none", max_tokens=64)
        assert none.choices[0].message.tool_calls is None
        assert none.choices[0].message.content == call
        assert '"name": "add"' not in tokenizer.decode(none.prompt_token_ids)


def test_a_template_that_cannot_carry_tools_is_400_naming_it(model_dir, make_server, start_server):
    tokenizer = load_tokenizer(model_dir)  # the tiny model's own template: no tools in it
    assert tokenizer.chat_template
    with start_server(make_server(tokenizer=tokenizer)) as url:
        with pytest.raises(openai.BadRequestError, match="chat template cannot take them"):
            _ask(url, tools=[ADD])
        assert _ask(url).choices[0].token_ids  # without tools it serves
