"""LoRA (model.lora): only the adapter trains, the reference is the base model with no second
copy, workers get merged weights under the plain model's names, and adapters save and load."""

from __future__ import annotations

import copy

import pytest
import torch

from cadence.algo import AlgoParams
from cadence.backend.weights import InMemoryWeights, learner_sync
from cadence.engine import EngineWeights, ScriptedEngine, load_into
from cadence.learner import Learner, LearnerParams, score
from cadence.models import load_model, load_tokenizer, save_pretrained
from cadence.models.lora import (
    AdapterOff,
    LoraError,
    LoraSpec,
    MergedWeights,
    apply_lora,
    is_lora,
    load_adapter_into,
    merged_parameters,
    save_merged,
)
from cadence.types import Completion, Group, Prompt
from tiny_models import tiny_causal_lm

SPEC = LoraSpec(r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))


def _policy(arch: str = "qwen2"):
    base = tiny_causal_lm(arch, 64)
    policy = apply_lora(copy.deepcopy(base), SPEC)
    with torch.no_grad():  # B starts at zero (the adapter is a no-op): give it a value
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    return base, policy


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_reference_logprobs_with_the_adapter_off_equal_the_base_models(arch: str) -> None:
    base, policy = _policy(arch)
    ids = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = base(input_ids=ids).logits.log_softmax(-1)
        off = AdapterOff(policy)(input_ids=ids).logits.log_softmax(-1)
        on = policy(input_ids=ids).logits.log_softmax(-1)
    assert (off - want).abs().max().item() <= 1e-6
    assert (on - want).abs().max().item() > 1e-2  # the adapter does change the policy
    assert list(AdapterOff(policy).parameters()) == []  # no second copy


def test_merged_weights_are_the_plain_models_and_give_the_policys_logits() -> None:
    base, policy = _policy()
    published = InMemoryWeights(MergedWeights(policy))  # what a worker's transport holds
    assert published.tensors.keys() == dict(base.named_parameters()).keys()
    worker = copy.deepcopy(base)  # the worker's model: no adapter
    load_into(worker, published.tensors)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (worker(input_ids=ids).logits - policy(input_ids=ids).logits).abs().max().item()
    assert diff <= 1e-5


class _OwnCopy(ScriptedEngine):
    """An engine that keeps its own copy of the weights (as vLLM does): records what it is sent."""

    owns_weights = True

    def __init__(self) -> None:
        super().__init__(lambda ids, seed: [1])
        self.loaded: list[tuple[dict[str, torch.Tensor], object]] = []

    def load_weights(self, tensors, version=None) -> None:
        self.loaded.append(({n: t.clone() for n, t in dict(tensors).items()}, version))

    def held_fingerprint(self, expected):
        from cadence.models.fingerprint import held

        return held(self.loaded[-1][0], expected) if self.loaded else {}


def test_an_engine_with_its_own_copy_is_synced_the_merged_weights_under_plain_names() -> None:
    # colocated vLLM with LoRA crashed at the first sync: it was sent the peft model's names
    base, policy = _policy()
    engine = _OwnCopy()
    skeleton = copy.deepcopy(base).to("meta")  # what the engine's own copy looks like
    sync = learner_sync(EngineWeights(engine, skeleton), policy)
    sync(3)
    ((tensors, version),) = engine.loaded
    assert version == 3 and tensors.keys() == dict(base.named_parameters()).keys()
    merged = merged_parameters(policy)
    assert all(torch.equal(tensors[n], merged[n]) for n in tensors)
    assert any(not torch.equal(tensors[n], p) for n, p in base.named_parameters())  # merged in


def _group(prompt: list[int], responses: list[list[int]], rewards: list[float]) -> Group:
    completions = [
        Completion(token_ids=r, logprobs=[-1.0] * len(r), text="", reward=x)
        for r, x in zip(responses, rewards, strict=True)
    ]
    prompt_record = Prompt(uid="p", text="", answer="")
    return Group(prompt_record, prompt, completions, policy_version=0, iteration=0)


def test_only_the_adapter_trains_and_no_frozen_copy_is_counted() -> None:
    _, policy = _policy()
    frozen = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" not in n}
    learner = Learner(
        policy,
        LearnerParams(lr=1e-2, shared_prompt=False),
        AlgoParams(kl_coef=0.1),
        pad_id=0,
        ref_model=AdapterOff(policy),
    )
    in_optimizer = [p for g in learner.optimizer.param_groups for p in g["params"]]
    adapter = [p for n, p in policy.named_parameters() if "lora_" in n]
    assert len(in_optimizer) == len(adapter) and all(p.requires_grad for p in in_optimizer)
    groups = [_group([1, 2, 3], [[4, 5], [6], [7, 8, 9], [10]], [1.0, 0.0, 1.0, 0.0])]
    stats = learner.train_iteration(iter(score(groups, learner.algo)), 1)
    assert stats["frozen_copies_mb"] == 0.0
    assert stats["kl"] > 0.0  # the reference (adapter off) differs from the policy
    for n, p in policy.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, frozen[n]), n  # the base weights never move


