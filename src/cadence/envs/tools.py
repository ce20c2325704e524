"""Tools: loading them by name, and calling one so that nothing it does can stop the run.

A tool is a function `fn(argument: str) -> str`. `calculator` ships (envs/calculator.py); any
other loads by import path, `"package.module:function"`, like a reward function, and is called
by its function's name. Never `eval`: a spec is resolved with importlib.

`ToolBox.call` runs the tool in a daemon thread of its own and waits at most `timeout_s`: a tool
that raises, returns something that is not a string, or hangs gives an error outcome the policy
reads, and a hung tool's thread is left behind (a daemon: it cannot keep the process alive) while
the episode goes on. Counted, never fatal.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from cadence.envs.calculator import calculator
from cadence.envs.syntax import MAX_RESULT_CHARS, error_text, result_text

Tool = Callable[[str], str]

BUILTIN: dict[str, Tool] = {"calculator": calculator}


def load_tool(spec: str) -> tuple[str, Tool]:
    """(name the policy calls it by, function) for "calculator" or "package.module:function"."""
    if spec in BUILTIN:
        return spec, BUILTIN[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"tool spec {spec!r} must be one of {sorted(BUILTIN)} or 'package.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"tool spec {spec!r}: cannot import module {module_name!r}: {e}") from e
    fn = getattr(module, attr, None)
    if fn is None or isinstance(fn, type) or not callable(fn):
        raise ValueError(
            f"tool spec {spec!r}: {module_name!r} has no function {attr!r} (argument: str) -> str"
        )
    return attr, fn


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


class ToolBox:
    def __init__(self, tools: dict[str, Tool], timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"a tool timeout must be > 0 seconds, got {timeout_s}")
        self.tools, self.timeout_s = tools, timeout_s

    def call(self, name: str, argument: str) -> Outcome:
        start = time.perf_counter()
        fn = self.tools.get(name)
        if fn is None:
            known = ", ".join(sorted(self.tools))
            return Outcome(error_text(f"unknown tool {name!r}; tools: {known}"), start, start, True)
        box: dict[str, object] = {}
        finished = threading.Event()

        def run() -> None:
            try:
                box["value"] = fn(argument)
            except Exception as e:
                box["error"] = f"{type(e).__name__}: {e}"
            finally:
                finished.set()

        threading.Thread(target=run, name=f"cadence-tool-{name}", daemon=True).start()
        if not finished.wait(self.timeout_s):
            message = f"{name} timed out after {self.timeout_s:g}s"
            return Outcome(error_text(message), start, time.perf_counter(), True, True)
        return self._outcome(name, box, start)

    def _outcome(self, name: str, box: dict[str, object], start: float) -> Outcome:
        end = time.perf_counter()
        if "error" in box:
            return Outcome(error_text(str(box["error"])[:MAX_RESULT_CHARS]), start, end, True)
        value = box.get("value")
        if not isinstance(value, str):
            message = f"{name} returned {type(value).__name__}, not str"
            return Outcome(error_text(message), start, end, True)
        return Outcome(result_text(value[:MAX_RESULT_CHARS]), start, end)
