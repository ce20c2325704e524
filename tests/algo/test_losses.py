import math
from dataclasses import replace

import pytest
import torch
from torch.testing import assert_close

from cadence.algo.losses import (
    AGG_MODES,
    LossParams,
    PolicyBatch,
    kl_penalty,
    normaliser,
    online_dpo_loss,
    pg_loss,
    ppo_clip_loss,
    preference_pairs,
    rloo_loss,
    tis_weights,
    token_weights,
)

LN2 = math.log(2.0)
LN3 = math.log(3.0)


def make_batch(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    mode: str = "token-mean",
) -> PolicyBatch:
    """On-policy batch (old == logprobs) unless told otherwise; all tokens valid by default."""
    logprobs = logprobs.clone().requires_grad_(True)
    mask = torch.ones_like(logprobs) if loss_mask is None else loss_mask
    old = logprobs.detach().clone() if old_logprobs is None else old_logprobs
    return PolicyBatch(
        logprobs=logprobs,
        old_logprobs=old,
        advantages=advantages,
        loss_mask=mask,
        token_weights=token_weights(mask, mode),
        ref_logprobs=ref_logprobs,
    )


# --- PPO clip ---------------------------------------------------------------------------------


def test_ppo_clip_uses_clip_low_below_and_clip_high_above():
    ratios = torch.tensor([[1.0, 1.5, 0.8], [1.0, 1.5, 0.8]])
    batch = make_batch(ratios.log(), torch.tensor([2.0, -1.0]), old_logprobs=torch.zeros(2, 3))
    loss, metrics = ppo_clip_loss(batch, LossParams(clip_low=0.1, clip_high=0.3))
    # clip range [1 - 0.1, 1 + 0.3] = [0.9, 1.3]; loss_t = -min(r*A, clip(r)*A)
    # A = +2: r=1.0: min(2, 2) = 2 -> -2 (inside, not clipped)
    #         r=1.5: min(3, 1.3*2=2.6) = 2.6 -> -2.6 (clipped at 1 + clip_high; a symmetric
    #                0.1 bound would give -2.2)
    #         r=0.8: min(1.6, 0.9*2=1.8) = 1.6 -> -1.6 (pessimistic min keeps the unclipped term)
    # A = -1: r=1.0: -1 -> 1 (not clipped)
    #         r=1.5: min(-1.5, -1.3) = -1.5 -> 1.5 (not clipped)
    #         r=0.8: min(-0.8, 0.9*-1=-0.9) = -0.9 -> 0.9 (clipped at 1 - clip_low; a 0.3 bound
    #                would leave 0.8 unclipped)
    # sum = -2 - 2.6 - 1.6 + 1 + 1.5 + 0.9 = -2.8; 2 tokens clipped; ratio sum 2 * 3.3 = 6.6
    assert_close(loss, torch.tensor(-2.8), atol=1e-5, rtol=0)
    assert_close(metrics["pg_loss"], torch.tensor(-2.8), atol=1e-5, rtol=0)
    assert_close(metrics["clip_frac"], torch.tensor(2.0), atol=0, rtol=0)
    assert_close(metrics["ratio"], torch.tensor(6.6), atol=1e-5, rtol=0)
    assert_close(metrics["kl"], torch.tensor(0.0), atol=0, rtol=0)
    assert all(not m.requires_grad for m in metrics.values())


@pytest.mark.parametrize("loss_fn", [ppo_clip_loss, pg_loss])
def test_gradient_on_policy_is_minus_advantage_times_weight(loss_fn):
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    batch = make_batch(
        torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -3.0, -0.7]]),
        torch.tensor([2.0, -1.0]),
        loss_mask=mask,
        mode="seq-mean",
    )
    loss, _ = loss_fn(batch, LossParams())
    loss.backward()
    # ratio = 1, so d/dlogprob of -min(r*A, clip(r)*A) = -A * r = -A; times the seq-mean weights
    # [[1/3, 1/3, 1/3], [1/2, 1/2, 0]]:
    #   row 0: -2 * 1/3 = -2/3; row 1: 1 * 1/2 = 1/2, padding 0
    expected = torch.tensor([[-2 / 3, -2 / 3, -2 / 3], [0.5, 0.5, 0.0]])
    assert_close(batch.logprobs.grad, expected, atol=1e-6, rtol=0)


