"""Log-probs and entropy from the last hidden states a chunk of tokens at a time: the values and
gradients of the full logits, without ever holding a [B, T, V] float32 logits tensor."""

import copy

import pytest
import torch
from rollouts import sample_groups

from cadence.learner.logprobs import from_logits, install_head, logprob_head, token_logprobs
from cadence.learner.packing import LAYOUTS, install_checked_head


def _inputs(model, tokenizer, layout):
    groups = sample_groups(model, tokenizer, n=3, group_size=3)
    tokens = [(g.prompt_ids, [c.token_ids for c in g.completions]) for g in groups]
    built = LAYOUTS[layout](tokens, tokenizer.pad_token_id)
    width = max(len(c.token_ids) for g in groups for c in g.completions)
    ids = torch.full((sum(g.group_size for g in groups), width), tokenizer.pad_token_id)
    for b, c in enumerate(c for g in groups for c in g.completions):
        ids[b, : len(c.token_ids)] = torch.tensor(c.token_ids)
    return built, ids


def _run(model, layout, tokens, temperature=0.7):
    model.zero_grad(set_to_none=True)
    logprobs, entropy = token_logprobs(model, layout, tokens, temperature, True)
    weights = torch.linspace(-1.0, 1.0, logprobs.numel()).view_as(logprobs)
    (logprobs * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), entropy, grads


@pytest.mark.parametrize("layout", ["unpacked", "dense", "prefix", "packed"])
def test_chunked_logprobs_equal_the_full_logits_values_and_gradients(model, tokenizer, layout):
    built, tokens = _inputs(model, tokenizer, layout)
    chunked = copy.deepcopy(model).train()
    assert install_head(chunked, chunk=5) is None  # 5 tokens a chunk: several chunks
    full = copy.deepcopy(model).train()
    got = _run(chunked, built, tokens)
    want = _run(full, built, tokens)
    assert logprob_head(chunked) is not None and logprob_head(full) is None
    assert (got[0] - want[0]).abs().max() <= 1e-6
    assert (got[1] - want[1]).abs().max() <= 1e-6
    assert got[2].keys() == want[2].keys()
    for name, g in want[2].items():
        assert (got[2][name] - g).abs().max() <= 1e-6 * max(1.0, g.abs().max().item()), name
    # the head is the model's own weight: names, ties and the state dict are unchanged
    assert chunked.state_dict().keys() == model.state_dict().keys()


def _saved(model, layout, tokens):
    """Shapes and dtypes of every tensor autograd keeps for the backward of one pass."""
    seen = []

    def pack(t):
        seen.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(model, layout, tokens, 1.0, True)[0].sum()
    return seen


@pytest.mark.parametrize("layout", ["unpacked", "prefix"])
def test_no_full_float32_logits_tensor_is_kept_for_the_backward(model, tokenizer, layout):
    built, tokens = _inputs(model, tokenizer, layout)
    vocab = model.get_output_embeddings().weight.shape[0]
    rows = tokens.numel()  # B x T: a logits tensor of every response token

    def logits_like(seen):
        return [
            s for s, d in seen if s and s[-1] == vocab and torch.Size(s).numel() >= rows * vocab
        ]

    chunked = copy.deepcopy(model).train()
    install_head(chunked, chunk=4)
    assert logits_like(_saved(chunked, built, tokens)) == []
    # the budget test can fail: the full-logits path keeps [B, T, V]-sized tensors
    assert logits_like(_saved(copy.deepcopy(model).train(), built, tokens)) != []


def test_a_head_that_is_not_a_plain_projection_keeps_the_full_logits(model, tokenizer):
    odd = copy.deepcopy(model)
    odd.lm_head = torch.nn.Sequential(odd.lm_head)  # a head doing more than a projection
    with pytest.warns(UserWarning, match="log-probs from the full logits"):
        install_checked_head(odd, 8, tokenizer.pad_token_id)
    assert logprob_head(odd) is None
    built, tokens = _inputs(model, tokenizer, "unpacked")
    want = from_logits(built.logits(model)[None], tokens[built.valid][None], 1.0, False)[0][0]
    got = token_logprobs(odd, built, tokens, 1.0, False)[0]
    assert (got[built.valid] - want).abs().max() <= 1e-6
    assert not got[~built.valid].any()  # padding: 0, as the head gives it
