import pytest
import torch
from torch.testing import assert_close

from cadence.algo.advantages import grpo_advantages, reinforce_advantages, rloo_advantages


def test_grpo_scales_by_population_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 0.0, 0.0, 0.0]])
    advantages = grpo_advantages(rewards, eps=0.0)
    # row 0: mean 0.5, population std 0.5 -> [1, -1, -1, 1]
    #   (the unbiased std sqrt(1/3) would give +-0.866 instead)
    # row 1: mean 0.5, centred [1.5, -0.5, -0.5, -0.5], population var (2.25 + 3 * 0.25) / 4
    #   = 0.75, std sqrt(3)/2 -> [1.5 / (sqrt(3)/2), -0.5 / (sqrt(3)/2), ...]
    #   = [sqrt(3), -1/sqrt(3), -1/sqrt(3), -1/sqrt(3)] = [1.7321, -0.5774, -0.5774, -0.5774]
    s3 = 3.0**0.5
    expected = torch.tensor([[1.0, -1.0, -1.0, 1.0], [s3, -1 / s3, -1 / s3, -1 / s3]])
    assert_close(advantages, expected, atol=1e-6, rtol=0)


def test_grpo_default_eps_barely_shrinks_advantages():
    advantages = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    # 0.5 / (0.5 + 1e-6) = 0.999998
    assert_close(advantages, torch.tensor([[1.0, -1.0, -1.0, 1.0]]), atol=1e-5, rtol=0)


def test_grpo_without_std_only_centres():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 0.0, 0.0, 0.0]])
    advantages = grpo_advantages(rewards, scale_by_std=False)
    # row 0: mean 0.5 -> [0.5, -0.5, -0.5, 0.5]; row 1: mean 0.5 -> [1.5, -0.5, -0.5, -0.5]
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [1.5, -0.5, -0.5, -0.5]])
    assert_close(advantages, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_equal_rewards_give_zeros_not_nan(scale_by_std: bool):
    advantages = grpo_advantages(torch.tensor([[3.0, 3.0, 3.0, 3.0]]), scale_by_std=scale_by_std)
    # mean 3, centred [0, 0, 0, 0], std 0 -> 0 / (0 + 1e-6) = 0
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
