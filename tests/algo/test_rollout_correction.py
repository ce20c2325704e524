"""Rollout correction (algo/correction.py): each mode's weights and verl's figures against hand
computation, the proximal-policy choice in the losses, the older `tis_cap`, and a tiny run."""

import json
import math
from dataclasses import replace
from typing import get_args

import pytest
import torch
from batches import make_batch
from torch.testing import assert_close

from cadence.algo import (
    CORRECTION_MAXIMA,
    CORRECTION_MODES,
    CORRECTION_SUMS,
    LOSSES,
    PAIR_LOSSES,
    RATIO_LOSSES,
    AlgoParams,
    correction_figures,
    correction_sums,
    correction_weights,
    get_loss,
)
from cadence.algo.correction import TRUNCATE_MODES, level_ratio
from cadence.choices import PROXIMAL_POLICIES
from cadence.config import AlgoConfig, ConfigError, load_config

# Two responses of 3 tokens; the second's last token is not trained (loss_mask 0) and carries a
# log-ratio of 1000 that must change nothing. Token ratios rho = pi_old / pi_behaviour:
#   response 0: 2, 0.5, 4          R_0 = 4     G_0 = 4^(1/3)    = 1.587401
#   response 1: 3, 0.25, (masked)  R_1 = 0.75  G_1 = 0.75^(1/2) = 0.866025
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
RHO = torch.tensor([[2.0, 0.5, 4.0], [3.0, 0.25, 1.0]])
LOG_RATIO = torch.where(MASK > 0, RHO.log(), 1000.0)  # (2, 3)
BAND = (0.3, 2.5)  # no ratio on an edge: exp(log x) need not round back to x
ATOL = 1e-6


def _weights(mode, band=BAND):
    return correction_weights(LOG_RATIO, MASK, mode, *band)


@pytest.mark.parametrize(
    "mode, band, expected",
    [
        # clip(rho_t, 0.3, 2.5); 1 on the untrained token
        ("token_truncate", BAND, [[2.0, 0.5, 2.5], [2.5, 0.3, 1.0]]),
        # rho_t inside [0.3, 2.5], else 0
        ("token_mask", BAND, [[2.0, 0.5, 0.0], [0.0, 0.0, 1.0]]),
        ("icepop", BAND, [[2.0, 0.5, 0.0], [0.0, 0.0, 1.0]]),
        # clip(R_i, 0.3, 2.5) on every token: R_0 = 4 -> 2.5, R_1 = 0.75
        ("sequence_truncate", BAND, [[2.5, 2.5, 2.5], [0.75, 0.75, 1.0]]),
        # R_0 = 4 is outside: 0; R_1 = 0.75 inside: 0.75
        ("sequence_mask", BAND, [[0.0, 0.0, 0.0], [0.75, 0.75, 1.0]]),
        # G_0 = 1.587 > 1.5: rejected; G_1 = 0.866 in [0.8, 1.5]: weight 1 (no reweighing)
        ("geometric_mask", (0.8, 1.5), [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]),
        ("none", BAND, [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]),
    ],
)
def test_each_mode_weighs_as_worked_by_hand(mode, band, expected):
    corr = _weights(mode, band)
    assert_close(corr.weights, torch.tensor(expected), atol=ATOL, rtol=0)
    rejected = (corr.weights == 0) & (MASK > 0)
    assert torch.equal(corr.rejected, rejected)  # weight 0 exactly where a mask mode rejected
    assert not corr.weights.requires_grad


def test_truncate_modes_flag_what_they_clipped_and_mask_modes_what_they_rejected():
    token = _weights("token_truncate")
    # 4 and 3 > 2.5 and 0.25 < 0.3 are clipped; the untrained token never is
    assert token.truncated.tolist() == [[False, False, True], [True, True, False]]
    assert not token.rejected.any()
    mask = _weights("token_mask")
    assert mask.rejected.tolist() == [[False, False, True], [True, True, False]]
    assert not mask.truncated.any()


def test_sequence_ratio_is_the_product_and_geometric_the_mean_over_trained_tokens():
    seq = level_ratio(LOG_RATIO, MASK, "sequence")
    geo = level_ratio(LOG_RATIO, MASK, "geometric")
    assert_close(seq[:, 0], torch.tensor([4.0, 0.75]), atol=ATOL, rtol=0)  # 2*0.5*4, 3*0.25
    assert_close(geo[:, 0], torch.tensor([4.0 ** (1 / 3), 0.75**0.5]), atol=ATOL, rtol=0)
    lengths = MASK.sum(-1)  # (2,) 3 and 2 trained tokens: R_i = G_i ** |y_i|
    assert_close(geo[:, 0] ** lengths, seq[:, 0], atol=1e-5, rtol=0)
    # one value per response, on each of its trained tokens; 1 where nothing is trained
    assert_close(seq[0], torch.full((3,), 4.0), atol=ATOL, rtol=0)
    assert seq[1, 2].item() == 1.0 and geo[1, 2].item() == 1.0


