"""Continuous batching: same samples whatever the slot, groups out early, no slot leaks."""

import warnings

import pytest
import torch

from cadence.engine import (
    ContinuousEngine,
    HFEngine,
    Request,
    SamplingParams,
    check_continuous,
    derive_seed,
    make_engine,
)
from engine_checks import assert_behaviour_logprobs_match
from tiny_models import tiny_causal_lm

QUESTIONS = [
    "What is 3 + 4?",
    "Tom has 12 apples. He buys 7 more. How many?",
    "What is 19 - 8?",
    "Sam had 5 pens and lost 2. How many are left?",
]


def _requests(tokenizer, group_sizes=(4, 3, 4, 2), iteration=0):
    return [
        Request(
            tokenizer(f"Question: {q}\nAnswer: ")["input_ids"],
            [derive_seed(7, iteration, i, j) for j in range(g)],
        )
        for i, (q, g) in enumerate(zip(QUESTIONS, group_sizes, strict=True))
    ]


def _tokens(groups):
    return [[c.token_ids for c in g] for g in groups]


def test_samples_do_not_depend_on_slots_order_or_companions(model, tokenizer):
    params = SamplingParams(max_new_tokens=20, stop_token_ids=(tokenizer.eos_token_id,))
    requests = _requests(tokenizer)
    reference = HFEngine(model, tokenizer).generate(requests, params)
    for slots in (256, 5, 3, 1):
        got = ContinuousEngine(model, tokenizer, max_num_seqs=slots).generate(requests, params)
        assert _tokens(got) == _tokens(reference), slots
    reversed_order = ContinuousEngine(model, tokenizer, 3).generate(requests[::-1], params)
    assert _tokens(reversed_order[::-1]) == _tokens(reference)
    alone = ContinuousEngine(model, tokenizer, 4).generate(requests[2:3], params)
    assert _tokens(alone) == _tokens(reference[2:3])
    # a request that arrives while others are half-way through decoding
    engine, out = ContinuousEngine(model, tokenizer, max_num_seqs=6), {}
    engine.add(0, requests[0], params)
    for _ in range(5):
        out.update(engine.step())
    for i, r in enumerate(requests[1:], start=1):
        engine.add(i, r, params)
    while engine.busy:
        out.update(engine.step())
    assert _tokens([out[i] for i in range(4)]) == _tokens(reference)
    assert len({tuple(t) for g in _tokens(reference) for t in g}) > 1  # really sampled


@pytest.mark.parametrize(("arch", "top_p"), [("llama", 1.0), ("qwen2", 1.0), ("llama", 0.6)])
def test_logprobs_equal_the_full_forward_recomputation(arch, top_p, tokenizer):
    # with top_p < 1 too: the record is log softmax(logits / T), top-p only choosing where the
    # sample falls, as the learner recomputes it (not renormalised over the nucleus)
    model = tiny_causal_lm(arch, len(tokenizer))
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=top_p)
    requests = _requests(tokenizer)
    outputs = ContinuousEngine(model, tokenizer, max_num_seqs=5).generate(requests, params)
    assert_behaviour_logprobs_match(model, requests, outputs, params.temperature)
    assert check_continuous(model, tokenizer) is None


def test_a_group_leaves_before_a_longer_unrelated_sequence_finishes(model, tokenizer):
    long_req, short_req = _requests(tokenizer, (1, 2, 1, 1))[:2]
    probe = SamplingParams(max_new_tokens=30)
    long_run, short_run = HFEngine(model, tokenizer).generate([long_req, short_req], probe)
    # a stop id that both short samples reach within 6 tokens and the long one never emits
    candidates = set(short_run[0].token_ids[:6]) & set(short_run[1].token_ids[:6])
    stop = next(t for t in sorted(candidates) if t not in long_run[0].token_ids)
    params = SamplingParams(max_new_tokens=30, stop_token_ids=(stop,))
    engine = ContinuousEngine(model, tokenizer, max_num_seqs=4)
    engine.add("long", long_req, params)  # first in, so arrival order does not favour the group
    engine.add("short", short_req, params)
    finished = []
    while not finished:
        finished = engine.step()
    assert [key for key, _ in finished] == ["short"]
    assert all(c.finish_reason == "eos" for c in finished[0][1])
    assert engine.num_active == 1  # the long sequence is still decoding
    rest = []
    while engine.busy:
        rest += engine.step()
    assert [key for key, _ in rest] == ["long"]
    assert len(rest[0][1][0].token_ids) == 30


def test_no_slot_leaks_over_many_requests(model, tokenizer):
    engine = ContinuousEngine(model, tokenizer, max_num_seqs=7)
    params = SamplingParams(max_new_tokens=9, stop_token_ids=(tokenizer.eos_token_id,))
    gen = torch.Generator().manual_seed(0)
    done = {}
    for k in range(40):
        q = QUESTIONS[k % len(QUESTIONS)]
        g = int(torch.randint(1, 6, (1,), generator=gen))
        engine.add(k, Request(tokenizer(q)["input_ids"], list(range(k * 10, k * 10 + g))), params)
        if k % 3 == 0:  # arrivals interleaved with decoding
            done.update(engine.step())
        assert engine.num_active <= 7
    while engine.busy:
        done.update(engine.step())
    assert sorted(done) == list(range(40))
    assert engine.num_active == 0 and not engine.waiting
    assert max(n for _, n in engine.occupancy) == 7  # the slots really filled
    assert engine.occupancy[-1][1] == 0


def test_stop_strings_and_max_lengths_are_honoured(model, tokenizer):
    requests = _requests(tokenizer)
    free = HFEngine(model, tokenizer).generate(requests, SamplingParams(max_new_tokens=15))
    text = free[1][0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # two characters from the middle
    params = SamplingParams(max_new_tokens=15, stop=(stop,))
    out = ContinuousEngine(model, tokenizer, max_num_seqs=3).generate(requests, params)
    assert out[1][0].finish_reason == "stop" and stop in out[1][0].text
    assert len(out[1][0].token_ids) < 15
    for group in out:
        for c in group:
            assert len(c.token_ids) <= 15 and len(c.logprobs) == len(c.token_ids)
            assert (c.finish_reason == "length") == (len(c.token_ids) == 15 and stop not in c.text)


def test_a_model_the_slot_cache_cannot_serve_falls_back_to_static(tokenizer):
    model = tiny_causal_lm(
        "qwen2",
        len(tokenizer),
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=0,
        layer_types=["sliding_attention", "sliding_attention"],
    )
    assert check_continuous(model, tokenizer) is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = make_engine("continuous", model, tokenizer, max_num_seqs=8)
    assert isinstance(engine, HFEngine)
    assert len(caught) == 1 and "static" in str(caught[0].message)


def test_engine_choice_and_errors(model, tokenizer):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default model needs no fallback
        assert isinstance(make_engine("continuous", model, tokenizer, 8), ContinuousEngine)
    assert isinstance(make_engine("static", model, tokenizer, 8), HFEngine)
    with pytest.raises(ValueError, match="unknown engine"):
        make_engine("paged", model, tokenizer, 8)
    engine = ContinuousEngine(model, tokenizer, 4)
    engine.add(0, _requests(tokenizer)[0], SamplingParams(max_new_tokens=3))
    with pytest.raises(ValueError, match="one SamplingParams"):
        engine.add(1, _requests(tokenizer)[1], SamplingParams(max_new_tokens=4))
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.generate(_requests(tokenizer)[:1], SamplingParams(max_new_tokens=3))
