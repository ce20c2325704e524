"""New weights between two decode steps of the continuous engine (partial rollouts): each token
is stamped with the version that sampled it, and its log-prob is what that version gives it over
the keys and values the engine kept (keep) or prefilled again (recompute)."""

import pytest
import torch

from cadence.engine import ContinuousEngine, Request, SamplingParams, derive_seed, load_into
from inflight import full_logprobs, kept_cache_logprobs, next_version

PARAMS = SamplingParams(max_new_tokens=12, temperature=0.9)
QUESTIONS = ["What is 3 + 4?", "Tom has 12 apples. He buys 7 more.", "What is 19 - 8?"]


def _requests(tokenizer, group_size=2):
    return [
        Request(tokenizer(q)["input_ids"], [derive_seed(3, 0, i, j) for j in range(group_size)])
        for i, q in enumerate(QUESTIONS)
    ]


def _run(engine, requests, change_after=None, new=None, recompute=False):
    """Every request to the end; after step `change_after`, `new`'s weights as version 1."""
    engine.take_weights_in_flight(recompute)
    for i, r in enumerate(requests):
        engine.add(i, r, PARAMS)
    out, steps = {}, 0
    while engine.busy:
        out.update(engine.step())
        steps += 1
        if steps == change_after:
            load_into(engine.model, dict(new.named_parameters()))
            engine.weights_changed(1)
    return [out[i] for i in range(len(requests))]


def test_every_token_carries_the_engine_version(model, tokenizer):
    engine = ContinuousEngine(model, tokenizer, max_num_seqs=4)
    engine.weights_changed(7)  # idle: a label for what comes next
    groups = engine.generate(_requests(tokenizer), PARAMS)
    for c in (c for g in groups for c in g):
        assert c.token_versions == [7] * len(c.token_ids) and c.oldest_version == 7
    assert engine.oldest_version is None  # nothing in flight


@pytest.mark.parametrize("recompute", [False, True])
def test_tokens_after_new_weights_carry_the_new_version_and_its_logprobs(
    model, tokenizer, recompute
):
    old, new = model, next_version(model)
    engine = ContinuousEngine(next_version(model, scale=0.0), tokenizer, max_num_seqs=3)
    requests = _requests(tokenizer)  # six samples, three slots: some wait, prefilled ahead
    groups = _run(engine, requests, change_after=4, new=new, recompute=recompute)
    models = {0: old, 1: new}
    old_tokens = set()
    for req, group in zip(requests, groups, strict=True):
        for c in group:
            versions = c.token_versions
            assert versions == sorted(versions) and set(versions) <= {0, 1}
            old_tokens.add(versions.count(0))
            got = torch.tensor(c.logprobs)
            if recompute:  # each token under its own version over the whole prefix
                want = torch.stack(
                    [
                        full_logprobs(models[v], req.prompt_ids, c.token_ids, 0.9)[i]
                        for i, v in enumerate(versions)
                    ]
                )
            else:
                want = kept_cache_logprobs(models, req.prompt_ids, c.token_ids, versions, 0.9)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            if not recompute and len(set(versions)) == 2:  # kept keys and values do show
                fresh = full_logprobs(new, req.prompt_ids, c.token_ids, 0.9)
                late = torch.tensor(versions) == 1
                assert (got - fresh)[late].abs().max() > 1e-3
    # three sequences decoded across the change; three waited for a slot, their prompts
    # prefilled ahead under the old weights: recomputed, they are wholly the new version's;
    # kept, their first token still comes from the old prefill
    assert old_tokens == ({0, 4} if recompute else {1, 5})


def test_keep_stamps_the_next_token_old_recompute_new(model, tokenizer):
    # the logits of each sequence's next token were computed before the change: kept, that token
    # is the old version's; recomputed, it is the new one's
    new = next_version(model)
    request = _requests(tokenizer, group_size=1)[:1]
    for recompute, first_new in ((False, 4), (True, 3)):
        engine = ContinuousEngine(next_version(model, scale=0.0), tokenizer, max_num_seqs=1)
        (group,) = _run(engine, request, change_after=3, new=new, recompute=recompute)
        versions = group[0].token_versions
        assert versions[:first_new] == [0] * first_new and set(versions[first_new:]) == {1}


def test_oldest_version_in_flight(model, tokenizer):
    engine = ContinuousEngine(next_version(model, scale=0.0), tokenizer, max_num_seqs=2)
    engine.take_weights_in_flight(False)
    engine.weights_changed(4)
    for i, r in enumerate(_requests(tokenizer, group_size=1)):
        engine.add(i, r, PARAMS)
    assert engine.oldest_version is None  # nothing sampled yet
    engine.step()
    engine.weights_changed(5)
    engine.step()
    engine.step()
    assert engine.oldest_version == 4  # the first two requests began under version 4


def test_new_weights_with_sequences_in_flight_need_consent(model, tokenizer):
    engine = ContinuousEngine(model, tokenizer, max_num_seqs=2)
    engine.add(0, _requests(tokenizer, group_size=1)[0], PARAMS)
    engine.step()
    with pytest.raises(RuntimeError, match="take_weights_in_flight first"):
        engine.weights_changed(1)


def test_a_waiting_prompt_prefilled_under_old_weights_counts_as_in_flight(model, tokenizer):
    """With max_num_seqs = 1 the second prompt waits, prefilled ahead under version 4; the keep
    mode samples its first token from that prefill, so it holds version 4 however late it
    starts: staleness_strategy = 'wait' must see it."""
    engine = ContinuousEngine(next_version(model, scale=0.0), tokenizer, max_num_seqs=1)
    engine.take_weights_in_flight(False)
    engine.weights_changed(4)
    for i, r in enumerate(_requests(tokenizer, group_size=1)[:2]):
        engine.add(i, r, PARAMS)
    engine.step()  # admits the first, prefills the second ahead
    engine.weights_changed(5)
    done = {}
    while 0 not in done:
        done.update(engine.step())
    assert engine.oldest_version == 4  # only the waiting prompt is left, prefilled under 4
    while engine.busy:
        done.update(engine.step())
    assert done[1][0].token_versions[0] == 4