def test_the_untrained_token_changes_no_weight_whatever_its_log_ratio():
    for log_ratio in (1000.0, -1000.0, float("nan")):
        shifted = torch.where(MASK > 0, LOG_RATIO, log_ratio)
        for mode in CORRECTION_MODES:
            a = correction_weights(shifted, MASK, mode, 0.8, 1.5).weights
            b = correction_weights(LOG_RATIO, MASK, mode, 0.8, 1.5).weights
            assert torch.equal(a, b), (mode, log_ratio)


def test_icepop_zeroes_every_token_outside_its_band_and_keeps_the_ratio_inside():
    rho = torch.tensor([[0.3, 0.49, 0.5, 1.0, 4.9, 5.0, 5.01, 80.0]])  # a band [0.5, 5]
    corr = correction_weights(rho.log(), torch.ones_like(rho), "icepop", 0.5, 5.0)
    inside = torch.tensor([[False, False, True, True, True, True, False, False]])
    # 0.5 and 5.0 are the edges: exp(log 0.5), exp(log 5) may round either way, so test clear ones
    clear = torch.tensor([[True, True, False, True, True, False, True, True]])
    assert torch.equal((corr.weights > 0)[clear], inside[clear])
    assert_close(corr.weights[inside & clear], rho[inside & clear], atol=1e-6, rtol=0)
    assert (corr.weights[~inside & clear] == 0).all()


# --- figures -------------------------------------------------------------------------------------


def _sums(mode, log_ratio=LOG_RATIO, mask=MASK, band=BAND):
    corr = correction_weights(log_ratio, mask, mode, *band)
    sums = {k: v.item() for k, v in correction_sums(corr, log_ratio, mask).items()}
    assert set(sums) == {*CORRECTION_SUMS, *CORRECTION_MAXIMA}
    return sums, {k: sums.pop(k) for k in CORRECTION_MAXIMA}


def _figures(mode, band=BAND):
    return correction_figures(*_sums(mode, band=band))


# The five trained tokens' ratios 2, 0.5, 4, 3, 0.25:
#   mean = 9.75 / 5 = 1.95; min 0.25, max 4
#   ESS = 9.75^2 / (5 * (4 + 0.25 + 16 + 9 + 0.0625)) = 95.0625 / 146.5625 = 0.648614
#   k3 = rho - 1 - log rho: 0.306853 + 0.193147 + 1.613706 + 0.901388 + 0.636294 = 3.651388 / 5
#   log_ppl_abs_diff: response 0 |log 4| / 3 = 0.462098, response 1 |log 0.75| / 2 = 0.143841,
#   mean 0.302970
K3_KL = 3.651388 / 5
LOG_PPL = (math.log(4.0) / 3 + abs(math.log(0.75)) / 2) / 2


def test_token_figures_match_hand_computation():
    f = _figures("token_mask")
    assert f["rollout_is_mean"] == pytest.approx(1.95, abs=1e-6)
    assert f["rollout_is_min"] == pytest.approx(0.25, abs=1e-6)
    assert f["rollout_is_max"] == pytest.approx(4.0, abs=1e-6)
    assert f["rollout_is_eff_sample_size"] == pytest.approx(95.0625 / 146.5625, abs=1e-6)
    assert f["rollout_rs_masked_fraction"] == pytest.approx(3 / 5, abs=1e-7)  # 4, 3, 0.25 out
    assert f["k3_kl"] == pytest.approx(K3_KL, abs=1e-6)
    assert f["log_ppl_abs_diff"] == pytest.approx(LOG_PPL, abs=1e-6)


