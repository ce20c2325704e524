import math
from dataclasses import replace

import pytest
import torch
from batches import LN2, make_batch
from torch.testing import assert_close

from cadence.algo import AlgoParams, get_loss
from cadence.algo.aggregation import AGG_MODES, normaliser, token_weights
from cadence.algo.correction import tis_weights
from cadence.algo.losses import (
    TOKEN_METRICS,
    PolicyBatch,
    cispo_loss,
    gspo_loss,
    kl_penalty,
    pg_loss,
    ppo_clip_loss,
    rloo_loss,
)

# --- PPO clip ---------------------------------------------------------------------------------


def test_ppo_clip_uses_clip_low_below_and_clip_high_above():
    ratios = torch.tensor([[1.0, 1.5, 0.8], [1.0, 1.5, 0.8]])
    batch = make_batch(ratios.log(), torch.tensor([2.0, -1.0]), old_logprobs=torch.zeros(2, 3))
    loss, metrics = ppo_clip_loss(batch, AlgoParams(clip_low=0.1, clip_high=0.3))
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
    loss, _ = loss_fn(batch, AlgoParams())
    loss.backward()
    # ratio = 1, so d/dlogprob of -min(r*A, clip(r)*A) = -A * r = -A; times the seq-mean weights
    # [[1/3, 1/3, 1/3], [1/2, 1/2, 0]]:
    #   row 0: -2 * 1/3 = -2/3; row 1: 1 * 1/2 = 1/2, padding 0
    expected = torch.tensor([[-2 / 3, -2 / 3, -2 / 3], [0.5, 0.5, 0.0]])
    assert_close(batch.logprobs.grad, expected, atol=1e-6, rtol=0)


def test_pg_loss_is_minus_advantage_times_logprob():
    batch = make_batch(torch.tensor([[-1.0, -2.0], [-0.5, -4.0]]), torch.tensor([1.0, -0.5]))
    loss, metrics = pg_loss(batch, AlgoParams())
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
    loss, metrics = loss_fn(batch, AlgoParams(kl_coef=0.5, kl_estimator="k3"))
    # A = 0 -> pg term 0; k3 at log_ratio ln2 = 0.5 - 1 + ln2 = 0.193147 per token, 2 tokens
    # -> kl 0.386294; loss = 0.5 * 0.386294 = 0.193147
    assert_close(metrics["pg_loss"], torch.tensor(0.0), atol=1e-6, rtol=0)
    assert_close(metrics["kl"], torch.tensor(0.386294), atol=1e-6, rtol=0)
    assert_close(loss, torch.tensor(0.193147), atol=1e-6, rtol=0)


def test_kl_is_reported_but_not_added_when_kl_coef_is_zero():
    batch = make_batch(
        torch.tensor([[LN2, LN2]]), torch.tensor([0.0]), ref_logprobs=torch.zeros(1, 2)
    )
    loss, metrics = ppo_clip_loss(batch, AlgoParams(kl_coef=0.0))
    # same k3 as above, 2 * 0.193147 = 0.386294, but the loss is the pg term alone: 0
    assert_close(metrics["kl"], torch.tensor(0.386294), atol=1e-6, rtol=0)
    assert_close(loss, torch.tensor(0.0), atol=1e-6, rtol=0)


