"""Many reward calls at once: `RewardRunner`, the one way the run scores (rollout workers in any
placement, held-out evaluation, the reward stage).

An exception that is not an `Exception` (KeyboardInterrupt, SystemExit) is not a score: it
reaches the caller, as `safe_reward` lets it. This module must not import torch.

Read on: docs/data.md#rewards.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import inspect
import queue
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple, Protocol, runtime_checkable

from cadence.rewards.aio import event_loop, is_async, run_awaitable
from cadence.rewards.base import (
    RewardFn,
    RewardResult,
    checked_reward,
    failed_reward,
    load_reward,
    safe_reward,
)
from cadence.rewards.calls import takes_metadata
from cadence.rewards.timeout import RewardTimeout, TimedReward, TimeoutLog

DEFAULT_CONCURRENCY = 32  # for a reward without a `concurrency` of its own (docs/reliability.md)
MAX_STUCK_CALLS = 64  # threads a runner leaves to calls past their deadline, at most
IDLE_EXIT_S = 30.0


class RewardCall(NamedTuple):
    """One reward call's arguments: the row's texts and its metadata (None: none)."""

    prompt: str
    completion: str
    answer: str
    metadata: dict[str, Any] | None = None


class _Outcome(NamedTuple):
    value: Any
    error: BaseException | None


class _Threads:
    """Daemon threads for blocking calls, started as needed up to `limit`; one idle for
    `IDLE_EXIT_S` ends. (`concurrent.futures.ThreadPoolExecutor` joins its threads at exit, so a
    call that never returns would keep the process alive.)"""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0  # threads waiting for work that no submitted call has claimed yet
        self._backlog = 0  # calls queued while every thread was busy and the limit reached

    def submit(self, fn: Callable[[], Any]) -> cf.Future:
        future: cf.Future = cf.Future()
        with self._lock:
            self._work.put((future, fn))
            if self._idle:
                self._idle -= 1
            elif self._threads < self.limit:
                self._threads += 1
                threading.Thread(
                    target=self._serve, name="cadence-reward-call", daemon=True
                ).start()
            else:
                self._backlog += 1
        return future

    def _serve(self) -> None:
        while True:
            try:
                future, fn = self._work.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    if self._work.empty() and self._idle:
                        self._idle -= 1
                        self._threads -= 1
                        return
                continue
            if future.set_running_or_notify_cancel():  # False: it timed out while queued
                future.set_result(fn())  # fn never raises (`RewardRunner._run`)
            with self._lock:
                if self._backlog:
                    self._backlog -= 1
                else:
                    self._idle += 1


class _Raised(NamedTuple):
    """A call raised what is not an `Exception`: re-raised to the caller, never scored."""

    error: BaseException


def default_concurrency(fn: RewardFn) -> int:
    """`fn`'s own `concurrency` attribute where it has one, else `DEFAULT_CONCURRENCY`."""
    own = getattr(fn, "concurrency", DEFAULT_CONCURRENCY)
    if not isinstance(own, int) or own < 1:
        raise ValueError(
            f"reward {fn!r}: its concurrency attribute must be an int >= 1, got {own!r}"
        )
    return own