def test_sequence_figures_count_each_response_ratio_once_per_token():
    f = _figures("sequence_mask")
    # rho per trained token: 4, 4, 4, 0.75, 0.75; mean 13.5 / 5 = 2.7
    # ESS = 13.5^2 / (5 * (3 * 16 + 2 * 0.5625)) = 182.25 / 245.625 = 0.741985
    assert f["rollout_is_mean"] == pytest.approx(2.7, abs=1e-6)
    assert (f["rollout_is_min"], f["rollout_is_max"]) == pytest.approx((0.75, 4.0), abs=1e-6)
    assert f["rollout_is_eff_sample_size"] == pytest.approx(182.25 / 245.625, abs=1e-6)
    assert f["rollout_rs_masked_fraction"] == pytest.approx(3 / 5, abs=1e-7)  # response 0
    # k3_kl and log_ppl_abs_diff compare the log-probs themselves, whatever the mode
    assert f["k3_kl"] == pytest.approx(K3_KL, abs=1e-6)
    assert f["log_ppl_abs_diff"] == pytest.approx(LOG_PPL, abs=1e-6)


def test_figures_of_micro_batches_add_up_to_those_of_the_whole():
    # what the learner does with two micro-batches: add the sums, keep the largest maxima
    whole = _figures("token_truncate")
    parts = [_sums("token_truncate", LOG_RATIO[i : i + 1], MASK[i : i + 1]) for i in range(2)]
    sums = {k: sum(p[0][k] for p in parts) for k in CORRECTION_SUMS}
    maxima = {k: max(p[1][k] for p in parts) for k in CORRECTION_MAXIMA}
    for k, v in correction_figures(sums, maxima).items():
        assert v == pytest.approx(whole[k], abs=1e-6), k


def test_a_step_without_trained_tokens_reports_zeros():
    sums, maxima = _sums("token_mask", mask=torch.zeros_like(MASK))
    assert maxima == dict.fromkeys(CORRECTION_MAXIMA, 0.0)  # 0 is neutral for the largest
    assert set(correction_figures(sums, maxima).values()) == {0.0}


# --- in the losses -------------------------------------------------------------------------------


def _stale_batch(behaviour_shift=None):
    """Policy log-probs off the old ones (ratios cross PPO's clip), advantages of both signs,
    behaviour = old - log rho (the example above) unless shifted otherwise."""
    torch.manual_seed(0)
    old = -1.0 - torch.rand(2, 3)  # (2, 3)
    logprobs = old + torch.tensor([[0.3, -0.4, 0.1], [-0.2, 0.25, 0.0]])  # (2, 3)
    batch = make_batch(logprobs, torch.tensor([1.0, -0.5]), MASK, old_logprobs=old)
    shift = LOG_RATIO if behaviour_shift is None else behaviour_shift
    return replace(batch, behaviour_logprobs=old - shift)


def _policy_losses():
    return [name for name in LOSSES if name not in PAIR_LOSSES]


def _loss(name, batch, **algo):
    batch = replace(
        batch,
        logprobs=batch.logprobs.detach().clone().requires_grad_(True),
        rewards=torch.tensor([1.0, 0.0]),
        group_ids=torch.tensor([0, 0]),
    )
    loss, metrics = get_loss(name)(batch, AlgoParams(loss=name, **algo))
    loss.backward()
    return loss, metrics, batch.logprobs.grad


def _allowed_combinations():
    """(loss, mode, proximal) but the refused ones (test_bypass_truncation_...)."""
    return [
        (name, mode, proximal)
        for name in _policy_losses()
        for mode in CORRECTION_MODES
        for proximal in ("decoupled", "bypass")
        if not (proximal == "bypass" and mode in TRUNCATE_MODES and name in RATIO_LOSSES)
    ]


@pytest.mark.parametrize("name, mode, proximal", _allowed_combinations())
def test_with_behaviour_equal_to_old_every_mode_is_the_identity(name, mode, proximal):
    batch = _stale_batch(torch.zeros(2, 3))  # behaviour = old
    if proximal == "bypass":  # old := behaviour; on the iteration's first step pi = pi_old
        batch = replace(batch, logprobs=batch.old_logprobs.clone())
    band = {"correction_clip_min": 0.9, "correction_clip_max": 1.1}
    base, _, base_grad = _loss(name, batch)
    loss, metrics, grad = _loss(
        name, batch, rollout_correction=mode, correction_proximal=proximal, **band
    )
    assert_close(loss, base, atol=1e-6, rtol=0)
    assert_close(grad, base_grad, atol=1e-6, rtol=0)
    if mode != "none" or proximal == "bypass":  # the correction ran, and saw no gap
        assert metrics["rollout_rs_masked_tokens"].item() == 0.0
        assert metrics["k3_kl_sum"].item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("name", _policy_losses())