def test_kl_coef_without_ref_logprobs_raises():
    batch = make_batch(torch.zeros(1, 2), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        ppo_clip_loss(batch, AlgoParams(kl_coef=0.1))


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
        loss, _ = pg_loss(batch, AlgoParams())
        total = total + loss
    norm = normaliser(mode, num_tokens=6, num_seqs=3, max_new_tokens=3)
    assert_close(total / norm, torch.tensor(expected), atol=1e-6, rtol=0)


@pytest.mark.parametrize("loss_fn", [ppo_clip_loss, pg_loss])
def test_padding_contributes_nothing_even_with_huge_logprobs(loss_fn):
    clean = make_batch(VALUES, -torch.ones(3), MASK, ref_logprobs=torch.zeros(3, 3))
    clean_loss, clean_metrics = loss_fn(clean, AlgoParams(kl_coef=0.1))
    padding = MASK == 0
    # exp(1e4 - (-1e4)) overflows to inf, and inf * 0 would be NaN if padding were multiplied out
    huge = make_batch(
        VALUES.masked_fill(padding, 1e4),
        -torch.ones(3),
        MASK,
        old_logprobs=VALUES.masked_fill(padding, -1e4),
        ref_logprobs=torch.zeros(3, 3).masked_fill(padding, -1e4),
    )
    huge_loss, huge_metrics = loss_fn(huge, AlgoParams(kl_coef=0.1))
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
        ({"clip_low": 1.5}, "clip_low must be in"),
        ({"clip_ratio_c": 1.0}, "clip_ratio_c must be 0"),
        ({"clip_high": -0.1}, "clip_high must be >= 0"),
        ({"kl_coef": -1.0}, "kl_coef must be >= 0"),
        ({"kl_clamp": -1.0}, "kl_clamp must be >= 0"),
        ({"kl_estimator": "k9"}, "allowed: k1, k2, k3"),
        ({"tis_cap": 0.5}, "tis_cap must be 0"),
        ({"dpo_beta": 0.0}, "dpo_beta must be > 0"),
        ({"dpo_loss": "hinge"}, "allowed: sigmoid, ipo, ipo_token_mean"),
        ({"std": "sample"}, "allowed: unbiased, population"),
        ({"loss_agg": "sum"}, "allowed: token-mean, seq-mean, seq-sum-norm"),
        ({"max_policy_tokens": 0}, "max_policy_tokens must be >= 1"),
        ({"overlong_buffer": 65}, r"overlong_buffer must be in \[0, max_policy_tokens = 64\]"),
    ],
)
def test_algo_params_reject_bad_values(kwargs: dict, message: str):
    with pytest.raises(ValueError, match=message):
        AlgoParams(**kwargs)


def test_policy_batch_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"advantages must have shape \(2,\) or \(2, 3\)"):
        make_batch(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"old_logprobs must have shape \(2, 3\)"):
        make_batch(torch.zeros(2, 3), torch.zeros(2), old_logprobs=torch.zeros(2, 4))


@pytest.mark.parametrize("loss", ["ppo_clip", "pg", "cispo"])
def test_per_token_advantages_equal_to_the_sequences_give_the_same_loss(loss):
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.5, -2.5]], requires_grad=True)
    old = logprobs.detach() + torch.tensor([[0.1, -0.2, 0.0], [0.05, 0.3, -0.1]])
    seq = make_batch(logprobs, torch.tensor([1.0, -0.5]), old_logprobs=old)
    tok = replace(seq, advantages=seq.advantages[:, None].expand(2, 3).clone())
    want, got = get_loss(loss)(seq, AlgoParams())[0], get_loss(loss)(tok, AlgoParams())[0]
    assert_close(got, want)
    with pytest.raises(ValueError, match="one advantage per sequence, not one per token"):
        get_loss("gspo")(tok, AlgoParams())


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
    loss, metrics = ppo_clip_loss(batch, AlgoParams(tis_cap=3.0))
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
    loss, _ = pg_loss(batch, AlgoParams(tis_cap=3.0))
    # loss_t = -w_t * A * logprob_t: -(1 * ln 0.5 + 2 * ln 0.5 + 3 * ln 0.8)
    #        = -(-0.693147 - 1.386294 - 0.669431) = 2.748872
    assert_close(loss, torch.tensor(2.748872), atol=1e-5, rtol=0)


def test_tis_off_leaves_the_loss_alone_and_reports_nothing():
    batch = replace(make_batch(TIS_OLD, torch.tensor([1.0])), behaviour_logprobs=TIS_BEHAVIOUR)
    loss, metrics = ppo_clip_loss(batch, AlgoParams(tis_cap=0.0))
    assert_close(loss, torch.tensor(-3.0), atol=1e-6, rtol=0)  # -A * ratio on 3 tokens
    assert "tis_weight" not in metrics and "tis_trunc_frac" not in metrics


