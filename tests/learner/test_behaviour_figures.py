"""The behaviour figures: |engine's log-prob - learner's log-prob| on fresh rows before the
iteration's first step (mean token-weighted, max the largest), and the partial weight reload they
catch."""

import copy
import math

import pytest
import torch
from rollouts import sample_groups, split_params, train

from cadence.learner import Learner
from cadence.learner.sums import BEHAVIOUR_FIGURES

MEAN, MAX, RATIO = BEHAVIOUR_FIGURES


def _learner(model, tokenizer, **kw):
    params, algo = split_params(lr=1e-2, max_policy_tokens=10, kl_coef=0.0, **kw)
    return Learner(model, params, algo, tokenizer.pad_token_id)


def _shift(completion, delta):
    completion.logprobs = [lp + delta for lp in completion.logprobs]
    return len(completion.token_ids)


def test_samples_of_the_learners_own_policy_differ_by_float_noise(model, tokenizer):
    groups = sample_groups(model, tokenizer)  # the static engine on the learner's very model
    stats = train(_learner(model, tokenizer, micro_batch_groups=2), groups)
    assert 0.0 <= stats[MEAN] <= stats[MAX] < 1e-4  # fp32: observed max 4.8e-7


def test_the_first_steps_ratio_is_one_on_policy_and_measured_only_where_it_can_differ(
    model, tokenizer
):
    """A learning gate: before the first optimizer step pi_old is the policy, so the loss's
    ratio is 1 on every fresh token within float32 noise from a pass of its own; reused (the
    policy's own log-probs, detached) it is 1 by construction, and not reported."""
    groups = sample_groups(model, tokenizer)
    kw = {"reuse_old_logprobs": False, "mini_batches": 2}
    stats = train(_learner(model, tokenizer, micro_batch_groups=1, **kw), groups)
    assert 0.0 <= stats[RATIO] <= 1e-6
    assert RATIO not in train(_learner(model, tokenizer, micro_batch_groups=1), groups)


def test_a_ratio_off_one_at_the_first_step_shows_in_the_gate(model, tokenizer):
    """Under the bypass pi_old is the behaviour policy: an engine 0.5 nats off shows."""
    groups = sample_groups(model, tokenizer)
    _shift(groups[0].completions[0], -0.5)
    stats = train(_learner(model, tokenizer, correction_proximal="bypass"), groups)
    assert stats[RATIO] == pytest.approx(math.exp(0.5) - 1, rel=1e-4)


def test_only_fresh_rows_before_the_first_step_count_a_max_and_a_token_weighted_mean(
    model, tokenizer
):
    groups = sample_groups(model, tokenizer, n=6)  # sampled by `model`
    for g in groups:
        g.policy_version = 1  # the learner below is at version 1 with these very weights: fresh
    # step 1 trains groups 0-2 in three micro-batches, step 2 groups 3-5 (two mini-batches)
    n0 = _shift(groups[0].completions[0], 0.5)  # fresh, micro-batch 1
    n1 = _shift(groups[1].completions[2], 0.25)  # fresh, micro-batch 2
    groups[2].policy_version = 0  # stale: its behaviour policy is not the policy
    for c in groups[2].completions:
        _shift(c, -3.0)
    for c in groups[3].completions:  # fresh, but trained after the first step
        _shift(c, -2.0)
    assert n0 > 0 and n1 > 0
    learner = _learner(model, tokenizer, micro_batch_groups=1, mini_batches=2)
    learner.version = 1
    stats = train(learner, groups)
    assert stats["optimizer_steps"] == 2
    fresh_tokens = sum(len(c.token_ids) for g in groups[:2] for c in g.completions)
    # the largest over the micro-batches; the mean over every fresh token of step 1
    assert stats[MAX] == pytest.approx(0.5, abs=1e-5)
    assert stats[MEAN] == pytest.approx((0.5 * n0 + 0.25 * n1) / fresh_tokens, abs=1e-5)


def test_without_a_fresh_row_before_the_first_step_the_figures_are_absent(model, tokenizer):
    groups = sample_groups(model, tokenizer, n=2)  # version 0
    learner = _learner(model, tokenizer)
    learner.version = 1  # every group stale
    stats = train(learner, groups)
    assert not set(BEHAVIOUR_FIGURES) & set(stats)
    assert stats["stale_token_frac"] == 1.0


def test_a_weight_reload_that_leaves_one_tensor_stale_shows_in_the_figures(model, tokenizer):
    # the rollout side holds its own copy of the weights (separate placement, vLLM): after an
    # update every tensor but one reaches it, as a reload that only warns about one it missed
    before = copy.deepcopy(model)
    with torch.no_grad():
        torch.manual_seed(1)
        for p in model.parameters():  # the learner's new weights
            p.add_(torch.randn_like(p) * 0.05)
    missed = "model.layers.1.mlp.down_proj.weight"
    figures = {}
    for skip in (None, missed):
        rollout_model = copy.deepcopy(before)
        new = {k: v for k, v in model.state_dict().items() if k != skip}
        rollout_model.load_state_dict(new, strict=skip is None)
        groups = sample_groups(rollout_model, tokenizer)
        figures[skip] = train(_learner(copy.deepcopy(model), tokenizer), groups)
    assert figures[None][MAX] < 1e-4  # every tensor loaded: float noise (observed max 9.5e-7)
    assert figures[missed][MAX] > 1e-2  # one stale layer (observed mean 0.17, max 0.61)
    assert figures[missed][MEAN] > 100 * figures[None][MEAN]