def test_tis_cap_is_token_truncate_with_the_same_numbers(name):
    assert AlgoParams(tis_cap=2.5) == AlgoParams(
        rollout_correction="token_truncate", correction_clip_max=2.5
    )
    batch = _stale_batch()
    old_loss, old_metrics, old_grad = _loss(name, batch, tis_cap=2.5)
    loss, metrics, grad = _loss(
        name, batch, rollout_correction="token_truncate", correction_clip_max=2.5
    )
    assert torch.equal(loss, old_loss) and torch.equal(grad, old_grad)
    assert old_metrics.keys() == metrics.keys()
    assert all(torch.equal(old_metrics[k], metrics[k]) for k in metrics)
    # and the truncation is real: the weights 4 and 3 were cut to 2.5
    assert metrics["tis_trunc_frac"].item() == 2.0


def test_a_decoupled_mode_weighs_each_tokens_clipped_term():
    # on-policy (pi = pi_old): PPO's term is -A per token, times the token_mask weight
    batch = _stale_batch()
    batch = replace(batch, logprobs=batch.old_logprobs.clone())
    mask = {"rollout_correction": "token_mask"}
    loss, _, _ = _loss("ppo_clip", batch, **mask, correction_clip_max=2.5)
    # band [0, 2.5]: response 0 (A = 1): -(2 + 0.5 + 0), 4 is out;
    # response 1 (A = -0.5): 0.5 * (0 + 0.25), 3 is out
    assert loss.item() == pytest.approx(-2.5 + 0.125, abs=1e-6)
    loss, _, _ = _loss("ppo_clip", batch, **mask, correction_clip_min=0.3, correction_clip_max=3.5)
    # band [0.3, 3.5]: 4 is out; 3 is in now and 0.25 out: 0.5 * (3 + 0) on response 1
    assert loss.item() == pytest.approx(-2.5 + 1.5, abs=1e-6)


@pytest.mark.parametrize("name", _policy_losses())
def test_bypass_gives_a_ratio_loss_the_mask_alone_and_a_plain_one_the_weight(name):
    # behaviour = pi - shift with sequence ratios pi / pi_behaviour R_0 = e^0.9 (2.46, out of
    # [0.3, 2.2]) and R_1 = e^-0.5 (0.61, in): response 0 is rejected, response 1 kept
    shift = torch.tensor([[0.3, 0.3, 0.3], [-0.25, -0.25, 7.0]])
    batch = _stale_batch()
    batch = replace(batch, behaviour_logprobs=batch.logprobs.detach() - shift)
    batch = replace(batch, old_logprobs=batch.behaviour_logprobs)  # what the learner passes
    band = {"correction_clip_max": 2.2}
    loss, metrics, _ = _loss(
        name, batch, rollout_correction="sequence_mask", correction_proximal="bypass", **band
    )
    assert metrics["rollout_rs_masked_tokens"].item() == 3.0
    kept = replace(batch, loss_mask=MASK * torch.tensor([[0.0], [1.0]]))
    mask_alone, _, _ = _loss(name, kept, correction_proximal="bypass")
    weighed, _, _ = _loss(name, replace(kept, token_weights=kept.token_weights * math.exp(-0.5)))
    if name in RATIO_LOSSES:  # its own ratio pi / pi_behaviour is the importance weight
        assert_close(loss, mask_alone, atol=1e-6, rtol=0)
    else:  # pg, rloo: the whole weight R_1 on the kept response
        assert_close(loss, weighed, atol=1e-6, rtol=0)
    assert not torch.allclose(mask_alone, weighed)  # the two cases differ


@pytest.mark.parametrize("name", sorted(RATIO_LOSSES))
def test_bypass_truncation_of_a_ratio_loss_is_refused(name):
    with pytest.raises(ValueError, match="would change nothing"):
        AlgoParams(loss=name, rollout_correction="token_truncate", correction_proximal="bypass")
    AlgoParams(loss="pg", rollout_correction="token_truncate", correction_proximal="bypass")


def test_a_correction_without_behaviour_logprobs_raises():
    batch = replace(_stale_batch(), behaviour_logprobs=None)
    with pytest.raises(ValueError, match="'sequence_mask' needs behaviour_logprobs"):
        _loss("ppo_clip", batch, rollout_correction="sequence_mask")


