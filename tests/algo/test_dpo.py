from dataclasses import replace

import pytest
import torch
from batches import LN3, make_batch
from torch.testing import assert_close

from cadence.algo import AlgoParams
from cadence.algo.dpo import online_dpo_loss, preference_pairs
from cadence.algo.losses import PolicyBatch

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
    loss, metrics = online_dpo_loss(batch, AlgoParams(dpo_beta=0.5, dpo_loss="sigmoid"))
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
    loss, _ = online_dpo_loss(batch, AlgoParams(dpo_beta=0.5, dpo_loss="ipo"))
    loss.backward()
    # 1 / (2 beta) = 1. A: (2 ln 3 - 1)^2 = 1.197225^2 = 1.433347; C: (0 - 1)^2 = 1; sum 2.433347
    assert_close(loss, torch.tensor(2.433347), atol=1e-5, rtol=0)
    # d/dh (h - 1)^2 = 2 (h - 1): A: 2.394449 on chosen tokens; C: -2 on row 5, +2 on row 6's token
    assert_close(batch.logprobs.grad[1], torch.tensor([2.394449, 2.394449]), atol=1e-5, rtol=0)
    assert_close(batch.logprobs.grad[6], torch.tensor([2.0, 0.0]), atol=1e-6, rtol=0)


def test_online_dpo_ipo_token_mean_averages_log_ratios_per_token():
    batch = _dpo_batch()
    loss, metrics = online_dpo_loss(batch, AlgoParams(dpo_beta=0.5, dpo_loss="ipo_token_mean"))
    loss.backward()
    # s(y) = mean of the response's log-ratios. A: chosen row 1 mean(ln 3, ln 3) = ln 3,
    # rejected row 0: 0 -> h = 1.098612 (the summed form "ipo" had 2 ln 3). C: row 5 mean(1, -1)
    # = 0, row 6 (one valid token) 0 -> h = 0. 1 / (2 beta) = 1:
    #   A: (1.098612 - 1)^2 = 0.009724; C: (0 - 1)^2 = 1; sum 1.009724
    assert_close(loss, torch.tensor(1.009724), atol=1e-5, rtol=0)
    assert_close(metrics["dpo_margin"], torch.tensor(0.5 * LN3), atol=1e-6, rtol=0)
    # d/dh (h - 1)^2 = 2 (h - 1), spread over the response's tokens (1 / len):
    #   A: 0.197225 / 2 = 0.098612 on row 1's tokens, -0.098612 on row 0's
    #   C: -2 / 2 = -1 on row 5's tokens; +2 / 1 on row 6's one valid token, 0 on its padding
    expected = torch.tensor(
        [[-0.098612] * 2, [0.098612] * 2, [0, 0], [0, 0], [0, 0], [-1.0, -1.0], [2.0, 0.0]]
    )
    assert_close(batch.logprobs.grad, expected, atol=1e-5, rtol=0)


def test_online_dpo_with_only_ties_has_zero_loss_and_gradient():
    batch = replace(_dpo_batch(), rewards=torch.ones(7))
    loss, metrics = online_dpo_loss(batch, AlgoParams())
    loss.backward()
    assert loss.item() == 0.0 and metrics["num_pairs"].item() == 0
    assert metrics["dpo_ties"].item() == 3
    assert (batch.logprobs.grad == 0).all()


def test_online_dpo_kl_metric_is_per_token_over_each_pairs_responses():
    batch = _dpo_batch()
    _, metrics = online_dpo_loss(batch, AlgoParams(kl_estimator="k1"))
    # k1 = logprobs - ref. A: rows 1 and 0: (2 ln 3 + 0) / 4 tokens = 0.549306
    # C: rows 5 and 6: (1 - 1 + 0) / 3 tokens = 0; summed over pairs: 0.549306
    assert_close(metrics["kl"], torch.tensor(2 * LN3 / 4), atol=1e-6, rtol=0)


def test_online_dpo_needs_reference_and_refuses_kl_coef():
    batch = _dpo_batch()
    with pytest.raises(ValueError, match="takes no kl_coef or tis_cap"):
        online_dpo_loss(batch, AlgoParams(kl_coef=0.1))
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        online_dpo_loss(replace(batch, ref_logprobs=None), AlgoParams())
