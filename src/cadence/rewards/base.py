"""The reward seam: the `RewardFn` protocol, loading one by name, and failing safely.

A reward function maps (prompt, completion, reference answer) to a float; one that also takes
`metadata=` gets the row's own data (`Prompt.metadata`) where the row has some (rewards/calls.py:
the `reasoning_gym` reward scores so). `safe_reward` turns a raised exception or a non-finite
value into reward 0.0 plus an error string recorded on the completion, and `RewardErrorBudget`
stops the run once such errors exceed a set fraction, so a broken reward is neither fatal on one
sample nor silently trained on.

This module must not import torch or a model library, nor evaluate strings as code: a
"module:function" spec is resolved with importlib, never `eval`.
"""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Any, Protocol

from cadence.imports import SpecError, load_attribute
from cadence.rewards.aio import run_awaitable
from cadence.rewards.calls import call_reward
from cadence.rewards.timeout import TimedReward


class RewardFn(Protocol):
    """(prompt, completion, answer) -> float; an `async def` one (returning a coroutine of a
    float) is accepted wherever a reward is, and awaited on the process's reward loop. A reward
    may carry a `concurrency` attribute, its calls in flight at once unless `reward.concurrency`
    says otherwise (rewards/concurrent.py)."""

    def __call__(self, prompt: str, completion: str, answer: str) -> float: ...


class RowRewardFn(Protocol):
    """A reward that scores with the row's own data too (reasoning-gym's `score_answer`)."""

    def __call__(
        self, prompt: str, completion: str, answer: str, *, metadata: dict[str, Any] | None = None
    ) -> float: ...


class RewardBudgetExceeded(RuntimeError):
    """Too large a fraction of reward calls failed."""


@dataclass
class RewardResult:
    value: float
    error: str | None = None  # "ExcType: message" or "non-finite reward: ..."; None when fine


class RewardLoadError(ValueError):
    """`reward.function` names nothing loadable: bad input (exit code 2), the spec named."""


def load_reward(spec: str, answer_format: str = "auto", timeout_s: float = 0.0) -> RewardFn:
    """ "math" gives `MathReward(answer_format)`; "reasoning_gym" gives `ReasoningGymReward(
    answer_format)` (each row scored by its dataset's own `score_answer`); "package.module:name"
    imports a function or callable object (which reads the reference answer as it likes).

    With `timeout_s` > 0 every call returns within it or raises `RewardTimeout` (`TimedReward`).
    """
    fn = _import_reward(spec, answer_format)
    return TimedReward(fn, timeout_s, spec) if timeout_s > 0 else fn


def _import_reward(spec: str, answer_format: str) -> RewardFn:
    if spec == "math":
        from cadence.rewards.math import MathReward

        return MathReward(answer_format)
    if spec == "reasoning_gym":
        from cadence.rewards.reasoning_gym import ReasoningGymReward

        try:
            return ReasoningGymReward(answer_format)
        except ImportError as e:
            raise RewardLoadError(f"reward spec {spec!r}: {e}") from None
    try:
        fn = load_attribute(
            spec, "reward spec", "'math', 'reasoning_gym' or 'package.module:function'"
        )
    except SpecError as e:
        raise RewardLoadError(str(e)) from e.__cause__
    if isinstance(fn, type) or not callable(fn):
        raise RewardLoadError(
            f"reward spec {spec!r}: {spec.partition(':')[2]!r} is a {type(fn).__name__}, not a "
            "function or a callable instance (prompt, completion, answer) -> float"
        )
    return fn


def safe_reward(
    fn: RewardFn,
    prompt: str,
    completion: str,
    answer: str,
    metadata: dict[str, Any] | None = None,
) -> RewardResult:
    """Call `fn` (with the row's `metadata` if it takes it; awaited if async); an exception or a
    non-finite or non-numeric value gives 0.0 and an error string.

    Catches `Exception` only: KeyboardInterrupt and SystemExit still stop the program.
    """
    try:
        value = call_reward(fn, prompt, completion, answer, metadata)
        if inspect.isawaitable(value):
            value = run_awaitable(value)
    except Exception as e:
        return failed_reward(e)
    return checked_reward(value)


