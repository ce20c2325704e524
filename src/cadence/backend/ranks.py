"""Rank processes: N copies of one object, each in a process of its own, driven by calls.

Read on: docs/ranks.md.
"""

from __future__ import annotations

import collections
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from cadence.backend.procs import Processes, Sender, WorkerDied, WorkerError, owner_gone

Factory = Callable[..., Any]  # (rank, *build args) -> the rank's object
BUILD = "build"  # the first call of every rank: build its object with the factory


class Ranks(Protocol):
    num_ranks: int

    def call(self, rank: int, method: str, *args: Any) -> None: ...

    def wait(self, timeout_s: float | None = None) -> list[list[Any]]:
        """Every reply due, per rank in call order; raise a rank's failure or a timeout."""
        ...

    def poll(self) -> None:
        """Take in the replies that arrived; raise a rank's failure, without waiting."""
        ...

    def close(self) -> None: ...


class Calls:
    """Bookkeeping shared by the transports: calls awaiting replies (with when each was sent),
    replies not yet taken, and when each rank last replied (its silence, see the module
    docstring)."""

    def __init__(self, num_ranks: int, name: str) -> None:
        self.name = name
        self.pending: list[collections.deque[tuple[str, float]]] = [
            collections.deque() for _ in range(num_ranks)
        ]
        self.replies: list[list[Any]] = [[] for _ in range(num_ranks)]
        self.last_reply = [time.monotonic()] * num_ranks

    def sent(self, rank: int, method: str) -> None:
        self.pending[rank].append((method, time.monotonic()))

    def answered(self, rank: int, reply: Any) -> None:
        self.pending[rank].popleft()
        self.replies[rank].append(reply)
        self.last_reply[rank] = time.monotonic()

    def done(self) -> bool:
        return not any(self.pending)

    def take(self) -> list[list[Any]]:
        out, self.replies = self.replies, [[] for _ in self.replies]
        return out

    def quiet(self) -> dict[int, float]:
        """Per rank with calls due: seconds since it last showed progress (its last reply, or
        the sending of its oldest unanswered call, whichever came later)."""
        now = time.monotonic()
        return {r: now - max(self.last_reply[r], p[0][1]) for r, p in enumerate(self.pending) if p}

    def time_left(self, timeout_s: float) -> float:
        """Seconds until the quietest rank with calls due has been silent for `timeout_s`."""
        return min((timeout_s - q for q in self.quiet().values()), default=float("inf"))

    def timeout(self, timeout_s: float) -> TimeoutError:
        late = {
            r: [m for m, _ in self.pending[r]] for r, q in self.quiet().items() if q >= timeout_s
        }
        return TimeoutError(f"{self.name}s did not answer within {timeout_s:g}s: {late}")


def serve(rank: int, factory: Factory, spawn_args: tuple, inbox, results) -> None:
    """A rank process: build the object on `build`, answer each call, end on ("stop", None)."""
    out = Sender(results)
    out.put(("ready", rank, None))
    parent, obj = os.getppid(), None
    try:
        while True:
            try:
                kind, payload = inbox.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent or owner_gone():  # the driver died: nothing to
                    os._exit(1)  # flush, and tearing torch.distributed down can take seconds
                continue
            if kind == "stop":
                break
            method, args = payload
            if method == BUILD:
                obj = factory(rank, *spawn_args, *args)
                out.put(("reply", rank, None))
            else:
                out.put(("reply", rank, getattr(obj, method)(*args)))
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))
        return
    if obj is not None:
        obj.close()


class LocalRanks:
    """`num_ranks` spawned processes; rank r's object gets `spawn_args(r)` (handed over once, at
    spawn: shared-memory tensors travel this way) before the `build` call's arguments."""

    def __init__(
        self,
        factory: Factory,
        num_ranks: int,
        spawn_args: Callable[[int], tuple] = lambda rank: (),
        timeout_s: float = 300.0,
        name: str = "learner rank",
        env: Callable[[int], dict[str, str]] | None = None,
    ) -> None:
        """`env(r)`: what rank r's environment adds (its GPUs: placement.py)."""
        self.num_ranks, self.timeout_s, self.name = num_ranks, timeout_s, name
        self.calls = Calls(num_ranks, name)
        self.procs = Processes(
            name, serve, lambda r: (factory, spawn_args(r)), timeout_s, tag="rank", env=env
        )
        self.procs.start(num_ranks)

    @property
    def pids(self) -> list[int]:
        return [p.process.pid for p in self.procs.procs]

    def call(self, rank: int, method: str, *args: Any) -> None:
        self.calls.sent(rank, method)
        self.procs.send(rank, ("call", (method, args)))

    def poll(self) -> None:
        self._take(self.procs.receive(0.0))

    def wait(self, timeout_s: float | None = None) -> list[list[Any]]:
        """Every reply due; a rank silent for `timeout_s` (default: the transport's) is late."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        while not self.calls.done():
            left = self.calls.time_left(limit)
            if left <= 0:
                raise self.calls.timeout(limit)
            self._take(self.procs.receive(min(left, 0.5)))
        return self.calls.take()

    def _take(self, messages: list) -> None:
        for kind, rank, payload in messages:
            if kind == "error":
                raise self._failure({rank: payload})
            if kind == "reply":
                self.calls.answered(rank, payload)
        if (dead := self.procs.dead()) is not None:
            raise self._failure({}, dead)

    def _failure(self, errors: dict[int, str], dead: int | None = None) -> Exception:
        """The run's error once a rank failed: a dead rank is the cause (the others' collectives
        then fail for want of it), else the first traceback. Waits a moment for the rest."""
        deadline = time.monotonic() + 2.0
        while dead is None and time.monotonic() < deadline:
            for kind, rank, payload in self.procs.receive(0.2):
                if kind == "error":
                    errors.setdefault(rank, payload)
            dead = self.procs.dead(set(range(self.num_ranks)) - set(errors))
        others = "".join(
            f"\n{self.name} {r} then failed: {tb.strip().splitlines()[-1]}"
            for r, tb in errors.items()
        )
        if dead is not None:
            return WorkerDied(self.procs.exited(dead) + others, dead)
        rank = min(errors)
        return WorkerError(f"{self.name} {rank} failed:\n{errors[rank]}")

    def close(self) -> None:
        self.procs.close()


class InlineRanks:
    """The fake: `num_ranks` objects built in this process; a call runs at once, in order."""

    def __init__(self, factory: Factory, num_ranks: int, name: str = "learner rank") -> None:
        self.num_ranks, self.factory = num_ranks, factory
        self.calls = Calls(num_ranks, name)
        self.objects: list[Any] = [None] * num_ranks

    def call(self, rank: int, method: str, *args: Any) -> None:
        self.calls.sent(rank, method)
        if method == BUILD:
            self.objects[rank] = self.factory(rank, *args)
            reply = None
        else:
            reply = getattr(self.objects[rank], method)(*args)
        self.calls.answered(rank, reply)

    def poll(self) -> None:
        return None

    def wait(self, timeout_s: float | None = None) -> list[list[Any]]:
        return self.calls.take()

    def close(self) -> None:
        self.objects = [None] * self.num_ranks
