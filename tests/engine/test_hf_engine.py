import pytest
import torch

from cadence.engine import (
    HFEngine,
    Request,
    SamplingParams,
    derive_seed,
    sample_tokens,
    step_uniforms,
)
from engine_checks import assert_behaviour_logprobs_match


def _requests(tokenizer, questions, group_size, iteration=0):
    return [
        Request(
            tokenizer(f"Question: {q}\nAnswer: ")["input_ids"],
            [derive_seed(7, iteration, i, j) for j in range(group_size)],
        )
        for i, q in enumerate(questions)
    ]


QUESTIONS = ["What is 3 + 4?", "Tom has 12 apples. He buys 7 more. How many?", "What is 19 - 8?"]


@pytest.mark.parametrize("top_p", [1.0, 0.6])
def test_behaviour_logprobs_equal_full_forward_logprobs(model, tokenizer, top_p):
    # top_p < 1 only chooses where the sample falls: the record is the full softmax's
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=top_p)
    engine = HFEngine(model, tokenizer)
    requests = _requests(tokenizer, QUESTIONS, 3)
    outputs = engine.generate(requests, params)
    assert_behaviour_logprobs_match(model, requests, outputs, params.temperature)


def test_seeded_samples_do_not_depend_on_batch_composition(model, tokenizer):
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    engine = HFEngine(model, tokenizer)
    full = engine.generate(_requests(tokenizer, QUESTIONS, 4), params)
    # the middle prompt alone, then in a batch small enough to be split into chunks
    alone = engine.generate(_requests(tokenizer, QUESTIONS, 4)[1:2], params)
    chunked = HFEngine(model, tokenizer, max_num_seqs=5).generate(
        list(reversed(_requests(tokenizer, QUESTIONS, 4))), params
    )
    assert [c.token_ids for c in alone[0]] == [c.token_ids for c in full[1]]
    assert [c.token_ids for c in chunked[::-1][0]] == [c.token_ids for c in full[0]]
    # different seeds give different samples (the randomness is really per sample)
    assert len({tuple(c.token_ids) for g in full for c in g}) > 1


def test_generation_stops_at_eos_and_respects_max_new_tokens(model, tokenizer):
    eos = tokenizer.eos_token_id
    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=(eos,))
    for group in HFEngine(model, tokenizer).generate(_requests(tokenizer, QUESTIONS, 4), params):
        for c in group:
            assert 1 <= len(c.token_ids) <= 6
            assert len(c.logprobs) == len(c.token_ids)
            assert (c.finish_reason == "eos") == (c.token_ids[-1] == eos)
            assert eos not in c.token_ids[:-1]


def test_sampling_follows_the_distribution_and_greedy_takes_the_argmax():
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]]))  # probabilities 0.1, 0.6, 0.3
    # inverse CDF over [0.1, 0.7, 1.0]: u=0.05 -> 0, u=0.5 -> 1, u=0.95 -> 2
    for u, expected in [(0.05, 0), (0.5, 1), (0.95, 2)]:
        ids, logp = sample_tokens(logits, torch.tensor([u], dtype=torch.float64), 1.0, 1.0)
        assert ids.item() == expected
        assert logp.item() == pytest.approx(torch.log_softmax(logits, -1)[0, expected].item())
    # top_p=0.5 keeps only the 0.6 token: any u picks id 1
    ids, _ = sample_tokens(logits, torch.tensor([0.99], dtype=torch.float64), 1.0, 0.5)
    assert ids.item() == 1
    ids, _ = sample_tokens(logits, torch.tensor([0.0], dtype=torch.float64), 0.0, 1.0)
    assert ids.item() == 1


def test_sampled_logprobs_keep_a_large_vocabularys_tail():
    # a peaked row over a 49,152-token vocabulary (SmolLM2's) with a long tail: the learner's
    # logits - logsumexp keeps the tail's mass, and the engine must too. torch.log_softmax in
    # float32 on CPU loses it (measured: every log-prob about 1.4e-5 too high)
    logits = 3 * torch.randn(4, 49152, generator=torch.Generator().manual_seed(0))  # (R, V)
    logits[:, 7] = 20.0
    exact = logits.double().log_softmax(-1)[:, 7]  # (R,)
    for temperature in (0.0, 1.0):
        ids, logp = sample_tokens(
            logits, torch.full((4,), 0.5, dtype=torch.float64), temperature, 1.0
        )
        assert ids.tolist() == [7] * 4
        assert (logp.double() - exact).abs().max().item() <= 3e-6


def test_step_uniforms_are_uniform_and_independent_of_neighbours():
    seeds = torch.tensor([derive_seed(0, 0, i, 0) for i in range(4000)], dtype=torch.int64)
    u = step_uniforms(seeds, 3)
    assert u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.02  # std of the mean: 0.29 / sqrt(4000) = 0.0046
    torch.testing.assert_close(step_uniforms(seeds[10:11], 3), u[10:11], rtol=0, atol=0)
    assert not torch.equal(step_uniforms(seeds, 4), u)