def test_a_target_that_matches_no_module_names_the_models_layers() -> None:
    with pytest.raises(LoraError, match=r"\['qkv'\] do not fit.*named: down_proj, gate_proj"):
        apply_lora(tiny_causal_lm("qwen2", 64), LoraSpec(target_modules=("qkv",)))


def test_adapter_saves_alone_and_loads_as_a_merged_model(model_dir, tmp_path) -> None:
    tokenizer = load_tokenizer(model_dir)
    policy = apply_lora(load_model(model_dir), SPEC, base_path=model_dir)
    assert is_lora(policy) and not is_lora(load_model(model_dir))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    adapter = save_pretrained(policy, tokenizer, tmp_path / "final")
    assert (adapter / "adapter_model.safetensors").is_file()
    assert not (adapter / "model.safetensors").exists()  # the adapter alone
    merged = save_merged(policy, tokenizer, tmp_path / "merged")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        want = policy(input_ids=ids).logits
        for loaded in (load_model(adapter), load_model(merged)):  # eval reads either
            assert not is_lora(loaded)
            assert (loaded(input_ids=ids).logits - want).abs().max().item() <= 1e-5
    fresh = apply_lora(load_model(model_dir), SPEC, base_path=model_dir)
    load_adapter_into(fresh, adapter)  # what a resumed run does
    with torch.no_grad():
        assert (fresh(input_ids=ids).logits - want).abs().max().item() == 0.0
    other = apply_lora(load_model(model_dir), LoraSpec(target_modules=("k_proj",)))
    with pytest.raises(LoraError, match=r"does not fit the run.s model\.lora"):
        load_adapter_into(other, adapter)


def test_a_bf16_merge_rounds_once_and_keeps_the_unmerged_policys_logprobs() -> None:
    # a bf16 weight plus the adapter's delta, each rounded to bf16, rounded the sum again: deltas
    # under the weight's rounding step were lost or doubled (issue 40, LoRA)
    base = tiny_causal_lm("qwen2", 64).to(torch.bfloat16)
    policy = apply_lora(copy.deepcopy(base), SPEC)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:  # small, as a few steps of training leave it
                p.normal_(0, 0.01, generator=torch.Generator().manual_seed(len(name)))
    merged = merged_parameters(policy)
    twice = {}  # the former merge: peft's bf16 delta added in bf16
    for name, module in policy.get_base_model().named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "active_adapters"):
            w = module.base_layer.weight
            twice[f"{name}.weight"] = w + module.get_delta_weight("default").to(w.dtype)
    assert twice and all(merged[n].dtype == torch.bfloat16 for n in merged)
    changed = 0
    for name, old in twice.items():
        module = policy.get_base_model().get_submodule(name.removesuffix(".weight"))
        exact = module.base_layer.weight.float()
        exact += (
            module.lora_B["default"].weight.float() @ module.lora_A["default"].weight.float()
        ) * module.scaling["default"]
        assert torch.equal(merged[name], exact.to(torch.bfloat16))  # one rounding
        changed += int((old != merged[name]).sum())
    assert changed > 0  # the two-rounding merge differs
    # the merged bf16 model's log-probs against the unmerged policy's, both computed in float32
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    worker = copy.deepcopy(base).float()
    load_into(worker, {n: t.float() for n, t in merged.items()})
    with torch.no_grad():
        want = copy.deepcopy(policy).float()(input_ids=ids).logits.log_softmax(-1)
        got = worker(input_ids=ids).logits.log_softmax(-1)
    assert (got - want).abs().max().item() <= 2e-2  # bf16 weights: within their rounding


def test_merged_weights_are_computed_one_tensor_at_a_time(monkeypatch) -> None:
    from cadence.models import lora

    _, policy = _policy()
    calls = []
    real = lora._delta
    monkeypatch.setattr(lora, "_delta", lambda m, a: calls.append(1) or real(m, a))
    tensors = MergedWeights(policy).named_parameters()
    assert calls == []  # nothing merged before the transport asks
    for name, _ in tensors:
        if "q_proj" in name:
            break
    assert len(calls) == 1  # the first adapted weight only