def test_pg_loss_is_minus_advantage_times_logprob():
    batch = make_batch(torch.tensor([[-1.0, -2.0], [-0.5, -4.0]]), torch.tensor([1.0, -0.5]))
    loss, metrics = pg_loss(batch, LossParams())
    # row 0: -1 * (-1 - 2) = 3; row 1: 0.5 * (-0.5 - 4) = -2.25; sum 0.75
    assert_close(loss, torch.tensor(0.75), atol=1e-6, rtol=0)
    # on-policy: 4 tokens of ratio 1, nothing clipped
    assert_close(metrics["ratio"], torch.tensor(4.0), atol=1e-6, rtol=0)
    assert_close(metrics["clip_frac"], torch.tensor(0.0), atol=0, rtol=0)


# --- KL ---------------------------------------------------------------------------------------


def test_kl_estimators_on_hand_example():
    logprobs = torch.tensor([[0.0, 0.0, LN2]])
    ref_logprobs = torch.tensor([[0.0, LN2, 0.0]])
    # log_ratio = logprobs - ref = [0, -ln2, ln2] = [0, -0.693147, 0.693147]
    k1 = kl_penalty(logprobs, ref_logprobs, "k1")
    assert_close(k1, torch.tensor([[0.0, -LN2, LN2]]), atol=1e-6, rtol=0)
    k2 = kl_penalty(logprobs, ref_logprobs, "k2")
    # 0.5 * ln2^2 = 0.5 * 0.480453 = 0.240227 for both signs
    assert_close(k2, torch.tensor([[0.0, 0.240227, 0.240227]]), atol=1e-6, rtol=0)
    k3 = kl_penalty(logprobs, ref_logprobs, "k3")
    # exp(-lr) - 1 + lr: lr=-ln2: 2 - 1 - 0.693147 = 0.306853; lr=ln2: 0.5 - 1 + 0.693147 = 0.193147
    assert_close(k3, torch.tensor([[0.0, 0.306853, 0.193147]]), atol=1e-6, rtol=0)


def test_k3_is_nonnegative_and_zero_when_equal():
    gen = torch.Generator().manual_seed(0)
    logprobs = -5.0 * torch.rand(64, 32, generator=gen)
    ref_logprobs = -5.0 * torch.rand(64, 32, generator=gen)
    # r - 1 - log r >= 0 for every r > 0 (log r <= r - 1), with equality only at r = 1
    assert (kl_penalty(logprobs, ref_logprobs, "k3") >= 0).all()
    assert_close(kl_penalty(logprobs, logprobs, "k3"), torch.zeros(64, 32), atol=0, rtol=0)


