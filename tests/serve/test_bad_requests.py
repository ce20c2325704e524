"""Bad requests to `cadence serve` get an answer of their own (400 with the reason, 401) and change
nothing for anyone else; /health says 503 only when the engine really serves no more; the event
loop answers while a prompt is being tokenised (issue 30)."""

import json
import threading

import httpx
import pytest

from cadence.engine import ScriptedEngine
from cadence.models import load_tokenizer
from cadence.serve import EngineLoop

PROMPT = "Question: What is 3 + 4?\nAnswer: "
AUTH = {"Authorization": "Bearer sesame"}
WAIT_S = 60


def _chat(url, body, headers=AUTH, **kwargs):
    return httpx.post(
        f"{url}/chat/completions", json=body, headers=headers, timeout=WAIT_S, **kwargs
    )


def _valid(**fields):
    return {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "seed": 1, **fields}


def _message(reply):
    return reply.json()["error"]["message"]


def test_a_token_id_out_of_range_is_refused_and_the_server_keeps_serving(served):
    """Issue 30: `prompt_token_ids` of 1,000,000 raised IndexError in the engine step, and every
    later request, valid ones included, failed with 'the engine failed'."""
    url, _, _ = served
    bad = _chat(url, _valid(prompt_token_ids=[5, 1_000_000]))
    assert bad.status_code == 400
    assert "prompt_token_ids[1] = 1000000 is not a token of this model" in _message(bad)
    after = _chat(url, _valid())
    assert after.status_code == 200 and after.json()["choices"][0]["token_ids"]
    assert httpx.get(f"{url[:-3]}/health", headers=AUTH).json() == {"status": "ok"}