def test_tis_without_behaviour_logprobs_raises():
    with pytest.raises(ValueError, match="needs behaviour_logprobs"):
        ppo_clip_loss(make_batch(TIS_OLD, torch.tensor([1.0])), AlgoParams(tis_cap=2.0))


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
    loss, metrics = rloo_loss(batch, AlgoParams())
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
        rloo_loss(batch, AlgoParams())


# --- extreme log-ratios: clamped before exp() ---------------------------------------------------

E20 = math.exp(20.0)  # 485165195.4: the largest ratio after the [-20, 20] clamp


def _stale_token_batch(advantage: float) -> PolicyBatch:
    """Token 0's recorded old log-prob is -100 against the policy's -1: log-ratio 99."""
    return make_batch(
        torch.tensor([[-1.0, -2.0]]),
        torch.tensor([advantage]),
        old_logprobs=torch.tensor([[-100.0, -2.0]]),
    )


def test_ppo_clip_on_an_extreme_log_ratio_is_finite_with_zero_gradient_for_that_token():
    batch = _stale_token_batch(1.0)
    loss, metrics = ppo_clip_loss(batch, AlgoParams())
    loss.backward()
    # token 0: log-ratio 99 clamped to 20, ratio e^20; A = +1: min(e^20, 1.2) = 1.2 -> -1.2,
    #   and its gradient is 0 (the clip's and the clamp's); unclamped this gradient was NaN
    # token 1: ratio 1 -> -1, gradient -A * ratio = -1. Sum -2.2.
    assert_close(loss, torch.tensor(-2.2), atol=1e-6, rtol=0)
    assert_close(batch.logprobs.grad, torch.tensor([[0.0, -1.0]]), atol=0, rtol=0)
    assert metrics["ratio_clamped_frac"].item() == 1.0 and metrics["clip_frac"].item() == 1.0


def test_ppo_clip_negative_advantage_twin_is_finite_and_dual_clip_bounds_it():
    batch = _stale_token_batch(-1.0)
    loss, _ = ppo_clip_loss(batch, AlgoParams())
    loss.backward()
    # token 0: A = -1: -min(-e^20, -1.2) = e^20 = 485165195.4, finite (unclamped: inf); the
    #   clamp cuts its gradient to 0. token 1: ratio 1 -> 1, gradient -A * 1 = +1.
    assert torch.isfinite(loss)
    assert_close(loss, torch.tensor(E20 + 1.0), atol=0, rtol=1e-6)
    assert_close(batch.logprobs.grad, torch.tensor([[0.0, 1.0]]), atol=0, rtol=0)
    # with dual clip c = 3: token 0's loss is min(e^20, -c * A = 3) = 3; total 4
    batch = _stale_token_batch(-1.0)
    loss, metrics = ppo_clip_loss(batch, AlgoParams(clip_ratio_c=3.0))
    loss.backward()
    assert_close(loss, torch.tensor(4.0), atol=1e-6, rtol=0)
    assert_close(batch.logprobs.grad, torch.tensor([[0.0, 1.0]]), atol=0, rtol=0)
    assert metrics["dual_clip_frac"].item() == 1.0


@pytest.mark.parametrize("kl_clamp", [0.0, 10.0])
@pytest.mark.parametrize("name", ["ppo_clip", "pg", "gspo", "cispo"])
@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_every_policy_loss_is_finite_on_extreme_log_ratios(
    name: str, advantage: float, kl_clamp: float
):
    loss_fn = {"ppo_clip": ppo_clip_loss, "pg": pg_loss, "gspo": gspo_loss, "cispo": cispo_loss}
    batch = replace(
        _stale_token_batch(advantage),
        ref_logprobs=torch.tensor([[90.0, -2.0]]),  # k3's log-ratio -91: exp(91) overflows fp32
        behaviour_logprobs=torch.tensor([[-200.0, -2.0]]),  # TIS log-ratio 100
    )
    loss, metrics = loss_fn[name](batch, AlgoParams(kl_coef=0.1, tis_cap=2.0, kl_clamp=kl_clamp))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(batch.logprobs.grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())
    # token 0's log-ratio to old (or, GSPO, its sequence's mean 49.5) and to ref were clamped
    assert metrics["ratio_clamped_frac"].item() == (2.0 if name == "gspo" else 1.0)
    assert metrics["kl_clamped_frac"].item() == (1.0 if kl_clamp else 0.0)


