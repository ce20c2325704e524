"""The learner with a rollout correction: which log-probs are old (decoupled or bypass), the
passes that costs, and verl's figures summed over micro-batches and optimizer steps."""

import math

import pytest
import torch
from rollouts import Recorder, older_behaviour, sample_groups, train

from cadence.algo import CORRECTION_FIGURES, CORRECTION_MAXIMA, AlgoParams
from cadence.learner import Learner, LearnerParams, StepSums, score


def _learner(model, tokenizer, params=None, **algo):
    params = params or LearnerParams(lr=1e-2, micro_batch_groups=1)
    learner = Learner(
        model, params, AlgoParams(max_policy_tokens=10, **algo), tokenizer.pad_token_id
    )
    learner.version = 1  # the groups, tagged version 0, are one version old
    return learner


def _k3(d):
    return math.exp(d) - 1 - d


def test_decoupled_figures_are_summed_over_micro_batches(model, tokenizer):
    groups = sample_groups(model, tokenizer)  # sampled by these very weights
    older_behaviour(groups[:2], 0.5)  # rho = pi_old / pi_behaviour = e^0.5 on every token
    older_behaviour(groups[2:], 1.0)  # and e^1
    mode = {"rollout_correction": "token_mask", "correction_clip_max": 2.0}
    learner = _learner(model, tokenizer, **mode)
    rec = Recorder(learner)
    stats = train(learner, groups)  # four micro-batches of one group each, one step
    assert len(rec.batches) == 4
    tokens = [int(b.loss_mask.sum()) for b in rec.batches]  # (4,)
    responses = [int((b.loss_mask.sum(-1) > 0).sum()) for b in rec.batches]  # (4,)
    n1, n2, n = sum(tokens[:2]), sum(tokens[2:]), sum(tokens)
    a, b = math.exp(0.5), math.e
    # up to engine-vs-learner float noise (measured: ratios within 5e-7 relative):
    tol = 1e-5
    assert stats["rollout_is_mean"] == pytest.approx((n1 * a + n2 * b) / n, rel=tol)
    assert stats["rollout_is_min"] == pytest.approx(a, rel=tol)
    assert stats["rollout_is_max"] == pytest.approx(b, rel=tol)
    ess = (n1 * a + n2 * b) ** 2 / (n * (n1 * a * a + n2 * b * b))
    assert stats["rollout_is_eff_sample_size"] == pytest.approx(ess, rel=tol)
    # e^1 = 2.72 is outside the band [0, 2]: the second half's tokens are masked
    assert stats["rollout_rs_masked_fraction"] == pytest.approx(n2 / n, abs=1e-9)
    assert stats["k3_kl"] == pytest.approx((n1 * _k3(0.5) + n2 * _k3(1.0)) / n, rel=tol)
    # each response's mean log-ratio is 0.5 or 1; the mean over responses with a token
    ppl = (0.5 * sum(responses[:2]) + 1.0 * sum(responses[2:])) / sum(responses)
    assert stats["log_ppl_abs_diff"] == pytest.approx(ppl, rel=tol)


def test_extremes_over_steps_are_the_largest_and_smallest(model, tokenizer):
    groups = sample_groups(model, tokenizer)
    older_behaviour(groups[:2], 0.5)  # the first optimizer step's groups
    older_behaviour(groups[2:], 1.0)  # the second's
    params = LearnerParams(lr=1e-2, micro_batch_groups=1, mini_batches=2)
    learner = _learner(model, tokenizer, params, rollout_correction="token_truncate")
    stats = train(learner, groups)
    assert stats["optimizer_steps"] == 2
    # the old copy holds the sampling weights after the first step: rho stays e^0.5, e^1
    assert stats["rollout_is_min"] == pytest.approx(math.exp(0.5), rel=1e-5)
    assert stats["rollout_is_max"] == pytest.approx(math.exp(1.0), rel=1e-5)
    # every other figure is the steps' mean: each step's ratios are all equal, ESS 1
    assert stats["rollout_is_mean"] == pytest.approx((math.exp(0.5) + math.e) / 2, rel=1e-5)
    assert stats["rollout_is_eff_sample_size"] == pytest.approx(1.0, rel=1e-5)
    assert stats["k3_kl"] == pytest.approx((_k3(0.5) + _k3(1.0)) / 2, rel=1e-5)
    # e^0.5 < 3 and e^1 < 3: token_truncate cuts nothing and weighs like tis_cap did
    assert stats["tis_trunc_frac"] == 0.0 and stats["rollout_rs_masked_fraction"] == 0.0


