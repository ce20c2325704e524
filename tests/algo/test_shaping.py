import pytest
import torch
from torch.testing import assert_close

from cadence.algo.shaping import overlong_penalty


def test_overlong_penalty_ramps_linearly_over_the_buffer():
    lengths = torch.tensor([1, 12, 13, 14, 16, 20])
    penalty = overlong_penalty(lengths, max_new_tokens=20, buffer=8, penalty=1.0)
    # L_max = 20, L_cache = 8: no penalty up to 20 - 8 = 12 tokens, then (12 - |y|) / 8:
    #   1 -> 0; 12 -> 0; 13 -> -1/8 = -0.125; 14 -> -0.25; 16 -> -0.5; 20 (cut) -> -1
    expected = torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -1.0])
    assert_close(penalty, expected, atol=1e-7, rtol=0)


def test_overlong_penalty_scales_with_the_factor_and_saturates():
    lengths = torch.tensor([[14, 25]])
    penalty = overlong_penalty(lengths, max_new_tokens=20, buffer=8, penalty=0.5)
    # 14 -> 0.5 * -0.25 = -0.125; 25 is past L_max (DAPO: -1) -> 0.5 * -1 = -0.5
    assert_close(penalty, torch.tensor([[-0.125, -0.5]]), atol=1e-7, rtol=0)


def test_overlong_buffer_zero_is_off():
    penalty = overlong_penalty(torch.tensor([5, 20]), max_new_tokens=20, buffer=0, penalty=1.0)
    assert_close(penalty, torch.zeros(2), atol=0, rtol=0)


@pytest.mark.parametrize("buffer", [-1, 21])
def test_overlong_buffer_outside_the_response_is_refused(buffer: int):
    with pytest.raises(ValueError, match=r"must be in \[0, max_new_tokens = 20\]"):
        overlong_penalty(torch.tensor([5]), max_new_tokens=20, buffer=buffer, penalty=1.0)
