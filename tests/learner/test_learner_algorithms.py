"""The learner with the losses, estimators and shaping ported from verl and TRL."""

import copy
import math

import pytest
import torch
from rollouts import Recorder, older_behaviour, sample_groups, split_params, train

from cadence.algo import grpo_advantages, reinforce_pp_advantages
from cadence.learner import Learner, Scorer
from updates import assert_same_update, capture_grads


def _learner(model, tokenizer, loss_kw=None, version=0, **kw):
    params, algo = split_params(lr=1e-2, max_policy_tokens=10, **(loss_kw or {}), **kw)
    learner = Learner(model, params, algo, tokenizer.pad_token_id)
    learner.version = version
    return learner


def _stale_groups(model, tokenizer):
    """Groups whose behaviour policy is older, for a learner at version 1: ratio exp(0.1) = 1.105
    (inside PPO's clip range) on groups 0-1, exp(0.3) = 1.35 (beyond it) on groups 2-3; a spread
    of rewards in each group."""
    groups = sample_groups(model, tokenizer)
    older_behaviour(groups[:2], 0.1)
    older_behaviour(groups[2:], 0.3)
    for i, g in enumerate(groups):
        for j, c in enumerate(g.completions):
            c.reward = float((i + j) % 3) / 2
    return groups


@pytest.mark.parametrize(
    ("kw", "loss_kw"),
    [
        ({"loss": "gspo", "loss_agg": "seq-mean"}, {}),
        ({"loss": "gspo", "loss_agg": "token-mean"}, {}),
        ({"loss": "cispo"}, {"clip_low": 1.0, "clip_high": 0.28}),
        ({"loss": "ppo_clip"}, {"clip_ratio_c": 1.2}),
        ({"advantage": "reinforce_pp", "loss_agg": "seq-mean"}, {}),
        ({"advantage": "reinforce_pp_baseline"}, {}),
    ],
    ids=["gspo-seq-mean", "gspo-token-mean", "cispo", "dual-clip", "rf++", "rf++-baseline"],
)
def test_new_algorithms_update_independently_of_micro_batching(model, tokenizer, kw, loss_kw):
    groups = _stale_groups(model, tokenizer)  # every row stale: old = behaviour
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    la = _learner(a, tokenizer, loss_kw, version=1, micro_batch_groups=1, **kw)
    lb = _learner(b, tokenizer, loss_kw, version=1, micro_batch_groups=4, **kw)
    ga, gb = capture_grads(la), capture_grads(lb)
    sa = train(la, list(reversed(groups)))
    sb = train(lb, groups)
    assert_same_update(a, b, ga[0], gb[0])
    for key in ("loss", "clip_frac", "ratio"):
        assert sa[key] == pytest.approx(sb[key], rel=1e-5, abs=1e-7), key
    assert 0 < sa["clip_frac"] < 1  # the clip range cut some tokens, not all
    if loss_kw.get("clip_ratio_c"):  # ratio 1.35 > c = 1.2 under A < 0: dual-clipped
        assert 0 < sa["dual_clip_frac"] < 1
    pairs = zip(a.parameters(), model.parameters(), strict=True)
    moved = max((p - q).abs().max().item() for p, q in pairs)
    assert moved > 1e-4  # the update itself is not trivially zero


def test_reinforce_pp_normalises_over_every_group_of_the_iteration(model, tokenizer):
    groups = _stale_groups(model, tokenizer)
    learner = _learner(model, tokenizer, advantage="reinforce_pp", micro_batch_groups=1)
    rec = Recorder(learner)
    train(learner, groups)
    assert len(rec.batches) == 4  # one group per micro-batch...
    seen = torch.cat([b.advantages for b in rec.batches])  # (16,)
    # ...yet each carries the advantages over all 16 responses' tokens, not its own group's
    rewards = torch.tensor([g.rewards for g in groups])  # (4, 4)
    lengths = torch.tensor([[len(c.token_ids) for c in g.completions] for g in groups])
    expected = reinforce_pp_advantages(rewards, lengths).flatten()
    torch.testing.assert_close(seen, expected, atol=1e-6, rtol=0)
    per_group = torch.cat(
        [reinforce_pp_advantages(r[None], n[None]) for r, n in zip(rewards, lengths, strict=True)]
    )
    assert (seen - per_group.flatten()).abs().max() > 1e-3  # a per-group statistic differs


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean", "seq-sum-norm"])
def test_clip_frac_is_the_token_weighted_fraction_in_every_mode(model, tokenizer, agg):
    groups = _stale_groups(model, tokenizer)
    learner = _learner(model, tokenizer, version=1, loss_agg=agg)
    rec = Recorder(learner)
    stats = train(learner, groups)
    # PPO (range [0.8, 1.2]) clips the tokens of ratio 1.35 with A > 0, and nothing else
    clipped = tokens = 0.0
    for b in rec.batches:
        mask = b.loss_mask.bool()
        ratio = torch.exp(b.logprobs.detach() - b.old_logprobs)  # (B, T)
        clipped += (mask & (ratio > 1.2) & (b.advantages[:, None] > 0)).sum().item()
        tokens += mask.sum().item()
    assert 0 < clipped < tokens
    assert stats["clip_frac"] == pytest.approx(clipped / tokens, abs=1e-6)


