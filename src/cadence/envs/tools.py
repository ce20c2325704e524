"""Tools: loading them by name, and calling one so that nothing it does can stop the run.

Read on: docs/envs.md.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from cadence.envs.calculator import calculator
from cadence.envs.syntax import MAX_RESULT_CHARS, error_text, result_text
from cadence.imports import load_attribute

Tool = Callable[[str], str]

BUILTIN: dict[str, Tool] = {"calculator": calculator}


def load_tool(spec: str) -> tuple[str, Tool]:
    """(name the policy calls it by, function) for "calculator" or "package.module:function"."""
    if spec in BUILTIN:
        return spec, BUILTIN[spec]
    form = f"one of {sorted(BUILTIN)} or 'package.module:function'"
    fn = load_attribute(spec, "tool spec", form)
    module, _, name = spec.partition(":")
    if isinstance(fn, type) or not callable(fn):
        raise ValueError(
            f"tool spec {spec!r}: {module!r} has no function {name!r} (argument: str) -> str"
        )
    return name, fn


def load_tools(specs: tuple[str, ...] | list[str]) -> dict[str, Tool]:
    """Tools by the name the policy calls them; two tools of one name are refused."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        name, fn = load_tool(spec)
        if name in tools:
            raise ValueError(f"two tools are called {name!r} (env.tools = {list(specs)})")
        tools[name] = fn
    if not tools:
        raise ValueError("a tool environment needs at least one tool in env.tools")
    return tools


@dataclass
class Outcome:
    """One call's reply text, how it went, and when it ran (time.perf_counter())."""

    reply: str
    start: float
    end: float
    error: bool = False
    timeout: bool = False


MAX_THREADS = 16  # per tool: as many calls as a worker's episodes make at once (ENV_THREADS)


@dataclass
class Ran:
    """One call as it went: its value, or its error's message, and when it ran."""

    start: float
    end: float
    value: object = None
    error: str | None = None  # "ExceptionType: message" when it raised, or the timeout's message
    timeout: bool = False


class ToolThreads:
    """Runs calls of named tools, each in a daemon thread of its own, waiting at most
    `timeout_s`; a tool holds at most `max_threads` threads at once, hung ones included (the
    bound is per tool name). The envs' tool calls all go through here, whatever their syntax."""

    def __init__(self, names, timeout_s: float, max_threads: int = MAX_THREADS) -> None:
        if timeout_s <= 0:
            raise ValueError(f"a tool timeout must be > 0 seconds, got {timeout_s}")
        if max_threads < 1:
            raise ValueError(f"a tool's max_threads must be at least 1, got {max_threads}")
        self.timeout_s = timeout_s
        # a slot is held by a running call's thread, and by a hung one until (if ever) it ends
        self._slots = {name: threading.BoundedSemaphore(max_threads) for name in names}

    def run(self, name: str, call: Callable[[], object]) -> Ran:
        """`call()` as tool `name` (one of the names given): its value, error or timeout."""
        start = time.perf_counter()
        box: dict[str, object] = {}
        finished = threading.Event()
        slots = self._slots[name]

        def run() -> None:
            try:
                box["value"] = call()
            except Exception as e:
                box["error"] = f"{type(e).__name__}: {e}"
            finally:
                slots.release()
                finished.set()

        deadline = time.monotonic() + self.timeout_s
        if slots.acquire(timeout=self.timeout_s):
            try:
                threading.Thread(target=run, name=f"cadence-tool-{name}", daemon=True).start()
            except BaseException:
                slots.release()
                raise
            if finished.wait(max(deadline - time.monotonic(), 0.0)):
                error = box.get("error")
                message = None if error is None else str(error)
                return Ran(start, time.perf_counter(), box.get("value"), message)
        message = f"{name} timed out after {self.timeout_s:g}s"
        return Ran(start, time.perf_counter(), error=message, timeout=True)


class ToolBox:
    """Tools of cadence's call syntax: `fn(argument: str) -> str`, replies in `<result>` tags."""

    def __init__(
        self, tools: dict[str, Tool], timeout_s: float, max_threads: int = MAX_THREADS
    ) -> None:
        self.tools = tools
        self.threads = ToolThreads(tools, timeout_s, max_threads)

    @property
    def timeout_s(self) -> float:
        return self.threads.timeout_s

    def call(self, name: str, argument: str) -> Outcome:
        fn = self.tools.get(name)
        if fn is None:
            now = time.perf_counter()
            known = ", ".join(sorted(self.tools))
            return Outcome(error_text(f"unknown tool {name!r}; tools: {known}"), now, now, True)
        ran = self.threads.run(name, lambda: fn(argument))
        if ran.error is not None:
            reply = error_text(ran.error if ran.timeout else ran.error[:MAX_RESULT_CHARS])
            return Outcome(reply, ran.start, ran.end, True, ran.timeout)
        if not isinstance(ran.value, str):
            message = f"{name} returned {type(ran.value).__name__}, not str"
            return Outcome(error_text(message), ran.start, ran.end, True)
        return Outcome(result_text(ran.value[:MAX_RESULT_CHARS]), ran.start, ran.end)