def test_bypass_takes_the_behaviour_logprobs_as_old_for_every_row_without_an_old_pass(
    model, tokenizer
):
    groups = sample_groups(model, tokenizer)
    older_behaviour(groups[1::2], 0.3)
    for g in groups[0::2]:
        g.policy_version = 1  # fresh rows too take the behaviour log-probs
    params = LearnerParams(lr=1e-2, micro_batch_groups=2, mini_batches=2)
    learner = _learner(model, tokenizer, params, correction_proximal="bypass")
    assert learner.forward.old_model is None  # a second step needs no frozen old copy
    rec = Recorder(learner)
    stats = train(learner, groups)
    for batch in rec.batches:
        assert torch.equal(batch.old_logprobs, batch.behaviour_logprobs)
    assert stats["forward_passes_per_microbatch"] == 1.0 and stats["frozen_copies_mb"] == 0.0
    # the figures compare the policy itself with the behaviour: e^0.3 on the shifted half
    # before the first step, so the largest ratio is at least that
    assert stats["rollout_is_max"] >= math.exp(0.3) * (1 - 1e-5)
    decoupled = _learner(model, tokenizer, params, rollout_correction="token_mask")
    assert decoupled.forward.old_model is not None  # the decoupled correction does need it


def test_an_idle_pass_records_the_correction_sums_and_maxima_as_zero(model, tokenizer):
    learner = _learner(model, tokenizer, rollout_correction="icepop", correction_clip_min=0.5)
    groups = score(sample_groups(model, tokenizer)[:1], learner.algo)
    real, idle = StepSums(), StepSums()
    learner.forward_backward(groups, real)
    learner.forward_backward(groups, idle, idle=True)
    assert set(CORRECTION_MAXIMA) <= real.maxima.keys() == idle.maxima.keys()
    assert idle.values.keys() == real.values.keys() and set(idle.values.values()) == {0.0}
    assert set(idle.maxima.values()) == {0.0}
    figures = learner.step(real)
    assert set(CORRECTION_FIGURES) <= figures.keys()


def test_a_step_without_correction_tokens_is_left_out_of_the_correction_figures():
    from cadence.learner.sums import TOTALS, iteration_stats

    zeros = dict.fromkeys(CORRECTION_FIGURES, 0.0)
    corrected = zeros | {"rollout_is_min": 0.8, "rollout_is_max": 1.3, "rollout_is_mean": 1.05}
    steps = [
        dict.fromkeys(TOTALS, 1.0) | corrected | {"num_correction_tokens": 10.0, "loss": 1.0},
        dict.fromkeys(TOTALS, 1.0) | zeros | {"num_correction_tokens": 0.0, "loss": 3.0},
    ]
    stats = iteration_stats(steps, frozen_copies_bytes=0)
    assert stats["rollout_is_min"] == 0.8  # not the idle step's 0
    assert (stats["rollout_is_max"], stats["rollout_is_mean"]) == (1.3, 1.05)
    assert stats["loss"] == 2.0 and stats["num_correction_tokens"] == 10.0  # others: every step
    idle = iteration_stats(steps[1:], frozen_copies_bytes=0)  # no step had any: 0, as before
    assert idle["rollout_is_min"] == 0.0