def test_an_extreme_stale_log_prob_no_longer_skips_the_step(model, tokenizer):
    groups = _stale_groups(model, tokenizer)
    first = groups[0].completions[0]
    first.logprobs = [-100.0, *first.logprobs[1:]]  # log-ratio about 100 on one token
    learner = _learner(copy.deepcopy(model), tokenizer, version=1)
    stats = train(learner, groups)
    # before the clamp: NaN gradient (A > 0) or infinite loss (A < 0), a skipped step
    assert stats["skipped_steps"] == 0 and math.isfinite(stats["loss"])
    assert math.isfinite(stats["grad_norm"])
    tokens = stats["num_response_tokens"]
    assert stats["ratio_clamped_frac"] == pytest.approx(1 / tokens, abs=1e-9)


def _truncate_first_of_each_group(groups):
    for g in groups:
        for j, c in enumerate(g.completions):
            c.finish_reason = "length" if j == 0 else "eos"


def test_mask_truncated_drops_cut_responses_from_the_loss_not_from_advantages(model, tokenizer):
    groups = _stale_groups(model, tokenizer)
    _truncate_first_of_each_group(groups)
    learner = _learner(model, tokenizer, loss_agg="seq-mean", mask_truncated=True)
    rec = Recorder(learner)
    stats = train(learner, groups)
    (batch,) = rec.batches
    dropped = torch.tensor([j == 0 for g in groups for j in range(g.group_size)])  # (16,)
    assert (batch.loss_mask[dropped] == 0).all() and (batch.loss_mask[~dropped].sum(-1) > 0).all()
    # the advantages still come from all four responses of each group
    rewards = torch.tensor([g.rewards for g in groups])
    torch.testing.assert_close(batch.advantages, grpo_advantages(rewards).flatten())
    # a dropped response is an empty one to the loss: seq-mean still divides by all 16 (TRL's
    # mask_truncated_completions under its "grpo" loss)
    loss_sum, _ = learner.forward.loss_fn.inner(batch, learner.algo)
    assert stats["loss"] == pytest.approx(loss_sum.item() / 16, rel=1e-5)
    assert stats["truncated_frac"] == pytest.approx(4 / 16)


def test_mask_truncated_with_every_response_cut_steps_with_zero_gradient(model, tokenizer):
    groups = _stale_groups(model, tokenizer)
    for g in groups:
        for c in g.completions:
            c.finish_reason = "length"
    learner = _learner(copy.deepcopy(model), tokenizer, mask_truncated=True)
    grads = capture_grads(learner)
    stats = train(learner, groups)
    assert stats["skipped_steps"] == 0 and stats["num_response_tokens"] == 0
    assert all((g == 0).all() for g in grads[0].values())


def test_overlong_penalty_shapes_the_rewards_advantages_come_from(model, tokenizer):
    groups = _stale_groups(model, tokenizer)
    raw = torch.tensor([g.rewards for g in groups])  # (4, 4)
    lengths = torch.tensor([[len(c.token_ids) for c in g.completions] for g in groups])
    learner = _learner(model, tokenizer, overlong_buffer=4, overlong_penalty=0.5)
    scorer = Scorer(learner.algo)
    rec = Recorder(learner)
    stats = train(learner, groups, scorer)
    # max_policy_tokens 10, buffer 4: -0.5 * (|y| - 6) / 4 beyond 6 tokens (-0.5 at 10)
    penalty = -0.5 * ((lengths - 6).clamp(min=0) / 4)  # (4, 4)
    assert (penalty < 0).any()
    (batch,) = rec.batches
    torch.testing.assert_close(batch.rewards, (raw + penalty).flatten())
    torch.testing.assert_close(batch.advantages, grpo_advantages(raw + penalty).flatten())
    assert torch.equal(torch.tensor([g.rewards for g in groups]), raw)  # recorded: still raw
    assert stats["reward_shaped_mean"] == pytest.approx((raw + penalty).mean().item(), abs=1e-6)
    assert stats["overlong_penalty_mean"] == pytest.approx(penalty.mean().item(), abs=1e-6)
    assert scorer.baseline == pytest.approx((raw + penalty).mean().item(), abs=1e-6)