def test_k3_stays_finite_with_zero_gradient_beyond_the_log_ratio_clamp():
    logprobs = torch.tensor([[-100.0, -3.0, 0.0]], requires_grad=True)
    kl = kl_penalty(logprobs, torch.zeros(1, 3), "k3")
    kl.sum().backward()
    # log_ratio x = logprobs - ref; k3 = e^-x - 1 + x:
    #   x = -100: exp(100) = inf unclamped; clamped to -20: e^20 - 21 = 485165174.4
    #   x = -3: e^3 - 4 = 16.085537 (no cap by default);  x = 0: 0
    assert_close(kl, torch.tensor([[E20 - 21.0, 16.085537, 0.0]]), atol=1e-5, rtol=1e-6)
    # d k3 / dx = 1 - e^-x: 0 beyond the clamp; x = -3: 1 - e^3 = -19.085537; x = 0: 0
    assert_close(logprobs.grad, torch.tensor([[0.0, -19.085537, 0.0]]), atol=1e-5, rtol=0)


def test_k3_capped_at_10_as_verl_has_zero_gradient_beyond():
    logprobs = torch.tensor([[-100.0, -3.0, -2.0, 0.0]], requires_grad=True)
    kl = kl_penalty(logprobs, torch.zeros(1, 4), "k3", clamp=10.0)
    kl.sum().backward()
    # log_ratio x = logprobs - ref; k3 = e^-x - 1 + x:
    #   x = -100: exp(100) = inf unclamped; clamped to -20: e^20 - 21 = 4.85e8 -> capped at 10
    #   x = -3: e^3 - 4 = 16.085537 -> capped at 10;  x = -2: e^2 - 3 = 4.389056;  x = 0: 0
    assert_close(kl, torch.tensor([[10.0, 10.0, 4.389056, 0.0]]), atol=1e-5, rtol=0)
    # d k3 / dx = 1 - e^-x: 0 where capped; x = -2: 1 - e^2 = -6.389056; x = 0: 0
    assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, -6.389056, 0.0]]), atol=1e-5, rtol=0)


def test_tis_weight_of_an_extreme_log_ratio_is_the_cap():
    weights, cut = tis_weights(
        torch.tensor([[0.0, -1.0]]), torch.tensor([[-500.0, -1.0]]), torch.ones(1, 2), cap=2.0
    )
    # log-ratio 500 clamped to 20: e^20 > cap -> 2; token 1: ratio 1
    assert_close(weights, torch.tensor([[2.0, 1.0]]), atol=0, rtol=0)
    assert cut.tolist() == [[True, False]]


# --- dual-clip PPO ----------------------------------------------------------------------------


def test_dual_clip_caps_the_loss_of_negative_advantages_beyond_c():
    ratios = torch.tensor([[0.5, 1.0, 2.0, 3.0, 4.0], [0.5, 1.0, 2.0, 3.0, 4.0]])
    batch = make_batch(ratios.log(), torch.tensor([-1.0, 1.0]), old_logprobs=torch.zeros(2, 5))
    loss, metrics = ppo_clip_loss(batch, AlgoParams(clip_ratio_c=3.0))
    loss.backward()
    # clip range [0.8, 1.2]. A = -1: PPO loss_t = -min(-r, -clip(r)) = max(r, clip(r)):
    #   r = 0.5 -> 0.8 (clipped, gradient 0); 1 -> 1; 2 -> 2; 3 -> 3 (= c * |A|: at the bound);
    #   4 -> 4 > 3 = -c * A, so the dual clip makes it 3 with gradient 0. Sum 9.8.
    # A = +1 (no dual clip): -min(r, clip(r)) = -0.5, -1, -1.2, -1.2, -1.2. Sum -5.1.
    # total 4.7; clipped tokens: r = 0.5 (A < 0) and r = 2, 3, 4 (A > 0): 4; dual-clipped: 1
    assert_close(loss, torch.tensor(4.7), atol=1e-5, rtol=0)
    assert metrics["clip_frac"].item() == 4.0 and metrics["dual_clip_frac"].item() == 1.0
    # gradient of loss_t wrt logprob_t where unclipped: -A * r. A = -1: r; A = +1: -r
    expected = torch.tensor([[0.0, 1.0, 2.0, 3.0, 0.0], [-0.5, -1.0, 0.0, 0.0, 0.0]])
    assert_close(batch.logprobs.grad, expected, atol=1e-5, rtol=0)


