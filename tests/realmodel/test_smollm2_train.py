"""SmolLM2-135M-Instruct trained as `cadence train` builds its trainer, on two groups the
continuous engine sampled, rewarded by a fixed table: a LoRA policy trains only its adapter, and
towards the rewarded responses, while its reference stays the base model; two FSDP2 ranks (gloo,
local processes) make the one-process step."""

from __future__ import annotations

import copy

import pytest
import torch
from smollm2_checks import first_layers, learner_batch, recorded_batch, run_config, with_rewards

from cadence.builder import algo_params, build_learner, start_ranks
from cadence.learner import score
from cadence.metrics import Tracer
from cadence.models.lora import LoraSpec, apply_lora, base_parameters
from updates import assert_same_params, capture_grads

pytestmark = pytest.mark.slow

REWARDS = [1.0, 0.0, 0.0, 1.0]  # in each group, responses 1 and 4 are the ones to make likelier


def test_lora_trains_the_adapter_towards_reward_and_its_reference_is_the_base_model(
    smollm2_dir, smollm2, smollm2_groups
):
    model, tok = smollm2
    lora = ("model.lora.r=8", "model.lora.alpha=16.0", "algo.kl_coef=0.05", "train.lr=1e-3")
    cfg = run_config(smollm2_dir, *lora)
    # as the run applies it (pipeline/build.py), to a copy: the session's model stays the base
    policy = apply_lora(copy.deepcopy(model), LoraSpec(r=8, alpha=16.0), base_path=smollm2_dir)
    learner = build_learner(cfg, policy, tok.pad_token_id)  # reference: the adapter switched off
    algo, groups = algo_params(cfg), with_rewards(smollm2_groups, REWARDS)
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == {
        n for n, _ in policy.named_parameters() if "lora_" in n
    }
    learner.train_iteration(iter(score(groups, algo)), len(groups))
    trained = recorded_batch(learner, score(groups, algo))
    # the base model's log-probs as the learner computes a reference's: a frozen pass
    base = learner_batch(model, tok.pad_token_id, groups, algo, ref_model=model)

    base_weights = dict(model.named_parameters())
    assert all(torch.equal(p, base_weights[n]) for n, p in base_parameters(policy))
    lora_b = [p for n, p in policy.named_parameters() if "lora_B" in n]
    assert max(p.abs().max().item() for p in lora_b) > 1e-4  # from zero: the adapter trained
    mask = base.loss_mask.bool()
    ref_gap = (trained.ref_logprobs - base.ref_logprobs)[mask].abs().max().item()
    print(f"LoRA reference vs base model: max |log-prob diff| {ref_gap:.2e}")
    # the tiny models' tolerance: every token but each response's first matches bit for bit;
    # that one comes from the prompt pass's last position, where peft's wrapper and the plain
    # model round the LM head's output an ulp apart (3.8e-6 at SmolLM2's logits)
    assert ref_gap <= 1e-5
    # the policy moved, towards the rewarded responses: their log-probs rose against the others'
    change = ((trained.logprobs - base.logprobs).detach() * base.loss_mask).sum(-1)  # (B,)
    rewarded = torch.tensor(REWARDS * len(groups)).bool()
    assert (trained.logprobs - base.logprobs).detach()[mask].abs().max().item() > 1e-2
    assert change[rewarded].mean() > change[~rewarded].mean()


def test_two_fsdp_ranks_make_the_one_process_step(smollm2, smollm2_groups, tmp_path):
    """One GRPO step, full fine-tuning: `learner.ranks = 2` (FSDP2 over gloo, one group per
    rank) against one process with both groups, from the same weights: SmolLM2's first 12 of 30
    layers (what is sharded and how is the model's: its modules, its tied embedding; the depth
    only multiplied the time)."""
    model, tok = smollm2
    model = first_layers(model, 12, tmp_path)
    cfg = run_config(tmp_path)
    algo, groups = algo_params(cfg), with_rewards(smollm2_groups, REWARDS)
    one = build_learner(cfg, copy.deepcopy(model), tok.pad_token_id)
    grads = capture_grads(one)
    ranked_cfg = run_config(tmp_path, "learner.ranks=2", "learner.strategy='fsdp'")
    ranked = start_ranks(ranked_cfg, copy.deepcopy(model), tok.pad_token_id, Tracer())
    try:
        want = one.train_iteration(iter(score(groups, algo)), len(groups))
        got = ranked.train_iteration(iter(score(groups, algo)), len(groups))
    finally:
        ranked.close()
    assert got["learner_ranks"] == 2 and got["optimizer_steps"] == want["optimizer_steps"] == 1
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-7)
    want_params = {k: v.detach() for k, v in one.model.named_parameters()}
    got_params = {k: v.detach() for k, v in ranked.model.named_parameters()}
    assert_same_params(got_params, want_params, grads)
    moved = max((want_params[k] - p).abs().max().item() for k, p in model.named_parameters())
    assert moved > 0.5 * cfg.train.lr  # Adam's first step moves by about lr: it did step
