import copy
import math

import pytest
import torch
from rollouts import Recorder, older_behaviour, sample_groups, split_params, train

from cadence.algo import AlgoParams
from cadence.learner import Learner, LearnerParams, frozen_copy
from cadence.rewards import TableReward
from updates import assert_same_update, capture_grads, max_relative_diff


def _learner(model, tokenizer, kl_coef=0.1, **kw):
    ref = copy.deepcopy(model).requires_grad_(False) if kl_coef > 0 else None
    params, algo = split_params(lr=1e-2, max_policy_tokens=10, kl_coef=kl_coef, **kw)
    return ref, Learner(model, params, algo, tokenizer.pad_token_id, ref)


def _train(model, tokenizer, groups, **kw):
    _, learner = _learner(model, tokenizer, **kw)
    return train(learner, groups), learner


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean", "seq-sum-norm"])
def test_update_does_not_depend_on_micro_batch_size(model, tokenizer, agg):
    groups = sample_groups(model, tokenizer)
    assert any(len(set(g.rewards)) > 1 for g in groups)  # some signal to learn from
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    _, la = _learner(a, tokenizer, micro_batch_groups=1, loss_agg=agg)
    _, lb = _learner(b, tokenizer, micro_batch_groups=4, loss_agg=agg)
    ga, gb = capture_grads(la), capture_grads(lb)
    train(la, list(reversed(groups)))
    train(lb, groups)
    assert_same_update(a, b, ga[0], gb[0])
    changed = max(
        (pa - p0).abs().max().item()
        for pa, p0 in zip(a.parameters(), model.parameters(), strict=True)
    )
    assert changed > 1e-4  # the update itself is not trivially zero


@pytest.mark.parametrize(  # each aggregation once, each budget at least once
    ("budget", "agg"), [(14, "token-mean"), (30, "seq-mean"), (14, "seq-sum-norm")]
)
def test_update_does_not_depend_on_a_token_budget_that_splits_groups(model, tokenizer, agg, budget):
    # prompts of about 12 tokens, responses up to 10: a 14-token budget splits every group
    # into parts of one or two responses, a 30-token budget packs parts of groups together
    from cadence.learner import score
    from cadence.learner.steps import cost, token_chunks

    groups = sample_groups(model, tokenizer)
    chunks = list(token_chunks(score(groups, AlgoParams()), len(groups), 1, budget, False))
    parts = [s for chunk, _ in chunks for s in chunk]
    assert len(parts) > len(groups)  # groups were split
    assert all(cost(chunk) <= budget or len(chunk) == 1 for chunk, _ in chunks)
    for layout in ("prefix", "dense", "unpacked"):  # the budget bounds what each computes
        padded = list(token_chunks(score(groups, AlgoParams()), len(groups), 1, 30, False, layout))
        assert all(cost(c, layout) <= 30 or len(c) == 1 for c, _ in padded)
    assert [c for s in parts for c in s.group.completions] == [
        c for g in groups for c in g.completions
    ]
    # a pair loss keeps its groups whole: best and worst must meet in one micro-batch
    whole = token_chunks(score(groups, AlgoParams()), len(groups), 1, budget, True)
    assert [s.group for chunk, _ in whole for s in chunk] == groups
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    _, la = _learner(a, tokenizer, micro_batch_tokens=budget, loss_agg=agg)
    _, lb = _learner(b, tokenizer, micro_batch_groups=4, loss_agg=agg)
    ga, gb = capture_grads(la), capture_grads(lb)
    stats_a, stats_b = train(la, groups), train(lb, groups)
    assert stats_a["tokens_computed"] > stats_b["tokens_computed"]  # a part repeats its prompt
    assert stats_a["num_tokens"] == stats_b["num_tokens"]  # a split group is counted once
    assert_same_update(a, b, ga[0], gb[0])