def test_dual_clip_off_leaves_ppo_clip_unchanged():
    ratios = torch.tensor([[0.5, 1.0, 4.0]])
    batch = make_batch(ratios.log(), torch.tensor([-1.0]), old_logprobs=torch.zeros(1, 3))
    loss, metrics = ppo_clip_loss(batch, AlgoParams())
    # A = -1: max(r, clip(r)) = 0.8 + 1 + 4 = 5.8; no dual clip metric
    assert_close(loss, torch.tensor(5.8), atol=1e-5, rtol=0)
    assert "dual_clip_frac" not in metrics


# --- GSPO -------------------------------------------------------------------------------------

# Three sequences of lengths 3, 2, 1 (T = 3) with token log-ratios (old log-probs 0):
#   seq 0: [ln 2, 0, ln 0.5] -> mean 0, s = 1;         A = +2
#   seq 1: [ln 2, 0]         -> mean ln2 / 2, s = sqrt(2) = 1.414214; A = -1
#   seq 2: [ln 0.5]          -> s = 0.5;               A = -1
GSPO_LOGPROBS = torch.tensor([[LN2, 0.0, -LN2], [LN2, 0.0, 0.0], [-LN2, 0.0, 0.0]])
GSPO_ADVANTAGES = torch.tensor([2.0, -1.0, -1.0])


def test_gspo_clips_whole_sequences_by_their_geometric_mean_ratio():
    batch = make_batch(GSPO_LOGPROBS, GSPO_ADVANTAGES, MASK, torch.zeros(3, 3), mode="seq-mean")
    loss, metrics = gspo_loss(batch, AlgoParams())
    loss.backward()
    # clip range [0.8, 1.2]; loss_i = -min(s A, clip(s) A):
    #   seq 0: s = 1 -> -2, inside; seq 1: -min(-1.414214, -1.2) = 1.414214 (above the ceiling,
    #   but the pessimistic min keeps the unclipped term); seq 2: -min(-0.5, -0.8) = 0.8, clipped
    # seq-mean: each token weighs 1/len_i, so the sum is the sum of sequence losses:
    #   -2 + 1.414214 + 0.8 = 0.214214
    assert_close(loss, torch.tensor(0.214214), atol=1e-5, rtol=0)
    # gradient where not clipped: d loss_i / d logprob_t = -A_i * s_i / len_i:
    #   seq 0: -2 * 1 / 3 = -0.666667; seq 1: 1.414214 / 2 = 0.707107; seq 2 (clipped): 0
    expected = torch.tensor([[-2 / 3, -2 / 3, -2 / 3], [0.707107, 0.707107, 0.0], [0.0, 0.0, 0.0]])
    assert_close(batch.logprobs.grad, expected, atol=1e-5, rtol=0)
    # clip_frac counts tokens of clipped sequences: seq 2's one token; ratio: 1 + 1.414214 + 0.5
    assert metrics["clip_frac"].item() == 1.0
    assert_close(metrics["ratio"], torch.tensor(2.914214), atol=1e-5, rtol=0)


