import pytest
import torch
from torch.testing import assert_close

from cadence.algo.advantages import (
    grpo_advantages,
    reinforce_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)


def test_grpo_scales_by_population_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 0.0, 0.0, 0.0]])
    advantages = grpo_advantages(rewards, eps=0.0, std="population")
    # row 0: mean 0.5, population std 0.5 -> [1, -1, -1, 1]
    #   (the unbiased std sqrt(1/3) would give +-0.866 instead)
    # row 1: mean 0.5, centred [1.5, -0.5, -0.5, -0.5], population var (2.25 + 3 * 0.25) / 4
    #   = 0.75, std sqrt(3)/2 -> [1.5 / (sqrt(3)/2), -0.5 / (sqrt(3)/2), ...]
    #   = [sqrt(3), -1/sqrt(3), -1/sqrt(3), -1/sqrt(3)] = [1.7321, -0.5774, -0.5774, -0.5774]
    s3 = 3.0**0.5
    expected = torch.tensor([[1.0, -1.0, -1.0, 1.0], [s3, -1 / s3, -1 / s3, -1 / s3]])
    assert_close(advantages, expected, atol=1e-6, rtol=0)


def test_grpo_small_eps_barely_shrinks_advantages():
    advantages = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), eps=1e-6, std="population")
    # 0.5 / (0.5 + 1e-6) = 0.999998
    assert_close(advantages, torch.tensor([[1.0, -1.0, -1.0, 1.0]]), atol=1e-5, rtol=0)


def test_grpo_default_is_the_unbiased_std_plus_1e_4():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 0.0, 0.0, 0.0]])
    advantages = grpo_advantages(rewards)
    # row 0: mean 0.5, centred +-0.5, unbiased var (4 * 0.25) / 3 = 1/3, std 0.577350
    #   -> 0.5 / (0.577350 + 1e-4) = 0.5 / 0.577450 = 0.865875
    # row 1: centred [1.5, -0.5, -0.5, -0.5], unbiased var (2.25 + 0.75) / 3 = 1, std 1
    #   -> [1.5, -0.5, -0.5, -0.5] / 1.0001 = [1.499850, -0.499950, -0.499950, -0.499950]
    a, b = 0.865875, -0.499950
    expected = torch.tensor([[a, -a, -a, a], [1.499850, b, b, b]])
    assert_close(advantages, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("group_size", [2, 8, 16])
def test_population_std_advantages_are_sqrt_g_over_g_minus_1_larger(group_size: int):
    gen = torch.Generator().manual_seed(group_size)
    rewards = torch.rand(5, group_size, generator=gen)
    unbiased = grpo_advantages(rewards, eps=0.0)
    population = grpo_advantages(rewards, eps=0.0, std="population")
    # var_pop = var_unbiased * (G - 1) / G, so A_pop / A_unbiased = sqrt(G / (G - 1)):
    # 1.414214 at G = 2, 1.069045 at G = 8, 1.032796 at G = 16
    ratio = (group_size / (group_size - 1)) ** 0.5
    assert_close(population, unbiased * ratio, atol=1e-5, rtol=1e-5)


def test_near_equal_rewards_stay_near_zero_with_the_default_eps():
    rewards = torch.tensor([[1.0, 1.0 + 1e-6]], dtype=torch.float64)
    # centred -+5e-7; unbiased std = 1e-6 / sqrt(2) = 7.071068e-7
    # default eps 1e-4: 5e-7 / (7.071068e-7 + 1e-4) = 5e-7 / 1.007071e-4 = 0.004965
    assert_close(
        grpo_advantages(rewards), torch.tensor([[-0.004965, 0.004965]]).double(), atol=1e-6, rtol=0
    )
    # eps 1e-6 (the former default, with the population std 5e-7): 5e-7 / 1.5e-6 = 0.333333,
    # noise amplified to a third of full scale
    old = grpo_advantages(rewards, eps=1e-6, std="population")
    assert_close(old, torch.tensor([[-1 / 3, 1 / 3]]).double(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("std", ["unbiased", "population"])
def test_grpo_group_of_one_gets_zero_not_nan(std: str):
    # one response: centred 0 (the unbiased std of one value would be NaN)
    advantages = grpo_advantages(torch.tensor([[0.7], [0.2]]), std=std)
    assert_close(advantages, torch.zeros(2, 1), atol=0, rtol=0)


def test_grpo_rejects_an_unknown_std():
    with pytest.raises(ValueError, match="unknown std 'sample'; allowed: unbiased, population"):
        grpo_advantages(torch.zeros(1, 2), std="sample")


def test_grpo_without_std_only_centres():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 0.0, 0.0, 0.0]])
    advantages = grpo_advantages(rewards, scale_by_std=False)
    # row 0: mean 0.5 -> [0.5, -0.5, -0.5, 0.5]; row 1: mean 0.5 -> [1.5, -0.5, -0.5, -0.5]
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [1.5, -0.5, -0.5, -0.5]])
    assert_close(advantages, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("std", ["unbiased", "population"])
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_equal_rewards_give_zeros_not_nan(scale_by_std: bool, std: str):
    rewards = torch.tensor([[3.0, 3.0, 3.0, 3.0]])
    advantages = grpo_advantages(rewards, scale_by_std=scale_by_std, std=std)
    # mean 3, centred [0, 0, 0, 0], std 0 -> 0 / (0 + 1e-4) = 0
    assert_close(advantages, torch.zeros(1, 4), atol=0, rtol=0)


def test_rloo_baseline_is_mean_of_the_others():
    advantages = rloo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    # sample 0: 1 - mean(0, 0, 0) = 1; samples 1-3: 0 - mean(1, 0, 0) = -1/3
    expected = torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3]])
    assert_close(advantages, expected, atol=1e-6, rtol=0)


