"""Many reward calls at once (`RewardRunner`): bounded, in order, each call within its own
deadline, async rewards awaited, and a reward that hangs forever holding a bounded number of
threads."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from cadence.rewards import (
    DEFAULT_CONCURRENCY,
    RewardCall,
    RewardRunner,
    TimedReward,
    as_runner,
    load_runner,
    safe_reward,
)
from cadence.rewards import concurrent as concurrent_module
from cadence.types import REWARD_TIMEOUT


def _calls(n: int) -> list[RewardCall]:
    return [RewardCall("p", "x" * i, "a") for i in range(n)]


class _InFlight:
    """Counts calls running at once (the most seen in `peak`)."""

    def __init__(self) -> None:
        self.now = self.peak = 0
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        with self._lock:
            self.now += 1
            self.peak = max(self.peak, self.now)

    def __exit__(self, *exc) -> None:
        with self._lock:
            self.now -= 1


@pytest.fixture
def release():
    """An event a hung reward waits on; set at the end so no thread outlives the test."""
    event = threading.Event()
    yield event
    event.set()


def test_a_sleeping_reward_at_concurrency_8_over_32_calls_takes_a_fraction_of_32_s():
    # Before: one call at a time, 32 x 1 s = 32 s.
    flight = _InFlight()

    def sleeps(prompt: str, completion: str, answer: str) -> float:
        with flight:
            time.sleep(1.0)
        return float(len(completion))

    runner = RewardRunner(sleeps, concurrency=8, timeout_s=10.0)
    t0 = time.perf_counter()
    results = runner.score(_calls(32))
    elapsed = time.perf_counter() - t0
    assert elapsed < 8.0  # 4 waves of 8 take about 4 s
    assert [r.value for r in results] == [float(i) for i in range(32)]  # in the calls' order
    assert all(r.error is None for r in results)
    assert flight.peak == 8  # the bound, reached and never passed


def test_async_rewards_are_awaited_with_the_same_bound_and_get_the_rows_metadata():
    flight = _InFlight()

    async def graded(prompt: str, completion: str, answer: str, metadata=None) -> float:
        with flight:
            await asyncio.sleep(0.2)
        return float(len(completion)) + (metadata or {}).get("bonus", 0.0)

    class Judge:  # a callable object whose __call__ is async
        async def __call__(self, prompt: str, completion: str, answer: str) -> float:
            await asyncio.sleep(0.01)
            return 1.0 if completion == answer else 0.0

    calls = [RewardCall("p", "x" * i, "a", {"bonus": 0.5}) for i in range(24)]
    t0 = time.perf_counter()
    results = RewardRunner(graded, concurrency=6).score(calls)
    assert time.perf_counter() - t0 < 0.2 * 24 / 2  # 4 waves of 0.2 s, far from 4.8 s serial
    assert [r.value for r in results] == [i + 0.5 for i in range(24)]
    assert flight.peak == 6
    judged = RewardRunner(Judge()).score([RewardCall("p", "4", "4"), RewardCall("p", "5", "4")])
    assert [r.value for r in judged] == [1.0, 0.0]
    # anywhere a reward is: called alone, and under a deadline where the call is made
    assert safe_reward(graded, "p", "xx", "a").value == 2.0
    assert TimedReward(graded, 5.0, "x:graded")("p", "xx", "a", {"bonus": 1.0}) == 3.0


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_each_call_has_its_own_deadline_under_concurrency(release, kind):
    if kind == "sync":

        def reward(prompt: str, completion: str, answer: str) -> float:
            if len(completion) % 2:
                release.wait()  # hangs for good
            time.sleep(0.15)
            return 1.0
    else:

        async def reward(prompt: str, completion: str, answer: str) -> float:
            if len(completion) % 2:
                await asyncio.Event().wait()
            await asyncio.sleep(0.15)
            return 1.0

    runner = RewardRunner(reward, concurrency=4, timeout_s=0.3, name="my_rewards:grade")
    t0 = time.perf_counter()
    results = runner.score(_calls(32))
    elapsed = time.perf_counter() - t0
    hung, fine = results[1::2], results[0::2]
    assert all(r.value == 0.0 and r.error.startswith(REWARD_TIMEOUT) for r in hung)
    assert "reward 'my_rewards:grade' did not return within reward.timeout_s = 0.3 s" in (
        hung[0].error
    )
    # the calls queued behind the bound ran 0.15 s each and none was cut: a deadline counts
    # from the call's start, not from when it was submitted
    assert all(r.value == 1.0 and r.error is None for r in fine)
    assert runner.num_timeouts == 16
    assert elapsed < 16 * 0.3  # the timeouts overlapped instead of following one another
    if kind == "async":
        assert runner.stuck == 0  # a cancelled coroutine holds no thread


def test_a_reward_that_hangs_forever_holds_a_bounded_number_of_threads(release, monkeypatch):
    monkeypatch.setattr(concurrent_module, "MAX_STUCK_CALLS", 3)

    def hangs(prompt: str, completion: str, answer: str) -> float:
        if completion != "ok":
            release.wait()
        return 1.0

    def threads() -> int:
        return sum(t.name == "cadence-reward-call" for t in threading.enumerate())

    before = threads()
    runner = RewardRunner(hangs, concurrency=2, timeout_s=0.1, name="x:hangs")
    results = runner.score(_calls(12))
    assert threads() - before <= 2 + 3  # the working threads and at most 3 left to hung calls
    assert runner.stuck == 5  # every thread it may start is held
    assert all(r.error.startswith(REWARD_TIMEOUT) for r in results)
    assert "found no free thread (5 calls past their deadline hold theirs)" in results[-1].error
    release.set()  # the hung calls return: their threads serve again
    deadline = time.monotonic() + 5
    while runner.stuck and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runner.stuck == 0
    assert runner.score([RewardCall("p", "ok", "a")])[0].value == 1.0


def test_results_equal_a_serial_run_in_order_and_value():
    def jittery(prompt: str, completion: str, answer: str) -> float:
        time.sleep((len(completion) * 7 % 5) / 1000)  # later calls often finish first
        if len(completion) % 9 == 4:
            raise ValueError(f"cannot grade {len(completion)}")
        return math.nan if len(completion) % 11 == 3 else len(completion) % 3 / 2

    calls = _calls(60)
    serial = [safe_reward(jittery, c.prompt, c.completion, c.answer) for c in calls]
    assert RewardRunner(jittery, concurrency=1).score(calls) == serial
    assert RewardRunner(jittery, concurrency=16).score(calls) == serial
    assert any(r.error and r.error.startswith("ValueError") for r in serial)
    assert any(r.error and r.error.startswith("non-finite") for r in serial)


def test_submissions_from_several_threads_share_the_bound():
    flight = _InFlight()

    def sleeps(prompt: str, completion: str, answer: str) -> float:
        with flight:
            time.sleep(0.1)
        return 1.0

    runner = RewardRunner(sleeps, concurrency=3)
    futures = [runner.submit(_calls(6)) for _ in range(4)]
    assert [len(f.result(timeout=30)) for f in futures] == [6] * 4
    assert flight.peak == 3


def test_an_exception_that_is_not_an_error_reaches_the_caller_and_the_loop_survives():
    def interrupted(prompt: str, completion: str, answer: str) -> float:
        raise KeyboardInterrupt

    async def exits(prompt: str, completion: str, answer: str) -> float:
        raise SystemExit(3)

    with pytest.raises(KeyboardInterrupt):
        RewardRunner(interrupted).score(_calls(3))
    with pytest.raises(SystemExit):
        RewardRunner(exits).score(_calls(3))
    assert RewardRunner(lambda p, c, a: 2.0).score(_calls(2))[1].value == 2.0


def test_a_timed_reward_becomes_a_runner_under_its_deadline(release):
    def hangs(prompt: str, completion: str, answer: str) -> float:
        release.wait()
        return 1.0

    runner = as_runner(TimedReward(hangs, 0.1, "x:hangs"), concurrency=4)
    assert (runner.fn, runner.timeout_s, runner.name, runner.concurrency) == (
        hangs,
        0.1,
        "x:hangs",
        4,
    )
    assert as_runner(runner) is runner
    math_runner = load_runner("math", timeout_s=5.0, concurrency=2)
    results = math_runner.score(
        [RewardCall("q", "#### 5", "#### 5"), RewardCall("q", "#### 6", "#### 5")]
    )
    assert [r.value for r in results] == [1.0, 0.0]
    with pytest.raises(ValueError, match="concurrency must be >= 1, got 0"):
        RewardRunner(hangs, concurrency=0)


def test_a_reward_that_computes_defaults_to_one_call_at_a_time_and_any_other_to_32():
    def waits(prompt: str, completion: str, answer: str) -> float:
        return 1.0

    assert load_runner("math").concurrency == 1  # MathReward.concurrency
    assert RewardRunner(waits).concurrency == DEFAULT_CONCURRENCY == 32
    waits.concurrency = 4  # type: ignore[attr-defined]  # a reward's own default
    assert RewardRunner(waits).concurrency == 4
    assert load_runner("math", concurrency=8).concurrency == 8  # reward.concurrency wins
    waits.concurrency = 0  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="concurrency attribute must be an int >= 1, got 0"):
        RewardRunner(waits)


def test_one_at_a_time_in_the_main_thread_a_spinning_call_is_stopped_not_left_running():
    # A thread cannot be stopped, a main thread's call can (SIGALRM): concurrency 1 keeps it.
    def spins(prompt: str, completion: str, answer: str) -> float:
        while True:
            pass

    def threads() -> int:
        return sum(t.name == "cadence-reward-call" for t in threading.enumerate())

    before = threads()
    runner = RewardRunner(spins, concurrency=1, timeout_s=0.2, name="x:spins")
    t0 = time.perf_counter()
    results = runner.score(_calls(3))
    assert time.perf_counter() - t0 < 3.0
    assert all(r.error.startswith(REWARD_TIMEOUT) for r in results)
    assert runner.num_timeouts == 3
    assert runner.stuck == 0 and threads() <= before  # nothing left spinning (earlier tests'
    # bounded threads may end meanwhile)


def test_a_rewards_own_concurrency_is_kept_by_as_runner():
    # before: as_runner gave every plain reward 32 calls at once, MathReward's declared 1 too
    from cadence.rewards import MathReward

    assert as_runner(MathReward()).concurrency == 1
    assert as_runner(lambda p, c, a: 1.0).concurrency == 32
    assert as_runner(MathReward(), concurrency=4).concurrency == 4