def failed_reward(error: Exception) -> RewardResult:
    """A call that raised: 0.0, and the error as "ExcType: message"."""
    return RewardResult(0.0, f"{type(error).__name__}: {error}")


def checked_reward(value: Any) -> RewardResult:
    """A returned value as a reward: a finite number, else 0.0 and why not."""
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        shown = repr(value)[:80]
        return RewardResult(0.0, f"non-finite reward: got {type(value).__name__} {shown}")
    return RewardResult(float(value), None)


class RewardErrorBudget:
    """Stops a run whose reward fails too often (`RewardBudgetExceeded`, exit code 1).

    The rule, over every reward call of the run so far (a call fails when it raises, returns a
    non-finite or non-numeric value, or runs past `reward.timeout_s`):
    - after each iteration, stop if every call so far failed: a reward that scores nothing stops
      the run after its first iteration, however small;
    - after each iteration, stop if more than `max_error_fraction` of the calls failed, once at
      least `min_samples` calls were made (a few failures in a small first iteration are noise);
    - at the end of the run (`finish`, before the final model is written), stop if more than
      `max_error_fraction` failed, however few calls there were.
    `max_error_fraction = 1` tolerates every failure.
    """

    def __init__(self, max_error_fraction: float = 0.1, min_samples: int = 64) -> None:
        if not 0.0 <= max_error_fraction <= 1.0:
            raise ValueError(f"max_error_fraction must be in [0, 1], got {max_error_fraction}")
        if min_samples < 0:
            raise ValueError(f"min_samples must be >= 0, got {min_samples}")
        self.max_error_fraction = max_error_fraction
        self.min_samples = min_samples
        self.num_samples = 0
        self.num_errors = 0
        self.example: str | None = None  # the first error seen, quoted when the run stops

    @property
    def error_fraction(self) -> float:
        return self.num_errors / self.num_samples if self.num_samples else 0.0

    def record(self, n_samples: int, n_errors: int, example: str | None = None) -> None:
        """`count`, then `check`."""
        self.count(n_samples, n_errors, example)
        self.check()

    def count(self, n_samples: int, n_errors: int, example: str | None = None) -> None:
        """Count an iteration's calls and failures (`example`: one failure's error)."""
        if n_samples < 0 or not 0 <= n_errors <= n_samples:
            raise ValueError(f"need 0 <= n_errors <= n_samples, got {n_errors} and {n_samples}")
        self.num_samples += n_samples
        self.num_errors += n_errors
        self.example = self.example or example

    def check(self) -> None:
        """The check after an iteration (the first two rules): raise if the budget is spent."""
        if self.max_error_fraction >= 1.0 or not self.num_errors:
            return
        if self.num_errors == self.num_samples:
            raise self._exceeded("every reward call failed so far")
        if self.num_samples >= self.min_samples:
            self._check()

    def finish(self) -> None:
        """The end-of-run check: over budget however few calls were made."""
        if self.max_error_fraction < 1.0:
            self._check()

    def _check(self) -> None:
        if self.error_fraction > self.max_error_fraction:
            raise self._exceeded(f"more than max_error_fraction={self.max_error_fraction} failed")

    def _exceeded(self, why: str) -> RewardBudgetExceeded:
        return RewardBudgetExceeded(
            f"{self.num_errors} of {self.num_samples} reward calls failed "
            f"({self.error_fraction:.1%}): {why}; first error: {self.example or '?'}. Fix the "
            "reward function, or raise reward.max_error_fraction (1 tolerates every failure)"
        )


class ConstantReward:
    """Test double: the same value for every completion."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __call__(self, prompt: str, completion: str, answer: str) -> float:
        return self.value


class TableReward:
    """Test double: a value per completion text; unknown ones raise KeyError or get `default`."""

    def __init__(self, table: dict[str, float], default: float | None = None) -> None:
        self.table = dict(table)
        self.default = default

    def __call__(self, prompt: str, completion: str, answer: str) -> float:
        if completion in self.table:
            return self.table[completion]
        if self.default is None:
            raise KeyError(f"TableReward has no value for completion {completion!r}")
        return self.default
