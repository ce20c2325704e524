"""`cadence serve` on loopback, driven by the `openai` client: the engine's tokens for the
request's seed, with token ids and log-probs; a token when one is set; bad requests refused."""

import threading

import openai
import pytest

from cadence.engine import ContinuousEngine, Request, SamplingParams
from cadence.models import load_tokenizer
from cadence.serve import check_binding
from cadence.serve.chat import ChatMessage, ChatRequest, render

PROMPT = "Question: What is 3 + 4?\nAnswer: "


def _client(url, key="sesame"):
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)


def test_chat_completion_has_the_engines_tokens_for_the_seed(served):
    url, tokenizer, model = served
    got = _client(url).chat.completions.create(
        model="test-model",
        messages=[{"role": "user", "content": PROMPT}],
        seed=7,
        n=2,
        max_tokens=12,
        temperature=1.0,
        logprobs=True,
    )
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_new_tokens=12, stop_token_ids=(tokenizer.eos_token_id,))
    engine = ContinuousEngine(model, tokenizer, max_num_seqs=8)
    (want,) = engine.generate([Request(prompt_ids, [7, 8])], params)  # choice j: seed + j
    assert got.prompt_token_ids == prompt_ids
    assert got.object == "chat.completion" and len(got.choices) == 2
    for choice, c in zip(got.choices, want, strict=True):
        assert choice.token_ids == c.token_ids
        assert choice.message.content == c.text and choice.message.role == "assistant"
        logprobs = [t.logprob for t in choice.logprobs.content]
        assert max(abs(a - b) for a, b in zip(logprobs, c.logprobs, strict=True)) <= 1e-5
        assert "".join(t.token for t in choice.logprobs.content).startswith(c.text[:1])
        assert choice.finish_reason == ("length" if c.finish_reason == "length" else "stop")
    assert got.usage.prompt_tokens == len(prompt_ids)
    assert got.usage.completion_tokens == sum(len(c.token_ids) for c in want)


def test_prompt_token_ids_are_the_prompt_and_tokenize_gives_them(served):
    url, tokenizer, _ = served
    client = _client(url)
    tokens = client.post("/tokenize", body={"prompt": PROMPT}, cast_to=object)["tokens"]
    assert tokens == tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    by_text = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": PROMPT}], seed=3, max_tokens=8
    )
    by_ids = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "ignored"}],
        seed=3,
        max_tokens=8,
        extra_body={"prompt_token_ids": tokens},
    )
    assert by_ids.prompt_token_ids == tokens
    assert by_ids.choices[0].token_ids == by_text.choices[0].token_ids
    # messages are tokenised one by one and concatenated: a conversation in two messages
    split = client.chat.completions.create(
        model="m",
        messages=[
            {"role": "user", "content": PROMPT[:10]},
            {"role": "user", "content": PROMPT[10:]},
        ],
        seed=3,
        max_tokens=2,
    )
    encode = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert split.prompt_token_ids == encode(PROMPT[:10]) + encode(PROMPT[10:])


def test_concurrent_requests_share_the_engine(served):
    url, _, _ = served
    results = {}

    def ask(seed):
        results[seed] = _client(url).chat.completions.create(
            model="m", messages=[{"role": "user", "content": PROMPT}], seed=seed, max_tokens=10
        )

    threads = [threading.Thread(target=ask, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    alone = _client(url).chat.completions.create(
        model="m", messages=[{"role": "user", "content": PROMPT}], seed=4, max_tokens=10
    )
    assert len(results) == 6
    assert results[4].choices[0].token_ids == alone.choices[0].token_ids  # batching changes nothing


def test_a_token_is_required_when_set_and_bad_requests_are_refused(served):
    url, _, _ = served
    with pytest.raises(openai.AuthenticationError):
        _client(url, key="wrong").models.list()
    assert [m.id for m in _client(url).models.list().data] == ["test-model"]
    with pytest.raises(openai.BadRequestError):
        _client(url).chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": PROMPT}],
            response_format={"type": "json_object"},
        )
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        _client(url).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x" * 3000}], max_tokens=8
        )


def test_binding_beyond_loopback_needs_a_token():
    check_binding("127.0.0.1", None)
    check_binding("::1", None)
    check_binding("localhost", None)
    check_binding("0.0.0.0", "a-token")
    with pytest.raises(ValueError, match="needs a token"):
        check_binding("0.0.0.0", None)


def test_messages_go_through_the_tokenizers_chat_template_when_it_has_one(model_dir):
    tokenizer = load_tokenizer(model_dir)  # the embedded tokenizer ships a small template
    assert tokenizer.chat_template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    request = ChatRequest(messages=[ChatMessage(**m) for m in messages])
    want = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert render(request, tokenizer) == list(want)
    assert render(request, tokenizer) != tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
