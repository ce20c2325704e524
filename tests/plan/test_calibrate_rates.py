"""The calibration's fits on made-up timings: the per-context-token decode cost and the training
rate over every sampled group are recovered exactly where the timings follow the cost model."""

from types import SimpleNamespace

import pytest

from cadence.config import load_config
from cadence.metrics.trace import Span, Tracer
from cadence.plan.calibrate import _computed_tokens, _per_context_token, _per_token_over_all

BASE, PER_SEQ, PER_CTX, PROMPT = 2e-3, 1e-4, 3e-6, 20


def timed(rows: int, steps: int) -> float:
    """Decoding `steps` tokens of `rows` sequences, step i holding PROMPT + i tokens each."""
    return sum(BASE + PER_SEQ * rows + PER_CTX * rows * (PROMPT + i) for i in range(steps))


@pytest.mark.parametrize("cap", [96, 256])
def test_the_cost_of_each_token_in_the_cache_is_recovered(cap):
    cfg = load_config(None, [f"rollout.max_new_tokens={cap}"])
    steps, rows = 24, 128
    per_step = (timed(rows, steps) - timed(rows, 1)) / (steps - 1)
    assert _per_context_token(timed, rows, steps, per_step, cfg) == pytest.approx(PER_CTX, 1e-9)


def test_no_longer_run_fits_under_a_short_cap():
    cfg = load_config(None, ["rollout.max_new_tokens=40"])
    assert _per_context_token(timed, 16, 24, 1.0, cfg) == 0.0


def test_the_training_rate_is_the_whole_sample_s_less_each_micro_batch_s_fixed_cost():
    groups = [
        SimpleNamespace(
            group_size=2,
            prompt_ids=[1] * 5,
            completions=[SimpleNamespace(token_ids=[1] * n) for n in (3, 4 * k + 1)],
        )
        for k in range(10)
    ]
    tokens = _computed_tokens(groups, shared=True)
    tracer, per_token, fixed = Tracer(), 1e-3, 0.05

    class Learner:
        def train_iteration(self, scored, n):
            assert n == len(groups)
            for i in range(0, n, 4):  # micro-batches of 4 groups
                t = fixed + per_token * _computed_tokens(groups[i : i + 4], True)
                tracer.spans.append(Span("forward_backward", "learner", 0.0, t))

    scorer = SimpleNamespace(score=lambda gs: gs, end_iteration=lambda: None)
    got = _per_token_over_all(Learner(), scorer, tracer, groups, fixed, 4, True)
    assert tokens == 10 * 5 + sum(3 + 4 * k + 1 for k in range(10))
    assert got == pytest.approx(per_token, rel=1e-9)