def test_gspo_under_token_mean_weighs_each_sequence_by_its_length():
    batch = make_batch(GSPO_LOGPROBS, GSPO_ADVANTAGES, MASK, torch.zeros(3, 3), mode="token-mean")
    loss, _ = gspo_loss(batch, AlgoParams())
    loss.backward()
    # every token weighs 1: 3 * -2 + 2 * 1.414214 + 1 * 0.8 = -2.371573
    assert_close(loss, torch.tensor(-2.371573), atol=1e-5, rtol=0)
    # each token gets its sequence's len_i * (-A_i s_i / len_i) = -A_i s_i: -2, 1.414214, 0
    expected = torch.tensor([[-2.0, -2.0, -2.0], [1.414214, 1.414214, 0.0], [0.0, 0.0, 0.0]])
    assert_close(batch.logprobs.grad, expected, atol=1e-5, rtol=0)


def test_gspo_clips_a_sequence_that_one_token_pushes_out_of_range():
    # log-ratios [ln 4, 0, 0, 0]: token-level PPO clips token 0 alone (ratio 4); GSPO's
    # s = 4^(1/4) = 1.414214 > 1.2 clips the whole sequence for A > 0: every gradient is 0
    logprobs = torch.tensor([[math.log(4.0), 0.0, 0.0, 0.0]])
    batch = make_batch(logprobs, torch.tensor([1.0]), old_logprobs=torch.zeros(1, 4))
    loss, metrics = gspo_loss(batch, AlgoParams())
    loss.backward()
    assert_close(loss, torch.tensor(-4 * 1.2), atol=1e-5, rtol=0)  # -1.2 on each of 4 tokens
    assert (batch.logprobs.grad == 0).all() and metrics["clip_frac"].item() == 4.0
    ppo = make_batch(logprobs, torch.tensor([1.0]), old_logprobs=torch.zeros(1, 4))
    ppo_clip_loss(ppo, AlgoParams())[0].backward()
    assert_close(ppo.logprobs.grad, torch.tensor([[0.0, -1.0, -1.0, -1.0]]), atol=1e-6, rtol=0)


def test_gspo_on_policy_has_ppos_gradient_under_seq_mean():
    mask = MASK.clone()
    kwargs = {"loss_mask": mask, "mode": "seq-mean"}
    gspo = make_batch(-VALUES, torch.tensor([1.0, -2.0, 0.5]), **kwargs)  # old = logprobs
    ppo = make_batch(-VALUES, torch.tensor([1.0, -2.0, 0.5]), **kwargs)
    gspo_loss(gspo, AlgoParams())[0].backward()
    ppo_clip_loss(ppo, AlgoParams())[0].backward()
    # s_i = 1: -A_i / len_i on every token, as PPO's -A_i * w_t with w_t = 1 / len_i
    assert_close(gspo.logprobs.grad, ppo.logprobs.grad, atol=1e-6, rtol=0)


# --- CISPO ------------------------------------------------------------------------------------

# Ratios [0.5, 1, 1.5] at log-probs [-1, -2, -0.5]: old = logprobs - ln(ratio)
CISPO_LOGPROBS = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5]])
CISPO_OLD = CISPO_LOGPROBS - torch.tensor([0.5, 1.0, 1.5]).log()


def test_cispo_weighs_logprobs_by_the_clipped_detached_ratio():
    batch = make_batch(CISPO_LOGPROBS, torch.tensor([1.0, -2.0]), old_logprobs=CISPO_OLD)
    loss, metrics = cispo_loss(batch, AlgoParams(clip_low=0.2, clip_high=0.3))
    loss.backward()
    # weights w = clip(r, 0.8, 1.3) = [0.8, 1.0, 1.3]; loss_t = -w_t * A * logprob_t
    #   A = +1: -(0.8 * -1 + 1 * -2 + 1.3 * -0.5) = 3.45
    #   A = -2: 2 * (0.8 * -1 + 1 * -2 + 1.3 * -0.5) = -6.9;   total -3.45
    assert_close(loss, torch.tensor(-3.45), atol=1e-5, rtol=0)
    # gradient -w_t * A, nonzero even where the ratio left the range (PPO's would be 0 there)
    expected = torch.tensor([[-0.8, -1.0, -1.3], [1.6, 2.0, 2.6]])
    assert_close(batch.logprobs.grad, expected, atol=1e-5, rtol=0)
    assert metrics["clip_frac"].item() == 4.0  # r = 0.5 and 1.5 in both rows


