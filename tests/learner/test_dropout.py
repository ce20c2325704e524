"""Dropout never reaches the signal: engines decode in eval mode whatever mode the learner left
its model in, and the learner turns dropout off (learner.disable_dropout, TRL's default for RL).
Before, with a LoRA dropout of 0.5 the same request and seed gave log-probs 0.3 apart."""

import copy

import torch
from rollouts import sample_groups

from cadence.algo import AlgoParams
from cadence.engine import ContinuousEngine, HFEngine, Request, SamplingParams
from cadence.learner import Learner, LearnerParams, score
from cadence.models.lora import LoraSpec, apply_lora


def _lora(model, dropout=0.5):
    policy = apply_lora(copy.deepcopy(model), LoraSpec(4, 8.0, dropout, ("q_proj", "v_proj")))
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05)
    return policy.train()  # as a learner leaves it


def test_engines_decode_a_model_left_in_train_mode_without_dropout(model, tokenizer):
    policy = _lora(model)
    ids = tokenizer("Question: What is 2 + 3?\nAnswer: ", add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    for make in (ContinuousEngine, HFEngine):
        engine = make(policy, tokenizer)
        a = engine.generate([Request(ids, [7, 8])], params)[0]
        b = engine.generate([Request(ids, [7, 8])], params)[0]
        assert [c.logprobs for c in a] == [c.logprobs for c in b]
        assert policy.training  # its mode is given back


def test_the_learners_first_ratio_is_one_under_a_lora_dropout(model, tokenizer):
    policy = _lora(model)
    same = copy.deepcopy(policy)
    groups = sample_groups(policy, tokenizer)
    algo = AlgoParams(max_policy_tokens=10, kl_coef=0.0)
    learner = Learner(policy, LearnerParams(lr=1e-3), algo, tokenizer.pad_token_id)
    stats = learner.train_iteration(iter(score(groups, algo)), len(groups))
    assert stats["behaviour_logprob_abs_diff_max"] < 1e-4  # the engine's and the learner's agree
    kept = Learner(
        same, LearnerParams(lr=1e-3, disable_dropout=False), algo, tokenizer.pad_token_id
    )
    off = kept.train_iteration(iter(score(groups, algo)), len(groups))
    assert off["behaviour_logprob_abs_diff_max"] > 1e-2  # dropout on: the test can fail


def test_the_first_steps_ratio_is_measured_only_where_it_can_fail(model, tokenizer):
    # reused, pi_old is the policy's own log-probs detached: the ratio is 1 by construction and
    # was reported as 0 even with dropout at 0.5; from a pass of its own it shows the dropout
    policy = _lora(model)
    groups = sample_groups(policy, tokenizer)
    algo = AlgoParams(max_policy_tokens=10, kl_coef=0.0)

    def first_ratio(**kw):
        params = LearnerParams(lr=1e-3, **kw)
        learner = Learner(copy.deepcopy(policy), params, algo, tokenizer.pad_token_id)
        stats = learner.train_iteration(iter(score(groups, algo)), len(groups))
        return stats.get("first_step_ratio_abs_dev_max")

    assert first_ratio(disable_dropout=False) is None  # reused: nothing to measure
    assert first_ratio(reuse_old_logprobs=False) <= 1e-6  # a pass of its own, no dropout
    assert first_ratio(reuse_old_logprobs=False, disable_dropout=False) > 1e-2  # teeth