def _many_ids(n):
    return {"prompt_token_ids": [5] * n}


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"prompt_token_ids": [-1]}, "prompt_token_ids[0] = -1 is not a token"),
        ({"prompt_token_ids": []}, "the prompt is empty"),
        ({"prompt_token_ids": [5, 1.5]}, "prompt_token_ids.1: Input should be a valid integer"),
        (
            {**_many_ids(1025), "max_tokens": 1},
            "exceeds the model's maximum context length of 1024",
        ),
        ({**_many_ids(1000), "max_tokens": 64}, "1000 tokens + max_tokens 64 = 1064 exceeds"),
        ({"messages": []}, "messages: at least one message"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text"),
        ({"n": 0}, "n: Input should be greater than or equal to 1"),
        ({"n": 65}, "n: Input should be less than or equal to 64"),
        ({"max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
        ({"max_completion_tokens": -3}, "max_completion_tokens: Input should be greater"),
        ({"temperature": -0.5}, "temperature: Input should be greater than or equal to 0"),
        ({"temperature": 1e-30}, "temperature: Value error, must be 0 (greedy) or at least 0.01"),
        ({"top_p": 0}, "top_p: Input should be greater than 0"),
        ({"top_p": 1.5}, "top_p: Input should be less than or equal to 1"),
        ({"seed": -1}, "seed: Input should be greater than or equal to 0"),
        ({"stop": ["x"] * 17}, "List should have at most 16 items"),
        ({"top_logprobs": 21}, "top_logprobs: Input should be less than or equal to 20"),
        ({"response_format": {"type": "json_object"}}, "response_format = {'type': 'json_obj"),
        ({"tool_choice": "required"}, "tool_choice = 'required' is not honoured"),
        ({"frequency_penalty": 0.5}, "frequency_penalty = 0.5 is not honoured"),
        ({"logit_bias": {"5": 10}}, "logit_bias = {'5': 10} is not honoured"),
        ({"reasoning_effort": "high"}, "reasoning_effort: not a field cadence serve honours"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools: this model's"),
    ],
)
def test_every_field_out_of_range_is_refused_with_400_and_the_reason(served, fields, reason):
    url, _, _ = served
    reply = _chat(url, _valid(**fields))
    assert reply.status_code == 400, reply.text
    assert reason in _message(reply)


def test_a_body_that_is_not_json_or_not_finite_is_400(served):
    url, _, _ = served
    valid = json.dumps(_valid())[:-1]
    for text, reason in [
        ("{not json", "JSON decode error"),
        ("[1, 2]", "Input should be a valid dictionary"),
        (valid + ', "temperature": NaN}', "temperature: Input should be a finite number"),
        (valid + ', "top_p": 1e400}', "top_p: Input should be a finite number"),
    ]:
        reply = httpx.post(
            f"{url}/chat/completions",
            content=text,
            headers={**AUTH, "content-type": "application/json"},
        )
        assert reply.status_code == 400, (text, reply.text)
        assert reason in _message(reply)


def test_a_body_over_the_limit_is_refused_with_400(served):
    url, _, _ = served
    big = _valid(messages=[{"role": "user", "content": "1 " * (3 << 20)}])  # 6 MiB
    reply = _chat(url, big)
    assert reply.status_code == 400
    assert "over the server's limit of 4194304" in _message(reply)

    def chunks(size=1 << 16):  # no Content-Length: refused once the chunks pass the limit
        data = json.dumps(big).encode()
        for i in range(0, len(data), size):
            yield data[i : i + size]

    reply = httpx.post(f"{url}/chat/completions", content=chunks(), headers=AUTH, timeout=WAIT_S)
    assert reply.status_code == 400 and "over the server's limit" in _message(reply)
    assert _chat(url, _valid()).status_code == 200


def test_a_chat_template_that_refuses_the_messages_is_400(model_dir, make_server, start_server):
    strict = load_tokenizer(model_dir)
    strict.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first turn must be the "
        "user') }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    with start_server(make_server(tokenizer=strict)) as url:
        reply = _chat(url, _valid(messages=[{"role": "assistant", "content": "hi"}]))
        assert reply.status_code == 400
        assert "chat template refused them: the first turn must be the user" in _message(reply)
        assert _chat(url, _valid()).status_code == 200


def test_a_non_ascii_authorization_header_is_401(served):
    """Issue 30: `hmac.compare_digest` on a non-ASCII str raised TypeError: a 500."""
    url, _, _ = served
    for header in ["Bearer sésame".encode(), b"Bearer \xff\xfe", "Bearer ☃".encode()]:
        reply = _chat(url, _valid(), headers={"Authorization": header})
        assert reply.status_code == 401, reply.text
        assert _message(reply) == "missing or wrong bearer token"
    assert _chat(url, _valid()).status_code == 200


def _always_fails(prompt_ids, seed):
    raise RuntimeError("CUDA error: an illegal memory access")


def test_health_answers_503_once_the_engine_is_broken(make_server, start_server):
    """Issue 30: after the engine failed for good, /health still said ok."""
    loop = EngineLoop(ScriptedEngine(_always_fails))  # no way to start a fresh engine
    with start_server(make_server(loop=loop)) as url:
        health = f"{url[:-3]}/health"
        assert httpx.get(health, headers=AUTH).status_code == 200
        reply = _chat(url, _valid())
        assert reply.status_code == 503
        assert "the engine failed and cannot be restarted" in _message(reply)
        broken = httpx.get(health, headers=AUTH)
        assert broken.status_code == 503
        assert broken.json()["status"] == "broken"
        assert "illegal memory access" in broken.json()["reason"]
        assert _chat(url, _valid()).status_code == 503  # at once: nothing waits for it


class BlockingTokenizer:
    """The tiny tokenizer, except that encoding waits until released (a long chat template)."""

    def __init__(self, inner):
        self.inner = inner
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, text, **kwargs):
        if text == "slow":
            self.entered.set()
            assert self.release.wait(WAIT_S)
        return self.inner(text, **kwargs)


def test_tokenising_does_not_block_the_event_loop(tiny, make_server, start_server):
    """Issue 30: the prompt was rendered and encoded on the event loop: while it ran, nothing
    else (health checks included) was answered."""
    tokenizer = BlockingTokenizer(tiny[0])
    with start_server(make_server(tokenizer=tokenizer)) as url:
        slow = {}
        body = _valid(messages=[{"role": "user", "content": "slow"}])
        thread = threading.Thread(target=lambda: slow.update(reply=_chat(url, body)))
        thread.start()
        try:
            assert tokenizer.entered.wait(WAIT_S)
            health = httpx.get(f"{url[:-3]}/health", headers=AUTH, timeout=10)
            assert health.status_code == 200  # answered while the prompt is still being encoded
            assert not slow
        finally:
            tokenizer.release.set()
            thread.join(WAIT_S)
        assert slow["reply"].status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "reason"),
    [
        # a lone surrogate: before, the tokenizer raised and the answer was 500
        ("/chat/completions", _valid(messages=[{"role": "user", "content": "\ud800"}]), "Unicode"),
        ("/tokenize", {"prompt": "2 + \ud800"}, "prompt: not valid Unicode"),
        # an empty stop string: before, accepted, and every completion stopped after one token
        ("/chat/completions", _valid(stop=[""]), "a stop string must not be empty"),
        ("/chat/completions", _valid(stop=""), "a stop string must not be empty"),
    ],
)
def test_unusable_text_is_refused_with_400_naming_the_field(served, path, body, reason):
    url, _, _ = served
    # json.dumps keeps a lone surrogate as the escape "\ud800", as a client sends it
    reply = httpx.post(
        f"{url}{path}" if path.startswith("/chat") else f"{url[:-3]}{path}",
        content=json.dumps(body),
        headers=AUTH | {"content-type": "application/json"},
        timeout=WAIT_S,
    )
    assert reply.status_code == 400, reply.text
    assert reason in _message(reply)
    assert _chat(url, _valid()).status_code == 200


def test_an_empty_stop_string_in_a_config_is_refused():
    from cadence.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="empty stop string"):
        load_config(None, ["rollout.stop=['']"])