def test_rloo_under_a_token_budget_makes_the_update_it_makes_without_one(model, tokenizer):
    # rloo's baseline is the mean of the other responses of the group: a budget that split a
    # group computed it from the part alone (another update), and a one-response part raised
    groups = sample_groups(model, tokenizer)
    assert any(len(set(g.rewards)) > 1 for g in groups)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    _, la = _learner(a, tokenizer, kl_coef=0.0, loss="rloo", micro_batch_tokens=14)
    _, lb = _learner(b, tokenizer, kl_coef=0.0, loss="rloo", micro_batch_groups=4)
    ga, gb = capture_grads(la), capture_grads(lb)
    stats = train(la, groups)
    train(lb, groups)
    assert stats["optimizer_steps"] == 1
    assert_same_update(a, b, ga[0], gb[0])


def test_one_optimizer_step_per_iteration_and_version_advances(model, tokenizer):
    groups = sample_groups(model, tokenizer)
    stats, learner = _train(model, tokenizer, groups)
    assert stats["optimizer_steps"] == 1 and learner.version == 1
    stats, learner = _train(copy.deepcopy(model), tokenizer, groups, mini_batches=2)
    assert stats["optimizer_steps"] == 2
    expected_tokens = sum(g.num_tokens for g in groups)
    assert stats["num_tokens"] == expected_tokens
    for key in ("loss", "kl", "entropy", "grad_norm", "clip_frac"):
        assert torch.isfinite(torch.tensor(stats[key])), key


def _checksum(model):
    return sum(float(v.double().sum()) * (i + 1) for i, v in enumerate(model.state_dict().values()))


def test_reference_is_a_frozen_copy_whose_checksum_never_changes(model, tokenizer):
    groups = sample_groups(model, tokenizer)
    ref, learner = _learner(model, tokenizer)
    before = _checksum(ref)
    optimized = {id(p) for g in learner.optimizer.param_groups for p in g["params"]}
    for _ in range(3):
        train(learner, groups)
        assert _checksum(ref) == before
        assert all(p.grad is None and not p.requires_grad for p in ref.parameters())
        assert not optimized & {id(p) for p in ref.parameters()}
    assert _checksum(model) != before  # the policy did move
    assert not learner.optimizer.state.keys() & set(ref.parameters())


@pytest.mark.parametrize("reuse", [True, False])
def test_ratio_is_one_on_the_first_micro_batch(model, tokenizer, reuse):
    groups = sample_groups(model, tokenizer)
    _, learner = _learner(model, tokenizer, micro_batch_groups=2, reuse_old_logprobs=reuse)
    rec = Recorder(learner)
    stats = train(learner, groups)
    first = rec.batches[0]
    mask = first.loss_mask.bool()
    ratio = torch.exp(first.logprobs.detach() - first.old_logprobs)[mask]
    assert (ratio - 1).abs().max().item() <= 1e-6
    # reusing costs no pass (policy + reference); the frozen old copy costs one more
    assert stats["forward_passes_per_microbatch"] == (2.0 if reuse else 3.0)
    assert (first.old_logprobs is not None) and not first.old_logprobs.requires_grad


def test_mini_batches_take_old_logprobs_from_the_iteration_start_policy(model, tokenizer):
    groups = sample_groups(model, tokenizer)
    start = copy.deepcopy(model)
    _, learner = _learner(model, tokenizer, kl_coef=0.0, micro_batch_groups=2, mini_batches=2)
    rec = Recorder(learner)
    stats = train(learner, groups)
    assert stats["optimizer_steps"] == 2 and len(rec.batches) == 2
    # micro-batch 0 precedes any step (old = policy, no pass); micro-batch 1 follows one step
    assert stats["forward_passes_per_microbatch"] == 1.5
    second = rec.batches[1]
    _, check = _learner(start, tokenizer, kl_coef=0.0, micro_batch_groups=2)
    want = Recorder(check)
    train(check, groups)  # computes the start policy's log-probs
    mask = second.loss_mask.bool()
    old, at_start = second.old_logprobs[mask], want.batches[1].logprobs.detach()[mask]
    assert (old - at_start).abs().max().item() <= 1e-5
    assert (second.logprobs.detach()[mask] - old).abs().max().item() > 1e-4  # the policy moved


