"""The engine factory and the weight-ownership seam: which engines keep a copy of their own, what
new weights load into, and the checks on the way in."""

import pytest
import torch

from cadence.engine import (
    HFEngine,
    Request,
    SamplingParams,
    ScriptedEngine,
    as_streaming,
    keeps_own_copy,
    open_engine,
)
from cadence.models import load_model


def _requests(tokenizer):
    ids = tokenizer("Question: What is 3 + 4?\nAnswer: ", add_special_tokens=False)["input_ids"]
    return [Request(ids, [1, 2, 3])]


def _perturbed(model_dir):
    other = load_model(model_dir)
    with torch.no_grad():
        torch.manual_seed(3)
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return other


@pytest.mark.parametrize("kind", ["continuous", "static"])
def test_new_weights_reach_an_engine_through_the_model_it_decodes_with(model_dir, tokenizer, kind):
    engine, weights = open_engine(kind, str(model_dir), tokenizer, 8)
    assert engine.owns_weights is False and keeps_own_copy(kind) is False
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    before = engine.generate(_requests(tokenizer), params)
    other = _perturbed(model_dir)
    weights.load({n: p.detach() for n, p in other.named_parameters()}, version=3)
    after = engine.generate(_requests(tokenizer), params)
    want = HFEngine(other, tokenizer).generate(_requests(tokenizer), params)
    assert [c.token_ids for c in after[0]] == [c.token_ids for c in want[0]]
    assert [c.token_ids for c in after[0]] != [c.token_ids for c in before[0]]
    for got, ref in zip(after[0], want[0], strict=True):
        assert max(abs(a - b) for a, b in zip(got.logprobs, ref.logprobs, strict=True)) <= 1e-5


def test_weights_under_other_names_are_refused_with_the_names(model_dir, tokenizer):
    # a LoRA policy's own names (what vLLM refused at the first colocated sync)
    _, weights = open_engine("static", str(model_dir), tokenizer, 8)
    tensors = {f"base_model.model.{n}": p.detach() for n, p in weights.named_parameters()}
    with pytest.raises(ValueError, match=r"differ in parameters: \['base_model\.model\."):
        weights.load(tensors)


def test_the_factory_knows_which_engines_keep_their_own_copy():
    assert keeps_own_copy("vllm") is True
    assert keeps_own_copy("continuous") is False and keeps_own_copy("static") is False
    with pytest.raises(ValueError, match="unknown engine 'paged'"):
        keeps_own_copy("paged")


def test_a_batch_engine_seen_as_streaming_answers_for_the_engine():
    class OwnCopy(ScriptedEngine):
        owns_weights = True

    assert as_streaming(ScriptedEngine(lambda ids, seed: [1])).owns_weights is False
    assert as_streaming(OwnCopy(lambda ids, seed: [1])).owns_weights is True
