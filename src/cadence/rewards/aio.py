"""The process's event loop for rewards: one per process, in a daemon thread, started on first use.

Async reward functions (`async def reward(...)`) are awaited here, whoever calls them, and
`RewardRunner` schedules every reward call of the process from here (rewards/concurrent.py). A
loop of its own keeps rewards independent of the caller's threads: the learner, a worker process's
main thread, a Ray actor or a test thread all hand their calls over the same way.

This module must not import torch. An async reward must not block (no `time.sleep`, no blocking
I/O): it would stall every reward call of the process; a blocking function belongs in a plain
`def`, which runs in a thread.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import threading
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_loop_pid = 0


class Expired(Exception):
    """`run_awaitable` gave up waiting at its deadline (the awaitable was cancelled)."""


def event_loop() -> asyncio.AbstractEventLoop:
    """This process's reward loop, started (a daemon thread) on the first call."""
    global _loop, _loop_pid
    with _lock:
        if _loop is None or _loop_pid != os.getpid():  # a forked child has the object, no thread
            _loop, _loop_pid = asyncio.new_event_loop(), os.getpid()
            thread = threading.Thread(
                target=_loop.run_forever, name="cadence-reward-loop", daemon=True
            )
            thread.start()
        return _loop


def is_async(fn: Any) -> bool:
    """Whether calling `fn` gives a coroutine: an `async def` function, or an object whose
    `__call__` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


def run_awaitable(awaitable: Awaitable[T], timeout_s: float = 0.0) -> T:
    """Await `awaitable` on the process loop and return its value (or raise its exception), from
    any thread but the loop's own; past `timeout_s` (> 0) cancel it and raise `Expired`."""
    loop = event_loop()
    if _running_loop() is loop:
        raise RuntimeError("run_awaitable called on the reward loop itself: await it there")
    future = asyncio.run_coroutine_threadsafe(_awaited(awaitable), loop)
    try:
        return future.result(timeout_s or None)
    except TimeoutError:
        if future.done():  # the awaitable's own TimeoutError, or it finished just in time
            return future.result()
        future.cancel()
        raise Expired(f"not done within {timeout_s:g} s") from None


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
