"""A deadline on every reward call, in any thread: `TimedReward`.

A reward that never returns (a sleep, a stuck sandbox, a pathological parse) must not hang the
run. A call past `timeout_s` raises `RewardTimeout`, which `safe_reward` scores 0 as a reward
error naming the function. How the call is cut depends on the thread:

Read on: docs/data.md#rewards.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from functools import partial
from typing import Any

from cadence.rewards.aio import Expired, is_async, run_awaitable
from cadence.rewards.calls import takes_metadata

log = logging.getLogger(__name__)


class RewardTimeout(Exception):
    """A reward call did not return within its deadline; the message names the function.

    `safe_reward` records it as "RewardTimeout: ...", the prefix `types.REWARD_TIMEOUT`."""


class TimeoutLog:
    """A reward's timeouts: counted, and logged at the 1st, 2nd, 4th, 8th, ... (a trace, never a
    flood). `name` is how messages name the function (its spec, 'module:function')."""

    def __init__(self, name: str, timeout_s: float) -> None:
        self.name, self.timeout_s = name, timeout_s
        self.count = 0
        self._lock = threading.Lock()

    def record(self, running: int, why: str = "did not return") -> str:
        """Count one timeout; the message for its reward error. `running`: timed-out calls
        still running in their threads."""
        with self._lock:
            self.count += 1
            n = self.count
        message = f"reward '{self.name}' {why} within reward.timeout_s = {self.timeout_s:g} s; "
        message += "scored 0"
        if n & (n - 1) == 0:
            log.warning(
                "cadence: %s (timeout %d of this process, counted in reward_timeouts%s)",
                message,
                n,
                f"; {running} timed-out call(s) still running in their threads" if running else "",
            )
        return message


class _Deadline(BaseException):
    """Raised by the SIGALRM handler inside the call: a BaseException, so that a reward's own
    `except Exception` cannot swallow it."""


class _Call:
    def __init__(self, fn, args: tuple) -> None:
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn(*self.args)
        except BaseException as e:  # handed to the caller, who re-raises it
            self.error = e
        self.done.set()


class _Helper:
    """One daemon thread that runs the calls handed to it, in order, until handed None."""

    def __init__(self) -> None:
        self.calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="cadence-reward-call", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while (call := self.calls.get()) is not None:
            call.run()


class TimedReward:
    """`fn`, whose every call returns within `timeout_s` or raises `RewardTimeout`.

    `name` is how messages name the function (its spec, 'module:function'); `log` counts its
    timeouts (a `RewardRunner` shares its own). Safe to call from
    several threads at once: each calling thread other than the main one has its own helper.
    A row's `metadata` reaches `fn` when `fn` takes it (rewards/calls.py).
    """

    def __init__(self, fn, timeout_s: float, name: str, log: TimeoutLog | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.fn, self.timeout_s, self.name = fn, timeout_s, name
        self._local = threading.local()
        self._lock = threading.Lock()
        self._log = log or TimeoutLog(name, timeout_s)  # shared with a runner that uses it
        self._abandoned: list[threading.Thread] = []
        self._takes_metadata = takes_metadata(fn)
        self._is_async = is_async(fn)

    @property
    def num_timeouts(self) -> int:
        return self._log.count

    def __call__(
        self, prompt: str, completion: str, answer: str, metadata: dict[str, Any] | None = None
    ) -> float:
        args = (prompt, completion, answer)
        fn = self.fn
        if metadata is not None and self._takes_metadata:
            fn = partial(fn, metadata=metadata)
        if self._is_async:
            try:
                return run_awaitable(fn(*args), self.timeout_s)
            except Expired:
                raise RewardTimeout(self._timed_out(None)) from None
        if threading.current_thread() is threading.main_thread():
            return self._under_alarm(fn, args)
        return self._in_helper(fn, args)

    def _under_alarm(self, fn, args: tuple) -> float:
        inside = True

        def on_alarm(signum, frame) -> None:
            if inside:  # a signal that lands after the call returned is ignored
                raise _Deadline

        previous = signal.signal(signal.SIGALRM, on_alarm)
        delay, interval = signal.setitimer(signal.ITIMER_REAL, self.timeout_s)
        t0 = time.monotonic()
        try:
            try:
                return fn(*args)
            finally:
                inside = False
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _Deadline:
            raise RewardTimeout(self._timed_out(None)) from None
        finally:
            signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)
            if delay:  # someone else's timer was running: give it back what is left of it
                left = max(delay - (time.monotonic() - t0), 1e-3)
                signal.setitimer(signal.ITIMER_REAL, left, interval)

    def _in_helper(self, fn, args: tuple) -> float:
        helper = getattr(self._local, "helper", None)  # None: this thread's first call
        if helper is None:
            helper = self._local.helper = _Helper()
        call = _Call(fn, args)
        helper.calls.put(call)
        if not call.done.wait(self.timeout_s):
            helper.calls.put(None)  # it ends once (if ever) the stuck call returns
            self._local.helper = None
            raise RewardTimeout(self._timed_out(helper.thread))
        if call.error is not None:
            raise call.error
        return call.value

    def _timed_out(self, abandoned: threading.Thread | None) -> str:
        with self._lock:
            alive = [t for t in self._abandoned if t.is_alive()]
            self._abandoned = alive + ([abandoned] if abandoned else [])
            running = len(self._abandoned)
        return self._log.record(running)
