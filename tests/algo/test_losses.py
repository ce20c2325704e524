import math

import pytest
import torch
from torch.testing import assert_close

from cadence.algo.losses import (
    AGG_MODES,
    LossParams,
    PolicyBatch,
    kl_penalty,
    normaliser,
    pg_loss,
    ppo_clip_loss,
    token_weights,
)

LN2 = math.log(2.0)


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