def test_rloo_rejects_group_of_one():
    with pytest.raises(ValueError, match="group_size=1"):
        rloo_advantages(torch.tensor([[1.0], [0.0]]))


def test_reinforce_subtracts_scalar_baseline():
    advantages = reinforce_advantages(torch.tensor([[1.0, 0.0], [0.5, 1.0]]), baseline=0.25)
    # each reward minus 0.25: [[0.75, -0.25], [0.25, 0.75]]
    expected = torch.tensor([[0.75, -0.25], [0.25, 0.75]])
    assert_close(advantages, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("fn", [grpo_advantages, rloo_advantages, reinforce_advantages])
def test_estimators_reject_rewards_without_group_axis(fn):
    with pytest.raises(ValueError, match=r"got shape \(4,\)"):
        fn(torch.tensor([1.0, 0.0, 0.0, 1.0]))


# --- REINFORCE++ ------------------------------------------------------------------------------


def test_reinforce_pp_normalises_over_the_batch_tokens():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    lengths = torch.tensor([[2, 1], [1, 0]])
    advantages = reinforce_pp_advantages(rewards, lengths, eps=0.0)
    # tokens: the reward 1 twice (length 2), 0 twice (lengths 1 and 1); the empty response adds
    # none. n = 4, mean = (1 + 1 + 0 + 0) / 4 = 0.5, squared deviations 4 * 0.25 = 1,
    # unbiased var 1 / 3, std 0.577350 -> (1 - 0.5) / 0.577350 = 0.866025, (0 - 0.5) / ... =
    # -0.866025 (the empty response too: it gets the value its reward maps to, and trains nothing)
    a = 0.866025
    assert_close(advantages, torch.tensor([[a, -a], [-a, -a]]), atol=1e-6, rtol=0)
    # population: var 1 / 4, std 0.5 -> +-1
    population = reinforce_pp_advantages(rewards, lengths, eps=0.0, std="population")
    assert_close(population, torch.tensor([[1.0, -1.0], [-1.0, -1.0]]), atol=1e-6, rtol=0)


def test_reinforce_pp_weighs_each_response_by_its_tokens():
    rewards = torch.tensor([[1.0, 0.0]])
    # lengths 3 and 1: mean over 4 tokens = 3 / 4 = 0.75 (not the per-response 0.5)
    # deviations 0.25 (x3), -0.75 (x1): squares 3 * 0.0625 + 0.5625 = 0.75; population var
    # 0.75 / 4 = 0.1875, std 0.433013 -> 0.25 / 0.433013 = 0.577350, -0.75 / 0.433013 = -1.732051
    advantages = reinforce_pp_advantages(rewards, torch.tensor([[3, 1]]), eps=0.0, std="population")
    assert_close(advantages, torch.tensor([[0.577350, -1.732051]]), atol=1e-6, rtol=0)


def test_reinforce_pp_baseline_subtracts_each_group_mean_first():
    rewards = torch.tensor([[1.0, 0.0], [3.0, 3.0]])
    lengths = torch.ones(2, 2, dtype=torch.long)
    # group means 0.5 and 3 -> scores [0.5, -0.5], [0, 0]; without the baseline the second
    # group's reward 3 would dominate. Over the 4 tokens: mean 0, squares 0.5, population var
    # 0.125, std 0.353553 -> [1.414214, -1.414214], [0, 0]
    advantages = reinforce_pp_advantages(
        rewards, lengths, group_baseline=True, eps=0.0, std="population"
    )
    s2 = 2.0**0.5
    assert_close(advantages, torch.tensor([[s2, -s2], [0.0, 0.0]]), atol=1e-6, rtol=0)


def test_reinforce_pp_equal_rewards_and_tiny_batches_give_zeros():
    lengths = torch.tensor([[2, 3]])
    # equal rewards: centred 0 -> 0 / (0 + eps) = 0
    same = reinforce_pp_advantages(torch.tensor([[0.5, 0.5]]), lengths)
    assert_close(same, torch.zeros(1, 2), atol=0, rtol=0)
    # one token in the whole batch: no spread to normalise by
    single = reinforce_pp_advantages(torch.tensor([[1.0, 0.0]]), torch.tensor([[1, 0]]))
    assert_close(single, torch.zeros(1, 2), atol=0, rtol=0)


def test_reinforce_pp_rejects_lengths_of_another_shape():
    with pytest.raises(ValueError, match=r"lengths must have the shape of rewards \(1, 2\)"):
        reinforce_pp_advantages(torch.zeros(1, 2), torch.ones(2, 1))
