"""The reward seam: loading by spec, safe calls, and the error budget."""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Iterator

import pytest

from cadence.rewards import MathReward
from cadence.rewards.base import (
    ConstantReward,
    RewardBudgetExceeded,
    RewardErrorBudget,
    RewardResult,
    TableReward,
    load_reward,
    safe_reward,
)


@pytest.fixture
def reward_module() -> Iterator[str]:
    module = types.ModuleType("fake_rewards_for_test")
    module.length = lambda prompt, completion, answer: float(len(completion))  # type: ignore[attr-defined]
    module.instance = ConstantReward(0.5)  # type: ignore[attr-defined]
    module.klass = ConstantReward  # type: ignore[attr-defined]
    module.number = 3  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    yield module.__name__
    del sys.modules[module.__name__]


def test_load_reward_math() -> None:
    assert isinstance(load_reward("math"), MathReward)


def test_load_reward_module_function(reward_module: str) -> None:
    assert load_reward(f"{reward_module}:length")("", "abc", "") == 3.0
    assert load_reward(f"{reward_module}:instance")("", "abc", "") == 0.5


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("nonsense", "must be 'math', 'reasoning_gym' or 'package.module:function'"),
        (":fn", "must be 'math'"),
        ("mod:", "must be 'math'"),
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        ("{mod}:missing", "has no 'missing'"),
        ("{mod}:number", "'number' is a int, not a function"),
        ("{mod}:klass", "'klass' is a type, not a function"),
    ],
)
def test_load_reward_errors_name_the_spec(reward_module: str, spec: str, match: str) -> None:
    spec = spec.format(mod=reward_module)
    with pytest.raises(ValueError, match=match) as info:
        load_reward(spec)
    assert repr(spec) in str(info.value)


def raising(prompt: str, completion: str, answer: str) -> float:
    raise ZeroDivisionError("boom")


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (ConstantReward(0.25), RewardResult(0.25, None)),
        (ConstantReward(1), RewardResult(1.0, None)),
        (raising, RewardResult(0.0, "ZeroDivisionError: boom")),
        (ConstantReward(math.nan), RewardResult(0.0, "non-finite reward: got float nan")),
        (ConstantReward(math.inf), RewardResult(0.0, "non-finite reward: got float inf")),
        (ConstantReward("1"), RewardResult(0.0, "non-finite reward: got str '1'")),  # type: ignore[arg-type]
        (ConstantReward(None), RewardResult(0.0, "non-finite reward: got NoneType None")),  # type: ignore[arg-type]
    ],
)
def test_safe_reward_never_raises(fn: object, expected: RewardResult) -> None:
    result = safe_reward(fn, "p", "c", "a")  # type: ignore[arg-type]
    assert result == expected
    assert isinstance(result.value, float)


def test_table_reward() -> None:
    table = TableReward({"good": 1.0, "bad": 0.0})
    assert table("", "good", "") == 1.0
    assert safe_reward(table, "", "other", "").error == (
        "KeyError: \"TableReward has no value for completion 'other'\""
    )
    assert TableReward({}, default=0.5)("", "x", "") == 0.5


def test_budget_waits_for_min_samples_while_some_calls_succeed() -> None:
    budget = RewardErrorBudget(max_error_fraction=0.1, min_samples=64)
    budget.record(32, 8)  # 25% errors, but only 32 samples seen
    assert budget.num_errors == 8 and budget.error_fraction == 0.25
    with pytest.raises(RewardBudgetExceeded, match=r"16 of 64 reward calls failed \(25\.0%"):
        budget.record(32, 8)


def test_a_reward_that_always_fails_stops_at_once_however_few_calls() -> None:
    budget = RewardErrorBudget(max_error_fraction=0.1, min_samples=64)
    with pytest.raises(
        RewardBudgetExceeded,
        match=r"16 of 16 reward calls failed \(100\.0%\): every reward call failed so far; "
        r"first error: ValueError: boom",
    ):
        budget.record(16, 16, "ValueError: boom")
    RewardErrorBudget(max_error_fraction=1.0).record(16, 16)  # 1 tolerates everything


def test_the_end_of_the_run_checks_the_budget_however_few_calls() -> None:
    budget = RewardErrorBudget(max_error_fraction=0.1, min_samples=64)
    budget.record(16, 2)
    budget.record(16, 2)  # 4 of 32 (12.5%): over 10%, under min_samples
    with pytest.raises(RewardBudgetExceeded, match=r"4 of 32 .*more than max_error_fraction=0\.1"):
        budget.finish()
    within = RewardErrorBudget(max_error_fraction=0.1)
    within.record(30, 3)
    within.finish()  # exactly 10% is within


def test_budget_allows_exactly_the_max_fraction() -> None:
    budget = RewardErrorBudget(max_error_fraction=0.1, min_samples=10)
    budget.record(100, 10)  # 10% is not more than 10%
    with pytest.raises(RewardBudgetExceeded, match="11 of 101"):
        budget.record(1, 1)


def test_budget_validates_arguments() -> None:
    with pytest.raises(ValueError, match="max_error_fraction"):
        RewardErrorBudget(max_error_fraction=1.5)
    with pytest.raises(ValueError, match="min_samples"):
        RewardErrorBudget(min_samples=-1)
    with pytest.raises(ValueError, match="n_errors <= n_samples"):
        RewardErrorBudget().record(2, 3)


def test_public_surface() -> None:
    import cadence.rewards

    assert set(cadence.rewards.__all__) == {
        "BatchScorer",
        "RewardSpec",
        "build_batch_scorer",
        "finite_scores",
        "DEFAULT_CONCURRENCY",
        "ConstantReward",
        "MathReward",
        "RewardBudgetExceeded",
        "RewardCall",
        "RewardScorer",
        "RewardErrorBudget",
        "RewardFn",
        "RewardLoadError",
        "RewardResult",
        "RewardRunner",
        "RewardTimeout",
        "RowRewardFn",
        "TableReward",
        "TimedReward",
        "as_runner",
        "extract_prediction",
        "load_reward",
        "load_runner",
        "safe_reward",
    }
