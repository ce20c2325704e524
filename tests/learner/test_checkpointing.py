"""Activation checkpointing per decoder layer gives the log-probs and gradients of the plain
pass, in train mode, for every shared-prompt layout (the prefix layout's prompt cache included)
and with a LoRA adapter."""

import copy

import pytest
import torch
from test_logprobs import _inputs, _run

from cadence.learner.checkpointing import checkpoint_layers
from cadence.learner.logprobs import install_head
from cadence.models.lora import LoraSpec, apply_lora


def _saved_bytes(model, layout, tokens):
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        from cadence.learner.logprobs import token_logprobs

        token_logprobs(model, layout, tokens, 1.0, False)[0].sum()
    return sum(total)


@pytest.mark.parametrize("layout", ["unpacked", "dense", "prefix", "packed"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_checkpointed_layers_give_the_plain_logprobs_and_gradients(model, tokenizer, layout, lora):
    built, tokens = _inputs(model, tokenizer, layout)
    plain = copy.deepcopy(model)
    if lora:
        plain = apply_lora(plain, LoraSpec(4, 8.0, 0.0, ("q_proj", "v_proj")))
        with torch.no_grad():  # a trained adapter: B is 0 when fresh
            for n, p in plain.named_parameters():
                if "lora_B" in n:
                    p.normal_(std=0.02)
    install_head(plain, chunk=7)
    plain.train()
    checkpointed = copy.deepcopy(plain)
    assert checkpoint_layers(checkpointed) == model.config.num_hidden_layers
    want = _run(plain, built, tokens)
    got = _run(checkpointed, built, tokens)
    assert (got[0] - want[0]).abs().max() <= 1e-6
    assert got[2].keys() == want[2].keys() and want[2]
    for name, g in want[2].items():
        assert (got[2][name] - g).abs().max() <= 1e-6 * max(1.0, g.abs().max().item()), name
    assert checkpointed.state_dict().keys() == plain.state_dict().keys()
    # what autograd keeps for the backward shrinks: each layer's input, not its intermediates
    assert _saved_bytes(checkpointed, built, tokens) < 0.6 * _saved_bytes(plain, built, tokens)