def test_unknown_kl_estimator_names_allowed_ones():
    with pytest.raises(ValueError, match="unknown kl_estimator 'k4'; allowed: k1, k2, k3"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


@pytest.mark.parametrize("loss_fn", [ppo_clip_loss, pg_loss])
def test_kl_coef_adds_weighted_kl_to_loss(loss_fn):
    logprobs = torch.tensor([[LN2, LN2]])
    batch = make_batch(logprobs, torch.tensor([0.0]), ref_logprobs=torch.zeros(1, 2))
    loss, metrics = loss_fn(batch, LossParams(kl_coef=0.5, kl_estimator="k3"))
    # A = 0 -> pg term 0; k3 at log_ratio ln2 = 0.5 - 1 + ln2 = 0.193147 per token, 2 tokens
    # -> kl 0.386294; loss = 0.5 * 0.386294 = 0.193147
    assert_close(metrics["pg_loss"], torch.tensor(0.0), atol=1e-6, rtol=0)
    assert_close(metrics["kl"], torch.tensor(0.386294), atol=1e-6, rtol=0)
    assert_close(loss, torch.tensor(0.193147), atol=1e-6, rtol=0)


def test_kl_is_reported_but_not_added_when_kl_coef_is_zero():
    batch = make_batch(
        torch.tensor([[LN2, LN2]]), torch.tensor([0.0]), ref_logprobs=torch.zeros(1, 2)
    )
    loss, metrics = ppo_clip_loss(batch, LossParams(kl_coef=0.0))
    # same k3 as above, 2 * 0.193147 = 0.386294, but the loss is the pg term alone: 0
    assert_close(metrics["kl"], torch.tensor(0.386294), atol=1e-6, rtol=0)
    assert_close(loss, torch.tensor(0.0), atol=1e-6, rtol=0)


def test_kl_coef_without_ref_logprobs_raises():
    batch = make_batch(torch.zeros(1, 2), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        ppo_clip_loss(batch, LossParams(kl_coef=0.1))


# --- aggregation ------------------------------------------------------------------------------

# Three sequences of lengths 3, 2, 1 padded to T = 3. With A = -1 and pg_loss, each token's loss
# is -A * logprob = its logprob, so the valid tokens carry losses 1, 2, 3 | 4, 5 | 6.
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [6.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # mean over the 6 valid tokens: (1 + 2 + ... + 6) / 6 = 21 / 6 = 3.5
        ("token-mean", 3.5),
        # mean of sequence means: (mean(1,2,3)=2 + mean(4,5)=4.5 + 6) / 3 = 12.5 / 3 = 4.166667
        ("seq-mean", 12.5 / 3),
        # sum / (num_seqs * max_new_tokens) = 21 / (3 * 3) = 2.333333
        ("seq-sum-norm", 21 / 9),
    ],
)
def test_micro_batch_sums_over_global_normaliser_match_full_batch(mode: str, expected: float):
    total = torch.zeros(())
    for rows in (slice(0, 1), slice(1, 3)):  # two micro-batches: sequence 0, sequences 1-2
        batch = make_batch(VALUES[rows], -torch.ones(VALUES[rows].shape[0]), MASK[rows], mode=mode)
        loss, _ = pg_loss(batch, LossParams())
        total = total + loss
    norm = normaliser(mode, num_tokens=6, num_seqs=3, max_new_tokens=3)
    assert_close(total / norm, torch.tensor(expected), atol=1e-6, rtol=0)


@pytest.mark.parametrize("loss_fn", [ppo_clip_loss, pg_loss])
def test_padding_contributes_nothing_even_with_huge_logprobs(loss_fn):
    clean = make_batch(VALUES, -torch.ones(3), MASK, ref_logprobs=torch.zeros(3, 3))
    clean_loss, clean_metrics = loss_fn(clean, LossParams(kl_coef=0.1))
    padding = MASK == 0
    # exp(1e4 - (-1e4)) overflows to inf, and inf * 0 would be NaN if padding were multiplied out
    huge = make_batch(
        VALUES.masked_fill(padding, 1e4),
        -torch.ones(3),
        MASK,
        old_logprobs=VALUES.masked_fill(padding, -1e4),
        ref_logprobs=torch.zeros(3, 3).masked_fill(padding, -1e4),
    )
    huge_loss, huge_metrics = loss_fn(huge, LossParams(kl_coef=0.1))
    huge_loss.backward()
    assert_close(huge_loss, clean_loss.detach(), atol=1e-6, rtol=0)
    for name, value in clean_metrics.items():
        assert_close(huge_metrics[name], value, atol=1e-6, rtol=0, msg=name)
    assert torch.isfinite(huge.logprobs.grad).all()
    assert (huge.logprobs.grad[padding] == 0).all()


def test_seq_mean_weights_are_inverse_lengths():
    weights = token_weights(MASK.bool(), "seq-mean")
    # lengths 3, 2, 1 -> 1/3 on each token of sequence 0, 1/2 on sequence 1, 1 on sequence 2
    expected = torch.tensor([[1 / 3, 1 / 3, 1 / 3], [0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    assert_close(weights, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-sum-norm"])
def test_token_and_constant_modes_weight_each_valid_token_one(mode: str):
    assert_close(token_weights(MASK.bool(), mode), MASK, atol=0, rtol=0)


def test_normaliser_per_mode():
    # token-mean: 6 tokens; seq-mean: 3 sequences; seq-sum-norm: 3 * 4 = 12
    assert normaliser("token-mean", num_tokens=6, num_seqs=3, max_new_tokens=4) == 6.0
    assert normaliser("seq-mean", num_tokens=6, num_seqs=3, max_new_tokens=4) == 3.0
    assert normaliser("seq-sum-norm", num_tokens=6, num_seqs=3, max_new_tokens=4) == 12.0


def test_unknown_aggregation_mode_names_allowed_ones():
    allowed = "allowed: token-mean, seq-mean, seq-sum-norm"
    with pytest.raises(ValueError, match=allowed):
        token_weights(MASK, "sum")
    with pytest.raises(ValueError, match=allowed):
        normaliser("sum", num_tokens=6, num_seqs=3, max_new_tokens=3)
    assert AGG_MODES == ("token-mean", "seq-mean", "seq-sum-norm")


def test_zero_normaliser_is_rejected():
    with pytest.raises(ValueError, match="num_tokens=0"):
        normaliser("token-mean", num_tokens=0, num_seqs=3, max_new_tokens=3)


# --- records ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clip_low": 1.0}, "clip_low must be in"),
        ({"clip_high": -0.1}, "clip_high must be >= 0"),
        ({"kl_coef": -1.0}, "kl_coef must be >= 0"),
        ({"kl_estimator": "k9"}, "allowed: k1, k2, k3"),
        ({"tis_cap": 0.5}, "tis_cap must be 0"),
        ({"dpo_beta": 0.0}, "dpo_beta must be > 0"),
        ({"dpo_loss": "hinge"}, "allowed: sigmoid, ipo"),
    ],
)
def test_loss_params_reject_bad_values(kwargs: dict, message: str):
    with pytest.raises(ValueError, match=message):
        LossParams(**kwargs)


def test_policy_batch_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"advantages must have shape \(2,\)"):
        make_batch(torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"old_logprobs must have shape \(2, 3\)"):
        make_batch(torch.zeros(2, 3), torch.zeros(2), old_logprobs=torch.zeros(2, 4))


# --- truncated importance sampling ------------------------------------------------------------

# pi_old / pi_behaviour = 0.5/0.5, 0.5/0.25, 0.8/0.2 = 1, 2, 4: with tis_cap = 3 the weights are
# 1, 2, 3 and only the third token is truncated.
TIS_OLD = torch.tensor([[0.5, 0.5, 0.8]]).log()
TIS_BEHAVIOUR = torch.tensor([[0.5, 0.25, 0.2]]).log()


def test_tis_weights_truncate_the_ratio_of_old_to_behaviour_at_the_cap():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    old = torch.cat([TIS_OLD, torch.tensor([[1e4]])], dim=1)  # padding: huge, ignored
    behaviour = torch.cat([TIS_BEHAVIOUR, torch.tensor([[-1e4]])], dim=1)
    weights, truncated = tis_weights(old, behaviour, mask, cap=3.0)
    # valid tokens: min(1, 3) = 1, min(2, 3) = 2, min(4, 3) = 3; padding: exp(0) = 1, not cut
    assert_close(weights, torch.tensor([[1.0, 2.0, 3.0, 1.0]]), atol=1e-6, rtol=0)
    assert truncated.tolist() == [[False, False, True, False]]


def test_ppo_clip_with_tis_weighs_each_token_and_reports_weights():
    on_policy = make_batch(TIS_OLD, torch.tensor([1.0]))  # logprobs == old: ratio 1
    batch = replace(on_policy, behaviour_logprobs=TIS_BEHAVIOUR)
    loss, metrics = ppo_clip_loss(batch, LossParams(tis_cap=3.0))
    loss.backward()
    # A = 1, ratio 1: loss_t = -w_t * min(1, 1) = -w_t -> -(1 + 2 + 3) = -6
    assert_close(loss, torch.tensor(-6.0), atol=1e-5, rtol=0)
    # d loss_t / d logprob_t = -w_t * A * ratio_t = -w_t
    assert_close(batch.logprobs.grad, torch.tensor([[-1.0, -2.0, -3.0]]), atol=1e-5, rtol=0)
    # weighted sums (token-mean weights 1): weights 1 + 2 + 3 = 6, one truncated token
    assert_close(metrics["tis_weight"], torch.tensor(6.0), atol=1e-5, rtol=0)
    assert_close(metrics["tis_trunc_frac"], torch.tensor(1.0), atol=0, rtol=0)


def test_pg_with_tis_weighs_each_token():
    batch = replace(make_batch(TIS_OLD, torch.tensor([1.0])), behaviour_logprobs=TIS_BEHAVIOUR)
    loss, _ = pg_loss(batch, LossParams(tis_cap=3.0))
    # loss_t = -w_t * A * logprob_t: -(1 * ln 0.5 + 2 * ln 0.5 + 3 * ln 0.8)
    #        = -(-0.693147 - 1.386294 - 0.669431) = 2.748872
    assert_close(loss, torch.tensor(2.748872), atol=1e-5, rtol=0)


def test_tis_off_leaves_the_loss_alone_and_reports_nothing():
    batch = replace(make_batch(TIS_OLD, torch.tensor([1.0])), behaviour_logprobs=TIS_BEHAVIOUR)
    loss, metrics = ppo_clip_loss(batch, LossParams(tis_cap=0.0))
    assert_close(loss, torch.tensor(-3.0), atol=1e-6, rtol=0)  # -A * ratio on 3 tokens
    assert "tis_weight" not in metrics and "tis_trunc_frac" not in metrics


def test_tis_without_behaviour_logprobs_raises():
    with pytest.raises(ValueError, match="needs behaviour_logprobs"):
        ppo_clip_loss(make_batch(TIS_OLD, torch.tensor([1.0])), LossParams(tis_cap=2.0))


# --- RLOO -------------------------------------------------------------------------------------


def test_rloo_loss_uses_leave_one_out_advantages_from_rewards():
    # group 0: rewards [1, 0, 0.5]; group 1: [0, 0, 0] (no signal). Two tokens per response.
    logprobs = torch.tensor(
        [[-1.0, -1.0], [-0.5, -0.5], [-2.0, 0.0], [-1.0, -3.0], [-0.2, -0.1], [-4.0, -1.0]]
    )
    batch = replace(
        make_batch(logprobs, torch.full((6,), 100.0)),  # advantages are ignored
        rewards=torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 0.0]),
        group_ids=torch.tensor([0, 0, 0, 1, 1, 1]),
    )
    loss, metrics = rloo_loss(batch, LossParams())
    loss.backward()
    # A_i = r_i - mean of the other two: 1 - (0 + 0.5)/2 = 0.75, 0 - (1 + 0.5)/2 = -0.75,
    # 0.5 - (1 + 0)/2 = 0; group 1: all 0.
    # loss = -sum_i A_i * sum_t logprob = -(0.75 * -2 + -0.75 * -1 + 0 * -2) = -(-1.5 + 0.75) = 0.75
    assert_close(loss, torch.tensor(0.75), atol=1e-6, rtol=0)
    assert_close(metrics["pg_loss"], torch.tensor(0.75), atol=1e-6, rtol=0)
    # gradient per token = -A_i (token-mean weights 1)
    expected = torch.tensor([-0.75, 0.75, 0.0, 0.0, 0.0, 0.0])[:, None].expand(6, 2)
    assert_close(batch.logprobs.grad, expected, atol=1e-6, rtol=0)