# --- refused settings ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, hint",
    [
        ({"rollout_correction": "seq_mask"}, "allowed: none, token_truncate, token_mask"),
        ({"correction_proximal": "behaviour"}, "allowed: decoupled, bypass"),
        ({"correction_clip_min": 2.0, "correction_clip_max": 1.5}, "must be <="),
        ({"correction_clip_max": 0.8}, "must hold 1"),
        ({"correction_clip_min": 1.2, "correction_clip_max": 2.0}, "must hold 1"),
        ({"tis_cap": 2.0, "rollout_correction": "token_mask"}, "older name"),
    ],
)
def test_bad_params_are_refused_with_the_reason(kw, hint):
    with pytest.raises(ValueError, match=hint):
        AlgoParams(**kw)


@pytest.mark.parametrize(
    "overrides, hint",
    [
        (["algo.rollout_correction='seq_mask'"], "'token_truncate', 'token_mask'"),
        (["algo.correction_proximal='old'"], "'decoupled' or 'bypass'"),
        (["algo.correction_clip_min=0.9", "algo.correction_clip_max=0.5"], "would be empty"),
        (["algo.correction_clip_max=0.9"], "must hold 1"),
        (["algo.tis_cap=2", "algo.rollout_correction='token_mask'"], "older name"),
        (["algo.tis_cap=2", "algo.correction_clip_max=2"], "set algo.correction_clip_max or"),
        (
            ["algo.rollout_correction='sequence_truncate'", "algo.correction_proximal='bypass'"],
            "would change nothing",
        ),
        (["algo.loss='online_dpo'", "algo.rollout_correction='icepop'"], "nor a rollout"),
        (["algo.loss='online_dpo'", "algo.correction_proximal='bypass'"], "nor a rollout"),
        (
            ["rollout.temperature=0", "algo.rollout_correction='token_mask'"],
            "decodes greedily",
        ),
        (["rollout.temperature=0", "algo.tis_cap=2"], "decodes greedily"),
    ],
)
def test_bad_config_is_refused_when_read(overrides, hint):
    with pytest.raises(ConfigError, match=hint):
        load_config(None, overrides)


# --- a run -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_offpolicy_run_with_a_correction_logs_the_figures(model_dir, tmp_path):
    from cadence.builder import build_run, train

    cfg = load_config(
        None,
        [
            f"model.path='{model_dir}'",
            "pipeline.mode='offpolicy'",
            "pipeline.placement='separate'",
            "pipeline.max_staleness=1",
            "pipeline.num_workers=1",
            "train.iterations=2",
            "train.prompts_per_iteration=4",
            "rollout.group_size=4",
            "rollout.max_new_tokens=10",
            "data.num_heldout=4",
            "metrics.progress=false",
            "reward.function='fixtures_rewards:even_length'",
            "algo.rollout_correction='sequence_mask'",
        ],
    )
    train(build_run(cfg), tmp_path, evaluate=False)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1]
    for r in records:
        assert 0 < r["rollout_is_min"] <= r["rollout_is_mean"] <= r["rollout_is_max"]
        assert 0 < r["rollout_is_eff_sample_size"] <= 1
        assert 0 <= r["rollout_rs_masked_fraction"] <= 1
        assert r["k3_kl"] >= 0 and r["log_ppl_abs_diff"] >= 0
    # iteration 0 trains fresh groups: the engine sampled from the learner's weights, so the
    # gap is float noise; iteration 1 trains groups one version old
    assert records[0]["k3_kl"] < 1e-6 and records[0]["rollout_rs_masked_fraction"] == 0
    assert records[1]["stale_token_frac"] > 0


def test_the_config_offers_exactly_the_modes_and_proximal_policies_the_algorithm_has():
    fields = AlgoConfig.model_fields
    assert get_args(fields["rollout_correction"].annotation) == CORRECTION_MODES
    assert get_args(fields["correction_proximal"].annotation) == PROXIMAL_POLICIES


def test_the_effective_sample_size_of_equal_ratios_is_one_whatever_the_rounding():
    # 34 equal ratios summed one by one: (sum)^2 / (n sum^2) comes out 1 + 2e-15
    rho = [0.5404843781807775] * 34
    total, squares = sum(rho), sum(r * r for r in rho)
    assert total * total / (34 * squares) > 1.0
    sums = dict.fromkeys(CORRECTION_SUMS, 0.0) | {
        "rollout_is_sum": total,
        "rollout_is_sq_sum": squares,
        "num_correction_tokens": 34.0,
        "num_correction_seqs": 2.0,
    }
    maxima = {"rollout_is_max": rho[0], "rollout_is_inv_min": 1 / rho[0]}
    assert correction_figures(sums, maxima)["rollout_is_eff_sample_size"] == 1.0