def test_frozen_copies_memory_is_reported(model, tokenizer):
    groups = sample_groups(model, tokenizer)
    size = sum(p.numel() * 4 for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )
    stats, _ = _train(copy.deepcopy(model), tokenizer, groups)
    assert stats["frozen_copies_mb"] == pytest.approx(size / 2**20)  # the reference
    stats, _ = _train(copy.deepcopy(model), tokenizer, groups, mini_batches=2)
    assert stats["frozen_copies_mb"] == pytest.approx(2 * size / 2**20)  # reference + old copy


def test_kl_coef_without_reference_is_refused(model, tokenizer):
    with pytest.raises(ValueError, match="reference"):
        Learner(model, LearnerParams(), AlgoParams(kl_coef=0.1), tokenizer.pad_token_id)


def test_table_reward_drives_constant_groups_to_zero_advantage(model, tokenizer):
    # every completion scores 0.5: GRPO advantages are all 0, so the policy loss is 0
    groups = sample_groups(model, tokenizer)
    for g in groups:
        for c in g.completions:
            c.reward = TableReward({}, default=0.5)("", c.text, "")
    stats, _ = _train(copy.deepcopy(model), tokenizer, groups)
    assert stats["pg_loss"] == pytest.approx(0.0, abs=1e-7)


# --- stale groups, truncated importance sampling, rloo and online DPO --------------------------


def _rows(groups):
    return sum(g.group_size for g in groups)


def test_stale_rows_take_behaviour_logprobs_fresh_rows_the_policy(model, tokenizer):
    groups = sample_groups(model, tokenizer)  # sampled by `model`, tagged version 0
    for g in groups:
        for j, c in enumerate(g.completions):
            c.reward = float(j % 2)  # GRPO advantages +-1 in every group
    for g in groups[0::2]:
        g.policy_version = 1  # the learner below is at version 1 with these very weights: fresh
    older_behaviour(groups[1::2], 0.5)  # groups 1 and 3 are stale: version 0 < 1
    _, learner = _learner(model, tokenizer, kl_coef=0.0, micro_batch_groups=4)
    learner.version = 1
    rec = Recorder(learner)
    stats = train(learner, groups)
    (batch,) = rec.batches  # one micro-batch, fresh and stale groups interleaved
    mask = batch.loss_mask.bool()
    stale = torch.tensor([g.policy_version == 0 for g in groups for _ in g.completions])  # (B,)
    fresh = ~stale
    ratio = torch.exp(batch.logprobs.detach() - batch.old_logprobs)  # (B, T)
    # fresh rows: old = the policy, detached, so the ratio is 1
    assert (ratio[fresh][mask[fresh]] - 1).abs().max().item() <= 1e-6
    # stale rows: old = the recorded behaviour log-probs, exactly; the policy is the weights that
    # sampled them, so the ratio is exp(0.5) = 1.648721 up to engine-vs-learner float noise
    assert torch.equal(batch.old_logprobs[stale], batch.behaviour_logprobs[stale])
    assert (ratio[stale][mask[stale]] - math.exp(0.5)).abs().max().item() <= 1e-3
    n_fresh, n_stale = mask[fresh].sum().item(), mask[stale].sum().item()
    n = n_fresh + n_stale
    assert stats["stale_token_frac"] == pytest.approx(n_stale / n)
    # token-mean ratio: (n_fresh * 1 + n_stale * 1.648721) / n
    assert stats["ratio"] == pytest.approx((n_fresh + n_stale * math.exp(0.5)) / n, abs=1e-3)
    # clip range [0.8, 1.2]: a stale token with A > 0 is clipped (1.65 > 1.2); with A < 0 the
    # pessimistic min keeps the unclipped term; fresh tokens (ratio 1) never clip
    positive = (batch.advantages > 0)[:, None] & stale[:, None] & mask  # (B, T)
    assert positive.any()
    assert stats["clip_frac"] == pytest.approx(positive.sum().item() / n, abs=1e-6)


