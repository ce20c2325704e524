"""`POST /inference/v1/generate` of `cadence serve`: token ids in, the engine's tokens for the
seed and their log-probs out, in the form verifiers' training client reads (its own `generate`
function is driven against the server here); what an engine cannot do is refused by name."""

import asyncio

import httpx
import openai
import pytest

from cadence.engine import ContinuousEngine, Request, SamplingParams

PROMPT = "Question: What is 3 + 4?\nAnswer: "
AUTH = {"Authorization": "Bearer sesame"}


def _generate(url, body):
    root = url.removesuffix("/v1")
    return httpx.post(f"{root}/inference/v1/generate", json=body, headers=AUTH, timeout=60)


def _engine(model, tokenizer, ids, seeds, **params):
    engine = ContinuousEngine(model, tokenizer, max_num_seqs=8)
    stop = params.pop("stop_token_ids", ())
    sampling = SamplingParams(stop_token_ids=(tokenizer.eos_token_id, *stop), **params)
    (want,) = engine.generate([Request(ids, seeds)], sampling)
    return want


def test_generate_answers_the_engines_tokens_and_logprobs_for_the_seed(served):
    url, tokenizer, model = served
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    sampling = {"temperature": 0.8, "top_p": 0.9, "max_tokens": 12, "seed": 5, "n": 2}
    reply = _generate(url, {"model": "test-model", "token_ids": ids, "sampling_params": sampling})
    assert reply.status_code == 200, reply.text
    got = reply.json()
    want = _engine(model, tokenizer, ids, [5, 6], max_new_tokens=12, temperature=0.8, top_p=0.9)
    assert got["prompt_token_ids"] == ids and len(got["choices"]) == 2
    for j, (choice, c) in enumerate(zip(got["choices"], want, strict=True)):
        assert choice["index"] == j and choice["token_ids"] == c.token_ids
        content = choice["logprobs"]["content"]
        assert [e["token"] for e in content] == [f"token_id:{t}" for t in c.token_ids]
        diff = max(abs(e["logprob"] - lp) for e, lp in zip(content, c.logprobs, strict=True))
        assert diff <= 1e-5
        assert choice["finish_reason"] == ("length" if c.finish_reason == "length" else "stop")


def test_stop_token_ids_end_a_completion_besides_eos(served):
    url, tokenizer, model = served
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    free = _engine(model, tokenizer, ids, [3], max_new_tokens=12)[0].token_ids
    stop = free[4]
    sampling = {"max_tokens": 12, "seed": 3, "stop_token_ids": [stop]}
    got = _generate(url, {"token_ids": ids, "sampling_params": sampling}).json()["choices"][0]
    assert got["token_ids"] == free[: free.index(stop) + 1] and got["finish_reason"] == "stop"


def test_verifiers_training_client_reads_the_answer(served):
    # renderers' `generate` is what verifiers' TrainClient calls: it renders the messages, posts
    # them, and checks every returned token against its log-prob entry
    from renderers.client import generate

    from cadence.envs.verifiers.render import PlainRenderer

    url, tokenizer, model = served
    renderer = PlainRenderer(tokenizer)
    client = openai.AsyncOpenAI(base_url=url, api_key="sesame", max_retries=0)

    async def ask():
        try:
            return await generate(
                client=client,
                renderer=renderer,
                messages=[{"role": "user", "content": PROMPT}],
                model="test-model",
                sampling_params={"temperature": 1.0, "max_tokens": 10, "seed": 11},
            )
        finally:
            await client.close()

    result = asyncio.run(ask())
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    (want,) = _engine(model, tokenizer, ids, [11], max_new_tokens=10)
    assert result["prompt_ids"] == ids
    assert result["completion_ids"] == want.token_ids
    got = result["completion_logprobs"]
    assert max(abs(a - b) for a, b in zip(got, want.logprobs, strict=True)) <= 1e-5


def test_models_say_the_context_length_the_client_checks_prompts_against(served):
    url, _, _ = served
    (card,) = httpx.get(f"{url}/models", headers=AUTH).json()["data"]
    assert card["id"] == "test-model" and card["max_model_len"] == 1024


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"token_ids": []}, "token_ids: List should have at least 1 item"),
        ({"token_ids": [5, -1]}, "token_ids[1] = -1 is not a token of this model"),
        ({"token_ids": [5] * 1020, "sampling_params": {"max_tokens": 8}}, "maximum context"),
        ({"token_ids": [5], "sampling_params": {"top_k": 5}}, "sampling_params.top_k = 5 is not"),
        (
            {"token_ids": [5], "sampling_params": {"repetition_penalty": 1.2}},
            "repetition_penalty = 1.2 is not supported",
        ),
        ({"token_ids": [5], "sampling_params": {"stop_token_ids": [10**6]}}, "is not a token id"),
        ({"token_ids": [5], "sampling_params": {"seed": 2**63 - 1, "n": 2}}, "seed + n"),
        ({"token_ids": [5], "features": {"mm_hashes": {}}}, "text models only"),
    ],
)
def test_what_the_engine_cannot_take_is_refused_with_400_and_the_reason(served, body, reason):
    url, _, _ = served
    reply = _generate(url, body)
    assert reply.status_code == 400
    assert reason in reply.json()["error"]["message"]
    fine = _generate(url, {"token_ids": [5], "sampling_params": {"max_tokens": 2}})
    assert fine.status_code == 200  # and the server serves on