def test_rloo_loss_refuses_groups_that_are_not_consecutive_blocks():
    batch = replace(
        make_batch(torch.zeros(4, 1), torch.zeros(4)),
        rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]),
        group_ids=torch.tensor([0, 1, 0, 1]),
    )
    with pytest.raises(ValueError, match="consecutive rows"):
        rloo_loss(batch, LossParams())


# --- online DPO -------------------------------------------------------------------------------


def test_preference_pairs_take_best_and_worst_and_count_ties():
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.5, 0.5, 0.3, 0.9, 0.1])
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2])
    chosen, rejected, ties = preference_pairs(rewards, group_ids)
    # group 0: best 1.0 at rows 1 and 2 -> first, row 1; worst 0.0 at rows 0 and 3 -> row 0
    # group 1: 0.5 == 0.5, a tie: skipped; group 2: best row 7 (0.9), worst row 8 (0.1)
    assert chosen.tolist() == [1, 7] and rejected.tolist() == [0, 8] and ties == 1


def _dpo_batch() -> PolicyBatch:
    """Three groups; the reference log-probs are 0, so s(y) = sum of the response's log-probs.

    group A, rows 0-2, rewards [0, 1, 0.5]: chosen row 1 (s = 2 ln 3), rejected row 0 (s = 0)
    group B, rows 3-4, rewards [1, 1]: a tie, skipped
    group C, rows 5-6, rewards [0.2, 0]: chosen row 5 (s = 0), rejected row 6 (s = 0; its second
    token is padding holding a huge value)
    """
    logprobs = torch.tensor(
        [[0.0, 0.0], [LN3, LN3], [-5.0, -5.0], [-1.0, -2.0], [-3.0, 0.0], [1.0, -1.0], [0.0, 1e4]]
    )
    mask = torch.ones(7, 2)
    mask[6, 1] = 0.0
    batch = make_batch(logprobs, torch.zeros(7), loss_mask=mask, ref_logprobs=torch.zeros(7, 2))
    return replace(
        batch,
        rewards=torch.tensor([0.0, 1.0, 0.5, 1.0, 1.0, 0.2, 0.0]),
        group_ids=torch.tensor([0, 0, 0, 1, 1, 2, 2]),
    )