def test_tis_keeps_the_policy_as_old_and_weighs_by_old_over_behaviour(model, tokenizer):
    groups = sample_groups(model, tokenizer)  # version 0; the learner below is at version 1
    older_behaviour(groups[:2], 0.5)  # weight exp(0.5) = 1.648721 < cap 2: kept
    older_behaviour(groups[2:], 1.0)  # weight exp(1) = 2.718282 > cap 2: truncated to 2
    params = LearnerParams(lr=1e-2, micro_batch_groups=4)
    algo = AlgoParams(max_policy_tokens=10, tis_cap=2.0)
    learner = Learner(model, params, algo, tokenizer.pad_token_id)
    learner.version = 1
    rec = Recorder(learner)
    stats = train(learner, groups)
    (batch,) = rec.batches
    mask = batch.loss_mask.bool()
    ratio = torch.exp(batch.logprobs.detach() - batch.old_logprobs)[mask]
    assert (ratio - 1).abs().max().item() <= 1e-6  # old = the iteration-start policy everywhere
    first = _rows(groups[:2])
    n_kept, n_cut = mask[:first].sum().item(), mask[first:].sum().item()
    n = n_kept + n_cut
    assert stats["stale_token_frac"] == 1.0
    # token-mean weight (n_kept * 1.648721 + n_cut * 2) / n; truncated fraction n_cut / n
    expected = (n_kept * math.exp(0.5) + n_cut * 2.0) / n
    assert stats["tis_weight"] == pytest.approx(expected, abs=1e-3)
    assert stats["tis_trunc_frac"] == pytest.approx(n_cut / n, abs=1e-6)


def test_a_micro_batch_of_stale_groups_costs_no_old_policy_pass(model, tokenizer):
    groups = sample_groups(model, tokenizer)
    _, learner = _learner(model, tokenizer, kl_coef=0.0, micro_batch_groups=2, mini_batches=2)
    learner.version = 1  # every group is stale: old_logprobs are the behaviour log-probs
    stats = train(learner, groups)
    assert stats["forward_passes_per_microbatch"] == 1.0  # the policy's pass alone


def test_group_from_a_newer_policy_than_the_learner_is_refused(model, tokenizer):
    groups = sample_groups(model, tokenizer)
    groups[1].policy_version = 1
    _, learner = _learner(model, tokenizer, kl_coef=0.0)
    with pytest.raises(ValueError, match="newer than the learner's version 0"):
        train(learner, groups)


def test_rloo_loss_updates_like_pg_with_rloo_advantages(model, tokenizer):
    groups = sample_groups(model, tokenizer)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    _, la = _learner(a, tokenizer, kl_coef=0.0, loss="rloo", advantage="grpo")
    _, lb = _learner(b, tokenizer, kl_coef=0.0, loss="pg", advantage="rloo")
    ga, gb = capture_grads(la), capture_grads(lb)
    train(la, groups)
    train(lb, groups)
    assert max_relative_diff(ga[0], gb[0]) <= 1e-6


def _dpo_groups(model, tokenizer):
    """Four groups: the first three with a spread of rewards (a pair each), the last a tie."""
    groups = sample_groups(model, tokenizer)
    for i, g in enumerate(groups):
        for j, c in enumerate(g.completions):
            c.reward = 1.0 if i == 3 else float((i + j) % 3)
    return groups


def _dpo_learner(model, tokenizer, **kw):
    params, algo = split_params(
        lr=1e-2, max_policy_tokens=10, loss="online_dpo", dpo_beta=0.1, **kw
    )
    return Learner(model, params, algo, tokenizer.pad_token_id, frozen_copy(model))