class RewardRunner:
    """`fn` called for many rows at once: at most `concurrency` in flight (None: `fn`'s default,
    `default_concurrency`), each within `timeout_s` (0: no limit); `name` is how messages name it
    (its spec, 'module:function').

    `submit(calls)` returns at once with a future of the results, in the order of `calls`;
    `score(calls)` waits for them. Safe to use from any number of threads: the bound is the
    runner's, whoever submits.
    """

    def __init__(
        self,
        fn: RewardFn,
        concurrency: int | None = None,
        timeout_s: float = 0.0,
        name: str = "",
    ) -> None:
        concurrency = default_concurrency(fn) if concurrency is None else concurrency
        if concurrency < 1:
            raise ValueError(f"reward concurrency must be >= 1, got {concurrency}")
        if timeout_s < 0:
            raise ValueError(f"reward timeout_s must be >= 0, got {timeout_s}")
        self.fn, self.concurrency, self.timeout_s = fn, concurrency, timeout_s
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self.stuck = 0  # calls past their deadline whose thread has not returned
        self._is_async, self._takes_metadata = is_async(fn), takes_metadata(fn)
        self._threads = _Threads(concurrency + MAX_STUCK_CALLS)
        self._log = TimeoutLog(self.name, timeout_s)
        self._timed = TimedReward(fn, timeout_s, self.name, self._log) if timeout_s else fn
        self._lock = threading.Lock()
        self._slots: asyncio.Semaphore | None = None  # made on the loop, used only there

    @property
    def num_timeouts(self) -> int:
        return self._log.count

    def close(self) -> None:
        """Nothing to stop: its threads are daemons, and a call past its deadline ends alone."""

    def score(self, calls: Sequence[RewardCall]) -> list[RewardResult]:
        """The result of each call, in order."""
        return self.submit(calls).result()

    def submit(self, calls: Sequence[RewardCall]) -> cf.Future[list[RewardResult]]:
        """Start `calls`; a future of their results, in order (done already when they ran
        right here: concurrency 1 in a main thread)."""
        if self._here():
            done: cf.Future[list[RewardResult]] = cf.Future()
            done.set_result([safe_reward(self._timed, *call) for call in calls])
            return done
        inner = asyncio.run_coroutine_threadsafe(self._score_all(list(calls)), event_loop())
        outer: cf.Future[list[RewardResult]] = cf.Future()

        def unpack(done: cf.Future) -> None:
            try:
                results = done.result()
            except BaseException as e:  # the loop's own failure: the caller's to see
                outer.set_exception(e)
                return
            raised = next((r.error for r in results if isinstance(r, _Raised)), None)
            if raised is not None:
                outer.set_exception(raised)
            else:
                outer.set_result(results)

        inner.add_done_callback(unpack)
        return outer

    def _here(self) -> bool:
        """Whether calls run in the caller's thread: one at a time, a plain function, a main
        thread (where SIGALRM can cut a call)."""
        main = threading.current_thread() is threading.main_thread()
        return self.concurrency == 1 and not self._is_async and main

    async def _score_all(self, calls: list[RewardCall]) -> list[RewardResult | _Raised]:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.concurrency)
        return await asyncio.gather(*(self._one(call) for call in calls))

    async def _one(self, call: RewardCall) -> RewardResult | _Raised:
        assert self._slots is not None
        async with self._slots:
            thread_future = None
            if self._is_async:
                job: asyncio.Future = asyncio.ensure_future(self._run_async(call))
            else:
                thread_future = self._threads.submit(partial(self._run, call))
                job = asyncio.wrap_future(thread_future)
            done, _ = await asyncio.wait({job}, timeout=self.timeout_s or None)
            if not done:
                job.cancel()  # an async call ends; a thread's call cannot be stopped
                return self._expired(thread_future)
        value, error = job.result()
        if error is None:
            return checked_reward(value)
        if isinstance(error, Exception):
            return failed_reward(error)
        return _Raised(error)

    def _args(self, call: RewardCall) -> tuple[Callable[..., Any], tuple]:
        fn: Callable[..., Any] = self.fn
        if call.metadata is not None and self._takes_metadata:
            fn = partial(fn, metadata=call.metadata)
        return fn, (call.prompt, call.completion, call.answer)

    def _run(self, call: RewardCall) -> _Outcome:
        """A blocking call, in a thread: never raises."""
        fn, args = self._args(call)
        try:
            value = fn(*args)
            if inspect.isawaitable(value):  # a plain function that hands back a coroutine
                value = run_awaitable(value)
            return _Outcome(value, None)
        except BaseException as e:  # handed to the loop, which scores or re-raises it
            return _Outcome(None, e)

    async def _run_async(self, call: RewardCall) -> _Outcome:
        fn, args = self._args(call)
        try:
            return _Outcome(await fn(*args), None)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # not raised on the loop: KeyboardInterrupt would stop it
            return _Outcome(None, e)

    def _expired(self, thread_future: cf.Future | None) -> RewardResult:
        why = "did not return"
        if thread_future is not None and thread_future.cancel():  # queued: it never got a thread
            why = f"found no free thread ({self.stuck} calls past their deadline hold theirs)"
        elif thread_future is not None:
            with self._lock:
                self.stuck += 1
            thread_future.add_done_callback(self._came_back)
        return failed_reward(RewardTimeout(self._log.record(self.stuck, why)))

    def _came_back(self, _: cf.Future) -> None:
        with self._lock:
            self.stuck -= 1


@runtime_checkable
class RewardScorer(Protocol):
    """What scores a rollout worker's reward calls: a `RewardRunner` in the worker's own process,
    or reward processes beside it (backend/reward_procs.py)."""

    def submit(self, calls: Sequence[RewardCall]) -> cf.Future[list[RewardResult]]: ...

    def score(self, calls: Sequence[RewardCall]) -> list[RewardResult]: ...

    def close(self) -> None: ...


def as_runner(reward: RewardFn | RewardScorer, concurrency: int | None = None) -> RewardScorer:
    """`reward` as a scorer: itself if it is one (a runner, reward processes); a `TimedReward`'s
    function under its deadline; any other reward function with no deadline. `concurrency`
    None: the reward's own (`default_concurrency`: MathReward's 1, else 32)."""
    if isinstance(reward, RewardScorer):
        return reward
    if isinstance(reward, TimedReward):
        return RewardRunner(reward.fn, concurrency, reward.timeout_s, reward.name)
    return RewardRunner(reward, concurrency)


def load_runner(
    spec: str,
    answer_format: str = "auto",
    timeout_s: float = 0.0,
    concurrency: int | None = None,
) -> RewardRunner:
    """The reward `spec` names (`load_reward`), run `concurrency` calls at a time (None: its
    default), each within `timeout_s` (0: no limit)."""
    return RewardRunner(load_reward(spec, answer_format), concurrency, timeout_s, spec)