def test_online_dpo_sigmoid_loss_on_hand_example():
    batch = _dpo_batch()
    loss, metrics = online_dpo_loss(batch, LossParams(dpo_beta=0.5, dpo_loss="sigmoid"))
    loss.backward()
    # h = s(chosen) - s(rejected): A: 2 ln 3 - 0; C: 0 - 0. beta * h = ln 3 and 0.
    # -log sigmoid(x) = log(1 + e^-x): A: log(1 + 1/3) = 0.287682; C: log 2 = 0.693147
    # sum over the 2 pairs = 0.980829 (the learner divides by the global number of pairs)
    assert_close(loss, torch.tensor(0.980829), atol=1e-6, rtol=0)
    assert metrics["num_pairs"].item() == 2 and metrics["dpo_ties"].item() == 1
    # margins beta * h = ln 3 + 0 = 1.098612; accuracy counts margin > 0: pair A only
    assert_close(metrics["dpo_margin"], torch.tensor(LN3), atol=1e-6, rtol=0)
    assert metrics["dpo_accuracy"].item() == 1.0
    # d loss / d h = -beta * sigmoid(-beta h): A: -0.5 * 1/(1 + 3) = -0.125; C: -0.5 * 0.5 = -0.25
    # chosen tokens get that, rejected tokens its negative, padding and unpaired rows nothing
    expected = torch.tensor(
        [[0.125, 0.125], [-0.125, -0.125], [0, 0], [0, 0], [0, 0], [-0.25, -0.25], [0.25, 0.0]]
    )
    assert_close(batch.logprobs.grad, expected, atol=1e-6, rtol=0)