def test_online_dpo_trains_the_tiny_model(model, tokenizer):
    groups = _dpo_groups(model, tokenizer)
    start = copy.deepcopy(model)
    learner = _dpo_learner(model, tokenizer, micro_batch_groups=2)
    stats = train(learner, groups)
    # before the step the policy is the reference: h = 0 for every pair, each pair's loss is
    # -log sigmoid(0) = ln 2, and the sum over 3 pairs divided by 3 pairs is ln 2 = 0.693147
    assert stats["loss"] == pytest.approx(math.log(2.0), abs=1e-6)
    assert stats["dpo_margin"] == pytest.approx(0.0, abs=1e-6)
    for _ in range(2):  # these groups are stale now: DPO takes them as they are
        stats = train(learner, groups)
        assert math.isfinite(stats["loss"]) and math.isfinite(stats["kl"])
        assert stats["num_pairs"] == 3 and stats["dpo_ties"] == 1
        assert stats["forward_passes_per_microbatch"] == 2.0  # policy + reference, no old pass
    pairs = zip(model.parameters(), start.parameters(), strict=True)
    moved = max((p - q).abs().max().item() for p, q in pairs)
    assert moved > 1e-4
    assert stats["dpo_margin"] != 0.0  # the policy has left the reference


def test_online_dpo_update_does_not_depend_on_micro_batch_size(model, tokenizer):
    groups = _dpo_groups(model, tokenizer)  # one pair per micro-batch, or three in one
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    la, lb = _dpo_learner(a, tokenizer, micro_batch_groups=1), _dpo_learner(b, tokenizer)
    ga, gb = capture_grads(la), capture_grads(lb)
    train(la, list(reversed(groups)))
    train(lb, groups)
    assert_same_update(a, b, ga[0], gb[0])


def test_online_dpo_without_reference_is_refused(model, tokenizer):
    algo = AlgoParams(loss="online_dpo")
    with pytest.raises(ValueError, match="'online_dpo' needs a reference model"):
        Learner(model, LearnerParams(), algo, tokenizer.pad_token_id)


def test_a_non_finite_step_is_skipped_and_too_many_in_a_row_stop_training(model, tokenizer):
    from cadence.learner import BadStepsError

    groups = sample_groups(model, tokenizer)
    _, learner = _learner(copy.deepcopy(model), tokenizer, max_bad_steps=1)
    poison = {"on": True}

    def nan_logits(module, args, output):  # a NaN in the forward: loss and gradients are NaN
        return output * math.nan if poison["on"] else output

    learner.model.lm_head.register_forward_hook(nan_logits)
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    stats = train(learner, groups)
    assert stats["skipped_steps"] == 1 and math.isnan(stats["loss"])
    assert learner.optimizer.state == {}  # Adam's moments untouched, not NaN
    for n, p in learner.model.named_parameters():
        assert torch.equal(p, before[n]), n  # the weights are those before the bad step
    assert all(p.grad is None for p in learner.model.parameters())

    poison["on"] = False  # a good step resets the count
    stats = train(learner, groups)
    assert stats["skipped_steps"] == 0 and learner.bad_steps.in_a_row == 0
    good = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    assert any(not torch.equal(good[n], before[n]) for n in good)

    poison["on"] = True
    train(learner, groups)  # one in a row: allowed
    with pytest.raises(BadStepsError, match=r"2 optimizer steps in a row .*max_bad_steps = 1"):
        train(learner, groups)
    for n, p in learner.model.named_parameters():
        assert torch.equal(p, good[n]), n


def test_an_idle_pass_records_every_name_of_a_real_one_as_zero_and_leaves_no_gradient(
    model, tokenizer
):
    # a rank without groups in a round runs an idle pass; the ranks add their step sums up by
    # name, so a rank that was idle for a whole step must have the names a training rank has
    from cadence.learner import StepSums, score

    _, learner = _learner(model, tokenizer)
    groups = score(sample_groups(model, tokenizer)[:1], learner.algo)
    real, idle = StepSums(), StepSums()
    learner.forward_backward(groups, real)
    learner.optimizer.zero_grad(set_to_none=False)
    learner.forward_backward(groups, idle, idle=True)
    assert idle.values.keys() == real.values.keys() and set(idle.values.values()) == {0.0}
    assert idle.maxima.keys() == real.maxima.keys() and set(idle.maxima.values()) == {0.0}
    assert list(idle.loss_metrics) == list(real.loss_metrics)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
