"""Environment classes (`env.kind = "class"`): TRL's `environment_factory` contract, so that an
environment written for TRL's GRPOTrainer runs here unchanged.

Read on: docs/envs.md.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cadence.envs.base import Budget, EnvReply
from cadence.envs.chat_tools import ChatFormat, MalformedToolCall, ToolCall, parse_calls
from cadence.envs.tools import ToolThreads
from cadence.imports import SpecError, load_attribute
from cadence.types import Prompt

NOT_TOOLS = ("reset", "get_reward")


class FactoryError(ValueError):
    """A factory cannot be used as an environment; the message says why and what to fix."""


@dataclass(frozen=True)
class Factory:
    """A checked environment class: its tools (method names) and their JSON schemas."""

    spec: str
    cls: type
    tools: tuple[str, ...]
    schemas: tuple[dict, ...]
    has_reward: bool


def import_class(spec: str, what: str) -> type:
    """The class at "module:Class"; `what` names the config key in messages."""
    try:
        cls = load_attribute(spec, what, "'package.module:Class'")
    except SpecError as e:
        raise FactoryError(str(e)) from e.__cause__
    if not isinstance(cls, type):
        raise FactoryError(
            f"{what} {spec!r} is a {type(cls).__name__}, not a class: give the environment's "
            "class, which cadence calls with no arguments"
        )
    return cls


def load_factory(spec: str, what: str = "env.factory") -> Factory:
    """The environment class at `spec`, checked against the contract (the module docstring)."""
    from transformers.utils import get_json_schema

    cls = import_class(spec, what)
    methods = dict(inspect.getmembers(cls, predicate=inspect.isfunction))
    if "reset" not in methods:
        raise FactoryError(f"{what} {spec!r} has no reset(**row) method: TRL's contract needs one")
    names = tuple(n for n in methods if not n.startswith("_") and n not in NOT_TOOLS)
    if not names:
        raise FactoryError(
            f"{what} {spec!r} has no tools: every public method besides reset and get_reward is "
            "one (type hints, and a docstring with an Args: entry per argument)"
        )
    schemas = []
    for name in names:
        try:
            schemas.append(get_json_schema(methods[name]))
        except Exception as e:  # transformers' TypeHint/DocstringParsingException
            raise FactoryError(
                f"{what} {spec!r}: tool {name!r} has no JSON schema ({e}): give every argument "
                "a type hint and the docstring an Args: entry for each"
            ) from None
    return Factory(spec, cls, names, tuple(schemas), "get_reward" in methods)


class InstancePool:
    """Idle instances made by `make`, reused across episodes (thread-safe)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make
        self._idle: list[Any] = []
        self._lock = threading.Lock()

    def take(self) -> Any:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self.make()

    def give_back(self, instance: Any) -> None:
        with self._lock:
            self._idle.append(instance)


class ClassEnv:
    """Episodes of environment classes, one instance each, in the model's chat format."""

    stop: tuple[str, ...] = ()  # a turn ends at the end-of-turn token (EOS)
    eos_ends_episode = False

    def __init__(
        self,
        factories: dict[str | None, Factory],
        chat: ChatFormat,
        budget: Budget,
        timeout_s: float = 5.0,
    ) -> None:
        if not factories:
            raise ValueError("an environment-class environment needs at least one factory")
        self.factories, self.chat, self.budget = factories, chat, budget
        self.mixed = None not in factories  # env.factories: rows pick by their `environment`
        names = {name for f in factories.values() for name in f.tools}
        self.threads = ToolThreads(names, timeout_s)
        self._pools = {key: InstancePool(f.cls) for key, f in factories.items()}

    def start(self, prompt: Prompt) -> ClassEpisode:
        row = reset_row(prompt)
        key = row.pop("environment", None) if self.mixed else None
        if key not in self._pools:
            raise ValueError(
                f"row {prompt.uid} has environment = {key!r}, not one of env.factories: "
                f"{', '.join(sorted(str(k) for k in self._pools))}"
            )
        messages = [{"role": r, "content": c} for r, c in prompt.messages]
        if not messages:
            raise ValueError(
                f"row {prompt.uid} has no chat conversation: environment classes need "
                "data.chat_template (the tools are shown and called in the chat format)"
            )
        factory, pool = self.factories[key], self._pools[key]
        instance = pool.take()
        observation = instance.reset(**row)
        if observation is not None:
            last = messages[-1]
            messages[-1] = {**last, "content": last["content"] + str(observation)}
        text = self.chat.prompt(messages, list(factory.schemas))
        return ClassEpisode(self, factory, pool, instance, text)


def reset_row(prompt: Prompt) -> dict[str, Any]:
    """The keywords `reset` is called with (see the module docstring)."""
    conversation = [{"role": r, "content": c} for r, c in prompt.messages]
    return {"prompt": conversation, "answer": prompt.answer, **(prompt.metadata or {})}


class ClassEpisode:
    def __init__(
        self, env: ClassEnv, factory: Factory, pool: InstancePool, instance: Any, prompt_text: str
    ) -> None:
        self.env, self.factory, self.pool, self.instance = env, factory, pool, instance
        self.prompt_text = prompt_text
        self.hung = False  # a call timed out: its thread may still use the instance

    def step(self, turn: str) -> EnvReply:
        try:
            calls = parse_calls(turn)
        except MalformedToolCall as e:
            reply = EnvReply(self.env.chat.tool_reply([("invalid", _error(str(e)))]))
            reply.tool_calls = reply.tool_errors = 1
            return reply
        if not calls:
            return EnvReply(done=True)
        reply, results = EnvReply(), []
        for call in calls:
            results.append((call.name, self._call(call, reply)))
        reply.text = self.env.chat.tool_reply(results)
        return reply

    def _call(self, call: ToolCall, reply: EnvReply) -> str:
        """One tool call's reply content; counted into `reply`."""
        reply.tool_calls += 1
        if call.name not in self.factory.tools:
            reply.tool_errors += 1
            return _error(f"Tool {call.name} not found.")
        method = getattr(self.instance, call.name)
        ran = self.env.threads.run(call.name, lambda: awaited(method(**call.arguments)))
        reply.spans.append(("tool", ran.start, ran.end))
        if ran.error is not None:
            reply.tool_errors += 1
            reply.tool_timeouts += int(ran.timeout)
            self.hung |= ran.timeout
            return _error(ran.error)
        return str(ran.value)

    def finish(self) -> float | None:
        try:
            if not self.factory.has_reward:
                return None
            value = awaited(self.instance.get_reward())
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(
                    f"{self.factory.spec}.get_reward() returned {type(value).__name__}, "
                    "not a number"
                )
            if not math.isfinite(value):
                raise ValueError(f"{self.factory.spec}.get_reward() returned {value}")
            return float(value)
        finally:
            if not self.hung:  # else dropped: a later episode must not share it with the hung call
                self.pool.give_back(self.instance)


def awaited(value: Any) -> Any:
    """`value`, or what it returns when it is a coroutine (an `async def` tool or reward): run
    on an event loop of its own, in the thread that called (a tool's, or the pool's)."""
    return asyncio.run(value) if inspect.iscoroutine(value) else value


def _error(message: str) -> str:
    return str({"error": message})
