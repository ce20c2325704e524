"""One thread that owns a streaming engine and serves requests from any thread.

`submit(request, params)` returns a `concurrent.futures.Future` of the request's completions.
Requests join the engine while others decode (continuous batching), in arrival order, as long
as they share the engine's current `SamplingParams` (an engine decodes with one at a time); the
first request that needs other params waits, with everything behind it, until the engine drains,
so none is overtaken forever. An engine that raises fails every request in flight and every later
one, with its error.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
from concurrent.futures import Future

from cadence.engine import Engine, Request, SamplingParams, as_streaming

_Item = tuple[Request, SamplingParams, Future]


class EngineLoop:
    def __init__(self, engine: Engine) -> None:
        self.engine = as_streaming(engine)
        self._inbox: queue.Queue[_Item] = queue.Queue()
        self._waiting: collections.deque[_Item] = collections.deque()
        self._futures: dict[int, Future] = {}
        self._keys = itertools.count()
        self._params: SamplingParams | None = None
        self._failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cadence-serve-engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request, params: SamplingParams) -> Future:
        future: Future = Future()
        if self._failure is not None:
            future.set_exception(RuntimeError(f"the engine failed: {self._failure!r}"))
        else:
            self._inbox.put((request, params, future))
        return future

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._receive(
                block=self._failure is not None or not (self.engine.busy or self._waiting)
            )
            if self._failure is not None:  # every later caller hears of it too
                self._fail(self._failure)
                continue
            self._admit()
            if not self.engine.busy:
                continue
            try:
                finished = self.engine.step()
            except BaseException as e:  # every caller hears of it; the engine serves no more
                self._failure = e
                self._fail(e)
                continue
            for key, completions in finished:
                self._futures.pop(key).set_result(completions)

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
        """Add waiting requests, in order, while they share the engine's params."""
        if not self.engine.busy:
            self._params = None
        while self._waiting:
            request, params, future = self._waiting[0]
            if self._params is not None and params != self._params:
                return
            self._waiting.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            key = next(self._keys)
            self._futures[key] = future
            self._params = params
            self.engine.add(key, request, params)

    def _fail(self, error: BaseException) -> None:
        pending = [*self._futures.values(), *(f for _, _, f in self._waiting)]
        self._futures, self._waiting = {}, collections.deque()
        for future in pending:
            if not future.done():
                future.set_exception(RuntimeError(f"the engine failed: {error!r}"))