def test_cispo_without_a_floor_keeps_small_ratios():
    batch = make_batch(CISPO_LOGPROBS[:1], torch.tensor([1.0]), old_logprobs=CISPO_OLD[:1])
    loss, metrics = cispo_loss(batch, AlgoParams(clip_low=1.0, clip_high=0.3))
    # clip_low = 1: floor 0, so w = [0.5, 1.0, 1.3]: -(0.5 * -1 + 1 * -2 + 1.3 * -0.5) = 3.15
    assert_close(loss, torch.tensor(3.15), atol=1e-5, rtol=0)
    assert metrics["clip_frac"].item() == 1.0  # only r = 1.5


def test_cispo_on_policy_is_pg():
    cispo = make_batch(-VALUES, torch.tensor([1.0, -2.0, 0.5]), MASK)
    pg = make_batch(-VALUES, torch.tensor([1.0, -2.0, 0.5]), MASK)
    cispo_loss_value, _ = cispo_loss(cispo, AlgoParams())
    pg_loss_value, _ = pg_loss(pg, AlgoParams())
    (cispo_loss_value + pg_loss_value).backward()  # both graphs at once
    # ratio 1 -> w = 1: -A * logprob, exactly pg's loss and gradient
    assert_close(cispo_loss_value, pg_loss_value, atol=1e-6, rtol=0)
    assert_close(cispo.logprobs.grad, pg.logprobs.grad, atol=1e-6, rtol=0)


# --- metric conventions -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", AGG_MODES)
def test_clip_frac_counts_tokens_in_every_aggregation_mode(mode: str):
    ratios = torch.tensor([[1.0, 1.5, 0.8], [1.0, 1.5, 0.8]])
    batch = make_batch(
        ratios.log(), torch.tensor([2.0, -1.0]), old_logprobs=torch.zeros(2, 3), mode=mode
    )
    _, metrics = ppo_clip_loss(batch, AlgoParams(clip_low=0.1, clip_high=0.3))
    # 2 clipped tokens (see the first PPO test) whatever the weights: under seq-mean a weighted
    # count would be 2 / 3; the learner divides this count by the response tokens (6)
    assert metrics["clip_frac"].item() == 2.0
    assert set(TOKEN_METRICS) >= {"clip_frac", "ratio_clamped_frac", "tis_trunc_frac"}


def test_seq_mean_counts_an_empty_response_in_the_number_of_sequences():
    values = torch.tensor([[1.0, 2.0], [5.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])  # response 1 is empty
    batch = make_batch(values, -torch.ones(2), mask, mode="seq-mean")
    loss, _ = pg_loss(batch, AlgoParams())
    # row 0: mean(1, 2) = 1.5; the empty row weighs 0 on every token and adds 0;
    # num_seqs counts it: 1.5 / 2 = 0.75 (verl, which leaves it out, would give 1.5)
    norm = normaliser("seq-mean", num_tokens=2, num_seqs=2, max_new_tokens=2)
    assert_close(loss / norm, torch.tensor(0.75), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["gspo", "cispo", "ppo_clip"])
def test_a_group_with_equal_rewards_gives_no_loss_and_no_gradient(name: str):
    loss_fn = {"gspo": gspo_loss, "cispo": cispo_loss, "ppo_clip": ppo_clip_loss}[name]
    # equal rewards -> every advantage 0 (GRPO, RLOO, REINFORCE++ alike), here with every ratio
    # exp(-0.4) = 0.670320, below the clip floor 0.8
    batch = make_batch(-VALUES, torch.zeros(3), MASK, old_logprobs=-VALUES + 0.4)
    loss, _ = loss_fn(batch, AlgoParams(clip_ratio_c=3.0 if name == "ppo_clip" else 0.0))
    loss.backward()
    assert loss.item() == 0.0 and (batch.logprobs.grad == 0).all()
