"""Fingerprints (models/fingerprint.py): every way of reading a tensor hashes the same bytes, and
a model's kept layout never hides a change to what it holds."""

from __future__ import annotations

import pytest
import torch

from cadence.models.fingerprint import BLOCK, BLOCKS, fingerprint, held, tensor_fingerprint


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(40, 30), torch.nn.LayerNorm(30), torch.nn.Linear(30, 2)
    )


def test_memory_reads_and_gathers_hash_the_same_elements():
    model = _model()
    in_place = fingerprint(model)  # contiguous CPU tensors: read from their memory
    gathered = {n: tensor_fingerprint(p.t().contiguous().t()) for n, p in model.named_parameters()}
    assert not model[0].weight.t().contiguous().t().is_contiguous()
    assert in_place == gathered == fingerprint(dict(model.named_parameters()))
    assert set(in_place) == {n for n, _ in model.named_parameters()}


def test_every_sampled_run_is_hashed_and_nothing_else():
    t = torch.zeros(1000)
    base = tensor_fingerprint(t)
    for i in (0, 999, 500):  # first, last, and a run in the middle (1000 - 16 = 984, / 3 = 328)
        other = t.clone()
        other[i if i != 500 else 328] = 1.0
        assert tensor_fingerprint(other) != base
    untouched = t.clone()
    untouched[100] = 1.0  # between runs: a sample, not a checksum
    assert tensor_fingerprint(untouched) == base
    assert BLOCKS * BLOCK == 64


@pytest.mark.parametrize(
    "change",
    ["in place", "data replaced", "parameter replaced", "module replaced", "dtype", "shape"],
)
def test_a_models_kept_layout_sees_every_change_to_what_it_holds(change):
    model = _model()
    before = fingerprint(model)
    assert fingerprint(model) == before  # the kept layout: same answer
    with torch.no_grad():
        if change == "in place":
            model[2].bias.add_(1.0)
        elif change == "data replaced":
            model[2].bias.data = model[2].bias.data + 1.0
        elif change == "parameter replaced":
            model[2].bias = torch.nn.Parameter(model[2].bias + 1.0)
        elif change == "module replaced":
            model[2] = torch.nn.Linear(30, 2)
        elif change == "dtype":
            model.to(torch.float64)
        else:
            model[2].bias.data = torch.zeros(3)
    after = fingerprint(model)
    assert after != before
    assert after == {n: tensor_fingerprint(p) for n, p in model.named_parameters()}


def test_held_by_a_model_casts_to_what_was_published_and_skips_other_shapes():
    model = _model()
    expected = fingerprint(model)
    engine = _model().to(torch.float64)  # the same values, kept in another dtype
    assert held(engine, expected) == expected
    engine[2] = torch.nn.Linear(30, 3).double()  # another shape: not compared
    got = held(engine, expected)
    assert set(got) == set(expected) - {"2.weight", "2.bias"}
    assert held(dict(engine.named_parameters()), expected) == got


def test_a_lora_policys_merged_weights_are_fingerprinted_as_published_without_a_second_merge(
    monkeypatch,
):
    from cadence.backend.weights import InMemoryWeights
    from cadence.models import lora
    from cadence.models.lora import LoraSpec, MergedWeights, apply_lora, merged_parameters
    from tiny_models import tiny_causal_lm

    policy = apply_lora(tiny_causal_lm("qwen2", 64), LoraSpec(r=4, target_modules=("q_proj",)))
    merged = MergedWeights(policy)
    transport = InMemoryWeights(merged)
    merges = []
    real = lora.merged_tensors
    monkeypatch.setattr(lora, "merged_tensors", lambda p: merges.append(1) or real(p))
    counted = []
    for step in range(3):
        with torch.no_grad():  # the optimizer's step: the adapter changes in place
            for n, p in policy.named_parameters():
                if "lora_B" in n:
                    p.add_(0.01 * (step + 1))
        before = len(merges)
        transport.publish(merged, step)  # the sync merges once...
        expected = fingerprint(merged)  # ...and the check reads what that merge recorded
        counted.append(len(merges) - before)
        assert expected == fingerprint(merged_parameters(policy))
        assert expected == fingerprint(transport.tensors)
    assert counted == [2, 1, 1]  # the first check merges again: nothing was recorded yet
    with torch.no_grad():
        next(p for n, p in policy.named_parameters() if "lora_B" in n).add_(1.0)
    assert fingerprint(merged) == fingerprint(merged_parameters(policy))  # changed: merged again


def test_vllms_packed_and_padded_tensors_are_compared_as_their_published_parts():
    from cadence.engine.vllm_weights import unpacked

    torch.manual_seed(0)
    published = {
        "model.embed_tokens.weight": torch.randn(367, 8),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(4, 8),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(4, 8),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(16, 8),
        "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8),
    }
    expected = fingerprint(published)

    def vllm_like(order=("q", "k", "v")):  # vLLM's layout of the same weights (one GPU)
        attn = "model.layers.0.self_attn."
        model = torch.nn.Module()
        model.packed_modules_mapping = {
            "qkv_proj": ["q_proj", "k_proj", "v_proj"],
            "gate_up_proj": ["gate_proj", "up_proj"],
        }
        tensors = {
            "model.embed_tokens.weight": torch.cat([published["model.embed_tokens.weight"],
                                                    torch.zeros(17, 8)]),  # padded to 384 rows
            attn + "qkv_proj.weight": torch.cat([published[f"{attn}{x}_proj.weight"]
                                                 for x in order]),
            "model.layers.0.mlp.gate_up_proj.weight": torch.cat(
                [published["model.layers.0.mlp.gate_proj.weight"],
                 published["model.layers.0.mlp.up_proj.weight"]]),
        }  # fmt: skip
        for name, t in tensors.items():
            owner = model
            for part in name.split(".")[:-1]:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter("weight", torch.nn.Parameter(t, requires_grad=False))
        return model

    assert held(unpacked(vllm_like(), expected), expected) == expected  # every tensor compared
    swapped = held(unpacked(vllm_like(("k", "q", "v")), expected), expected)
    assert sorted(n for n in expected if swapped.get(n) != expected[n]) == [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
    ]  # the rows are not where the learner's q and k are: those differ (v still fits)
