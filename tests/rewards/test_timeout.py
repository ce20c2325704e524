"""Reward calls with a deadline: in any thread, a call past `timeout_s` is cut, scores 0 as a
reward error that names the function, and the next call runs normally."""

from __future__ import annotations

import threading
import time

import pytest

from cadence.rewards import MathReward, RewardTimeout, TimedReward, load_reward, safe_reward
from cadence.types import REWARD_TIMEOUT, Completion


@pytest.fixture
def release():
    """An event a hung reward waits on; set at the end so no helper thread outlives the test."""
    event = threading.Event()
    yield event
    event.set()


def _hangs_on_odd(release: threading.Event):
    def reward(prompt: str, completion: str, answer: str) -> float:
        if len(completion) % 2:
            release.wait()
        return float(len(completion))

    return reward


def _in_thread(fn):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(timeout=30)
    return out[0]


@pytest.mark.parametrize("thread", ["main", "other"])
def test_a_call_that_hangs_is_cut_at_the_timeout_and_scores_0_naming_the_function(release, thread):
    fn = TimedReward(_hangs_on_odd(release), 0.2, "my_rewards:grade")

    def score() -> tuple:
        t0 = time.perf_counter()
        hung = safe_reward(fn, "p", "odd", "a")
        elapsed = time.perf_counter() - t0
        return hung, elapsed, safe_reward(fn, "p", "even", "a")  # the next call: a fresh helper

    hung, elapsed, after = score() if thread == "main" else _in_thread(score)
    assert 0.2 <= elapsed < 1.5  # cut at the deadline, not at the call's end (never)
    assert hung.value == 0.0
    assert hung.error.startswith(REWARD_TIMEOUT)
    assert "reward 'my_rewards:grade' did not return within reward.timeout_s = 0.2 s" in hung.error
    assert Completion([], [], reward_error=hung.error).reward_timed_out
    assert after.value == 4.0 and after.error is None
    assert fn.num_timeouts == 1


def test_the_main_thread_keeps_its_own_alarm_and_a_reward_may_use_signal_alarm():
    import signal

    fired: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
    signal.setitimer(signal.ITIMER_REAL, 100.0)  # someone else's timer, running
    try:
        # MathReward in the main thread times itself with math-verify's signal.alarm
        fn = TimedReward(MathReward(), 5.0, "math")
        assert fn("q", "#### 5", "2 + 3 = 5\n#### 5") == 1.0
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 90.0 < left <= 100.0  # given back what was left of it
        signal.setitimer(signal.ITIMER_REAL, 0.01)
        time.sleep(0.2)
        assert fired == [1]  # and its own handler
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_reward_catching_every_exception_cannot_swallow_the_deadline():
    def stubborn(prompt: str, completion: str, answer: str) -> float:
        try:
            time.sleep(60)
        except Exception:
            return 1.0  # would pass for a score if the deadline were an Exception
        return 2.0

    t0 = time.perf_counter()
    result = safe_reward(TimedReward(stubborn, 0.2, "x:stubborn"), "", "", "")
    assert result.value == 0.0 and result.error.startswith(REWARD_TIMEOUT)
    assert time.perf_counter() - t0 < 1.5


def test_values_and_exceptions_pass_through_unchanged():
    def raises(prompt: str, completion: str, answer: str) -> float:
        raise KeyError("no grade")

    assert TimedReward(lambda p, c, a: 0.75, 1.0, "x")("", "", "") == 0.75
    with pytest.raises(KeyError, match="no grade"):
        TimedReward(raises, 1.0, "x")("", "", "")
    result = safe_reward(TimedReward(raises, 1.0, "x"), "", "", "")
    assert result.error == "KeyError: 'no grade'"
    assert not Completion([], [], reward_error=result.error).reward_timed_out


def test_the_math_reward_runs_under_the_deadline_from_any_thread():
    fn = load_reward("math", timeout_s=5.0)
    assert isinstance(fn, TimedReward) and isinstance(fn.fn, MathReward)
    answer = "2 + 3 = 5\n#### 5"
    assert fn("q", "#### 5", answer) == 1.0
    assert _in_thread(lambda: fn("q", "#### 6", answer)) == 0.0
    assert load_reward("math", timeout_s=0).__class__ is MathReward  # 0: no deadline, no hop


def test_a_timeout_is_an_exception_the_safe_call_catches():
    assert issubclass(RewardTimeout, Exception)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        TimedReward(lambda p, c, a: 0.0, 0, "x")
