"""Learning curves: which held-out points are drawn, and that the picture is written."""

import math

from cadence.metrics.curves import draw_curves, heldout_points
from cadence.metrics.figures import binomial_stderr


def _records(evals: dict[int, float]) -> list[dict]:
    return [
        {"iteration": k, "reward_mean": 0.1 * k, "kl": 0.01 * k, "response_tokens_mean": 10.0}
        | ({"heldout_accuracy": evals[k], "heldout_accuracy_stderr": 0.02} if k in evals else {})
        for k in range(6)
    ]


def test_heldout_points_are_before_each_evaluation_and_after():
    # evaluations after iterations 2 and 4 (k = 1, 3): points at 2 and 4 trained iterations;
    # before RL at 0, after RL at 6 (the last evaluation was not at the end)
    points = heldout_points(_records({1: 0.4, 3: 0.5}), before=(0.3, 0.01), after=(0.6, 0.03))
    assert points == [(0, 0.3, 0.01), (2, 0.4, 0.02), (4, 0.5, 0.02), (6, 0.6, 0.03)]
    # an evaluation after the last iteration is the after-RL point: not drawn twice
    points = heldout_points(_records({5: 0.7}), before=(0.3, 0.01), after=(0.7, 0.02))
    assert points == [(0, 0.3, 0.01), (6, 0.7, 0.02)]
    # a run without evaluations before and after (NaN) draws none
    assert heldout_points(_records({}), (math.nan, math.nan), (math.nan, math.nan)) == []


def test_binomial_stderr_by_hand():
    # p = 0.3 on 500 problems: sqrt(0.3 * 0.7 / 500) = sqrt(0.00042) = 0.020494
    assert math.isclose(binomial_stderr(0.3, 500), 0.020494, abs_tol=1e-6)
    assert binomial_stderr(1.0, 10) == 0.0 and math.isnan(binomial_stderr(0.5, 0))


def test_draw_curves_writes_a_png(tmp_path):
    out = draw_curves(_records({1: 0.4}), tmp_path / "curves.png", (0.3, 0.02), (0.5, 0.02))
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