def test_online_dpo_ipo_loss_on_hand_example():
    batch = _dpo_batch()
    loss, _ = online_dpo_loss(batch, LossParams(dpo_beta=0.5, dpo_loss="ipo"))
    loss.backward()
    # 1 / (2 beta) = 1. A: (2 ln 3 - 1)^2 = 1.197225^2 = 1.433347; C: (0 - 1)^2 = 1; sum 2.433347
    assert_close(loss, torch.tensor(2.433347), atol=1e-5, rtol=0)
    # d/dh (h - 1)^2 = 2 (h - 1): A: 2.394449 on chosen tokens; C: -2 on row 5, +2 on row 6's token
    assert_close(batch.logprobs.grad[1], torch.tensor([2.394449, 2.394449]), atol=1e-5, rtol=0)
    assert_close(batch.logprobs.grad[6], torch.tensor([2.0, 0.0]), atol=1e-6, rtol=0)


def test_online_dpo_with_only_ties_has_zero_loss_and_gradient():
    batch = replace(_dpo_batch(), rewards=torch.ones(7))
    loss, metrics = online_dpo_loss(batch, LossParams())
    loss.backward()
    assert loss.item() == 0.0 and metrics["num_pairs"].item() == 0
    assert metrics["dpo_ties"].item() == 3
    assert (batch.logprobs.grad == 0).all()


def test_online_dpo_kl_metric_is_per_token_over_each_pairs_responses():
    batch = _dpo_batch()
    _, metrics = online_dpo_loss(batch, LossParams(kl_estimator="k1"))
    # k1 = logprobs - ref. A: rows 1 and 0: (2 ln 3 + 0) / 4 tokens = 0.549306
    # C: rows 5 and 6: (1 - 1 + 0) / 3 tokens = 0; summed over pairs: 0.549306
    assert_close(metrics["kl"], torch.tensor(2 * LN3 / 4), atol=1e-6, rtol=0)


def test_online_dpo_needs_reference_and_refuses_kl_coef():
    batch = _dpo_batch()
    with pytest.raises(ValueError, match="takes no kl_coef or tis_cap"):
        online_dpo_loss(batch, LossParams(kl_coef=0.1))
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        online_dpo_loss(replace(batch, ref_logprobs=None), LossParams())
