"""One thread that owns a streaming engine and serves requests from any thread.

The engine is *broken*, and `broken` says why, when the loop thread has died, when no request
has finished over `max_failures_in_a_row` failed steps (every request fails: the engine, not a
request, is at fault), when `max_unattributed` failures in a row were not caused by any request
alone, or when a step fails and there is no `renew` to start a fresh engine. A broken loop fails
everything in flight and every later request at once, with `EngineBroken`; it never leaves a
future unanswered.

Read on: docs/serve.md.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field

from cadence.engine import Engine, Request, SamplingParams, StreamingEngine, as_streaming

log = logging.getLogger(__name__)


class RequestFailed(RuntimeError):
    """This request, run alone on a fresh engine, made the engine raise (or was refused by it)."""


class EngineBroken(RuntimeError):
    """The engine serves no request any more; `cadence serve` must be restarted."""


@dataclass(eq=False)
class _Item:
    request: Request
    params: SamplingParams
    future: Future = field(default_factory=Future)


@dataclass
class _Incident:
    """From a failed step until every request it held has been run again."""

    error: BaseException
    culprit_found: bool = False


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        renew: Callable[[], Engine] | None = None,
        max_failures_in_a_row: int = 32,
        max_unattributed: int = 3,
    ) -> None:
        self.engine: StreamingEngine = as_streaming(engine)
        self._renew = renew
        self.max_failures_in_a_row, self.max_unattributed = max_failures_in_a_row, max_unattributed
        self._inbox: queue.Queue[_Item] = queue.Queue()
        self._waiting: collections.deque[_Item] = collections.deque()
        self._suspects: collections.deque[list[_Item]] = collections.deque()
        self._running: dict[Hashable, _Item] = {}
        self._trial = False  # the engine holds one group of suspects, alone
        self._incident: _Incident | None = None
        self._failures_in_a_row = self._unattributed = 0
        self._keys = itertools.count()
        self._params: SamplingParams | None = None
        self._broken: str | None = None
        self._lock = threading.Lock()  # a submit and the loop's death never cross
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cadence-serve-engine", daemon=True)
        self._thread.start()

    @property
    def broken(self) -> str | None:
        """Why the engine serves no more (None while it does)."""
        if self._broken is None and not self._thread.is_alive() and not self._stop.is_set():
            return "the engine thread is not running"
        return self._broken

    def submit(self, request: Request, params: SamplingParams) -> Future:
        item = _Item(request, params)
        with self._lock:
            if self._broken is not None or self._stop.is_set():
                item.future.set_exception(EngineBroken(self._broken or "the server is stopping"))
            else:
                self._inbox.put(item)
        return item.future

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and self._broken is None:
                self._receive(block=not (self.engine.busy or self._waiting or self._suspects))
                self._admit()
                if self.engine.busy:
                    self._step()
        except BaseException as e:  # a bug of this loop's own: say so, answer everyone, and end
            self._broken = f"the engine thread died: {e!r}"
            log.exception("cadence serve: the engine thread died; /health answers 503")
        finally:
            with self._lock:
                self._broken = self._broken or "the server is stopping"
                self._fail_everything(EngineBroken(self._broken))

    def _receive(self, block: bool) -> None:
        try:
            self._waiting.append(
                self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
            )
            while True:
                self._waiting.append(self._inbox.get_nowait())
        except queue.Empty:
            pass

    def _admit(self) -> None:
        """A group of suspects alone, or waiting requests by rounds (the module docstring)."""
        if self._trial:
            return
        if self._suspects:
            self._trial = True
            for item in self._suspects.popleft():
                self._add(item)
            if not self.engine.busy:  # the engine refused them all
                self._end_trial()
            return
        if not self.engine.busy and self._waiting:
            self._params = self._waiting[0].params
            chosen = [item for item in self._waiting if item.params == self._params]
            self._waiting = collections.deque(i for i in self._waiting if i.params != self._params)
        else:
            chosen = []
            while self._waiting and self._waiting[0].params == self._params:
                chosen.append(self._waiting.popleft())
        for item in chosen:
            if item.future.set_running_or_notify_cancel():
                self._add(item)

    def _add(self, item: _Item) -> None:
        key = next(self._keys)
        try:
            self.engine.add(key, item.request, item.params)
        except Exception as e:  # an engine checks before it takes a request: it stays clean
            item.future.set_exception(RequestFailed(f"the engine refused this request: {e!r}"))
            return
        self._running[key] = item

    def _step(self) -> None:
        try:
            finished = self.engine.step()
        except Exception as e:
            self._on_failure(e)
            return
        self.engine.occupancy.clear()  # a server runs for days and nothing here reads it
        for key, completions in finished:
            self._running.pop(key).future.set_result(completions)
            self._failures_in_a_row = 0
        if self._trial and not self.engine.busy:
            self._end_trial()

    def _on_failure(self, error: Exception) -> None:
        self._failures_in_a_row += 1
        self._incident = self._incident or _Incident(error)
        if self._renew is None:
            self._broken = f"the engine failed and cannot be restarted: {error!r}"
            return  # what it held is failed with everything else as the loop ends
        if self._failures_in_a_row >= self.max_failures_in_a_row:
            self._broken = (
                f"{self._failures_in_a_row} engine steps in a row failed and no request "
                f"finished between them: {error!r}"
            )
            return
        try:
            fresh = as_streaming(self._renew())
        except Exception as e:
            self._broken = f"the engine failed ({error!r}) and a fresh one did not start: {e!r}"
            return
        self.engine, self._params = fresh, None
        held, self._running = list(self._running.values()), {}
        if self._trial and len(held) == 1:  # it fails alone, on a fresh engine: its own fault
            why = f"this request failed in the engine: {error!r}"
            held[0].future.set_exception(RequestFailed(why))
            self._incident.culprit_found = True
        else:
            half = (len(held) + 1) // 2
            self._suspects.extendleft(g for g in (held[half:], held[:half]) if g)
        self._end_trial()

    def _end_trial(self) -> None:
        self._trial = False
        if self._incident is None or self._suspects:
            return
        if self._incident.culprit_found:
            self._unattributed = 0
        else:
            self._unattributed += 1
            if self._unattributed >= self.max_unattributed:
                self._broken = (
                    f"{self._unattributed} engine failures in a row that no request caused "
                    f"alone; the last: {self._incident.error!r}"
                )
        self._incident = None

    def _fail_everything(self, error: BaseException) -> None:
        pending = [
            *self._running.values(),
            *self._waiting,
            *(item for group in self._suspects for item in group),
        ]
        while True:
            try:
                pending.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        self._running, self._waiting, self._suspects = {}, collections.deque(), collections.deque()
        for item in pending:
            if not item.future.done():
                item.future.set_exception(error)
