"""OpenEnv environments in-process (`env.kind = "openenv"`): an OpenEnv `Environment` class,
`env.factory = "module:Class"`, runs inside the rollout worker: its `reset()` and
`step(Action)` are called directly, with no server, no container and no network.

Read on: docs/envs.md.
"""

from __future__ import annotations

import inspect
import json
import typing
from typing import Any

from cadence.data.base import stable_seed
from cadence.envs.base import Budget, EnvReply
from cadence.envs.chat_tools import ChatFormat, MalformedToolCall, parse_calls
from cadence.envs.classes import FactoryError, InstancePool, import_class, reset_row
from cadence.envs.tools import ToolThreads
from cadence.types import Prompt

INSTALL = "pip install 'cadence[openenv]' (openenv-core)"
_PLAIN = ("done", "reward", "metadata")


def load_openenv(spec: str, what: str = "env.factory") -> type:
    """The OpenEnv `Environment` class at `spec`, checked: an MCP environment, or a text one
    whose action takes the policy's text."""
    try:
        from openenv.core.env_server.interfaces import Environment
    except ImportError as e:
        raise FactoryError(f"env.kind = 'openenv' needs OpenEnv ({e}): {INSTALL}") from None
    cls = import_class(spec, what)
    if not issubclass(cls, Environment):
        raise FactoryError(
            f"{what} {spec!r} is not an OpenEnv environment (a subclass of "
            "openenv.core.Environment); a class with tool methods is env.kind = 'class'"
        )
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise FactoryError(f"{what} {spec!r} is abstract: it does not define {missing}")
    if not is_mcp(cls):
        text_field(cls, spec)
    return cls


def is_mcp(cls: type) -> bool:
    """Whether `cls` is an MCP environment (its tools called in the chat format)."""
    from openenv.core.env_server import MCPEnvironment

    return MCPEnvironment is not None and issubclass(cls, MCPEnvironment)


def text_field(cls: type, spec: str = "") -> tuple[type, str]:
    """(the action class of text environment `cls`, the field the policy's text goes in)."""
    from openenv.core.env_server.types import Action

    action = _action_class(cls, Action)
    if action is None:
        raise FactoryError(
            f"env.factory {spec!r}: cannot tell its action class: annotate step(self, action: "
            "MyAction), or subclass Environment[MyAction, MyObservation, MyState]"
        )
    fields = {n: f for n, f in action.model_fields.items() if n != "metadata"}
    required = [n for n, f in fields.items() if f.is_required()]
    texts = [n for n, f in fields.items() if f.annotation is str]
    if len(required) == 1 and required[0] in texts:
        return action, required[0]
    if not required and len(texts) == 1:
        return action, texts[0]
    raise FactoryError(
        f"env.factory {spec!r}: its action {action.__name__} has fields {sorted(fields)}; the "
        "policy's text fills one str field, so the action needs exactly one (and no other "
        "required field)"
    )


def _action_class(cls: type, base: type) -> type | None:
    try:
        hint = typing.get_type_hints(cls.step).get("action")
    except Exception:  # an annotation that does not resolve: try the generic parameters
        hint = None
    if isinstance(hint, type) and issubclass(hint, base) and hint is not base:
        return hint
    for klass in cls.__mro__:
        for generic in getattr(klass, "__orig_bases__", ()):
            for arg in typing.get_args(generic):
                if isinstance(arg, type) and issubclass(arg, base) and arg is not base:
                    return arg
    return None


def observation_text(observation: Any) -> str:
    """An observation as the text the policy reads (see the module docstring)."""
    fields = {n: getattr(observation, n) for n in type(observation).model_fields if n not in _PLAIN}
    if len(fields) == 1:
        (value,) = fields.values()
        return value if isinstance(value, str) else json.dumps(value, default=str)
    return json.dumps(fields, default=str) if fields else ""


class OpenEnvEnv:
    """Episodes of an OpenEnv environment class, one instance each, in the model's chat format."""

    stop: tuple[str, ...] = ()
    eos_ends_episode = False

    def __init__(self, cls: type, chat: ChatFormat, budget: Budget, timeout_s: float = 5.0) -> None:
        self.chat, self.budget, self.mcp = chat, budget, is_mcp(cls)
        self.pool = InstancePool(cls)
        self.schemas: list[dict] = []
        if self.mcp:
            self.schemas = _mcp_schemas(cls, self.pool)
            names = [s["function"]["name"] for s in self.schemas]
        else:
            self.action, self.field = text_field(cls)
            names = ["step"]
        self.names = frozenset(names)
        self.threads = ToolThreads(names, timeout_s)

    def start(self, prompt: Prompt) -> OpenEnvEpisode:
        messages = [{"role": r, "content": c} for r, c in prompt.messages]
        if not messages:
            raise ValueError(
                f"row {prompt.uid} has no chat conversation: OpenEnv environments need "
                "data.chat_template (replies are written in the chat format)"
            )
        instance = self.pool.take()
        row = {"seed": stable_seed(prompt.uid) % 2**31, **reset_row(prompt)}
        observation = instance.reset(**_accepted(instance.reset, row))
        episode = OpenEnvEpisode(self, instance)
        episode.add_reward(observation)
        text = observation_text(observation)
        if text:
            last = messages[-1]
            messages[-1] = {**last, "content": last["content"] + text}
        episode.prompt_text = self.chat.prompt(messages, self.schemas)
        return episode


def _mcp_schemas(cls: type, pool: InstancePool) -> list[dict]:
    """The tools an MCP environment lists, as chat-template tool schemas (from a probe
    instance, which then joins the pool)."""
    from openenv.core.env_server import ListToolsAction

    probe = pool.take()
    listed = probe.step(ListToolsAction()).tools
    pool.give_back(probe)
    if not listed:
        raise FactoryError(f"{cls.__name__} lists no MCP tools")
    return [
        {"type": "function", "function": _function(t.name, t.description, t.input_schema)}
        for t in listed
    ]


def _function(name: str, description: str, parameters: dict) -> dict:
    return {"name": name, "description": description, "parameters": parameters}


def _accepted(fn, row: dict[str, Any]) -> dict[str, Any]:
    """The keywords of `row` that `fn` takes (all of them when it takes **kwargs)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return row
    names = {p.name for p in params}
    return {k: v for k, v in row.items() if k in names}


class OpenEnvEpisode:
    def __init__(self, env: OpenEnvEnv, instance: Any) -> None:
        self.env, self.instance = env, instance
        self.prompt_text: str | None = None
        self.reward: float | None = None
        self.hung = False

    def add_reward(self, observation: Any) -> None:
        if observation.reward is not None:
            self.reward = (self.reward or 0.0) + float(observation.reward)

    def step(self, turn: str) -> EnvReply:
        return self._tools(turn) if self.env.mcp else self._text(turn)

    def _text(self, turn: str) -> EnvReply:
        env = self.env
        action = env.action(**{env.field: turn})
        reply = EnvReply(tool_calls=1)
        ran = env.threads.run("step", lambda: self.instance.step(action))
        reply.spans.append(("tool", ran.start, ran.end))
        if ran.error is not None:  # the environment failed on this text: the policy reads why
            self.hung |= ran.timeout
            reply.tool_errors, reply.tool_timeouts = 1, int(ran.timeout)
            reply.text = env.chat.user_reply(f"error: {ran.error}")
            return reply
        self.add_reward(ran.value)
        if ran.value.done:
            reply.done = True
            return reply
        reply.text = env.chat.user_reply(observation_text(ran.value))
        return reply

    def _tools(self, turn: str) -> EnvReply:
        from openenv.core.env_server import CallToolAction

        env = self.env
        try:
            calls = parse_calls(turn)
        except MalformedToolCall as e:
            text = env.chat.tool_reply([("invalid", str({"error": str(e)}))])
            return EnvReply(text, tool_calls=1, tool_errors=1)
        if not calls:
            return EnvReply(done=True)
        reply, results = EnvReply(), []
        for call in calls:
            reply.tool_calls += 1
            if call.name not in env.names:
                reply.tool_errors += 1
                results.append((call.name, str({"error": f"Tool {call.name} not found."})))
                continue
            action = CallToolAction(tool_name=call.name, arguments=call.arguments)
            ran = env.threads.run(call.name, lambda a=action: self.instance.step(a))
            reply.spans.append(("tool", ran.start, ran.end))
            content, error = _tool_result(ran)
            reply.tool_errors += int(error)
            reply.tool_timeouts += int(ran.timeout)
            self.hung |= ran.timeout
            results.append((call.name, content))
            if ran.error is None:
                self.add_reward(ran.value)
                reply.done |= bool(ran.value.done)
        if not reply.done:
            reply.text = env.chat.tool_reply(results)
        return reply

    def finish(self) -> float | None:
        if not self.hung:
            self.env.pool.give_back(self.instance)
        return self.reward


def _tool_result(ran) -> tuple[str, bool]:
    """(the reply content of one MCP call, whether it failed)."""
    if ran.error is not None:
        return str({"error": ran.error}), True
    observation = ran.value
    if observation.error is not None:
        return str({"error": observation.error.message}), True
    from fastmcp.client.client import CallToolResult
    from mcp.types import TextContent

    result = observation.result
    if isinstance(result, CallToolResult):  # an MCP result: its text blocks are the reply
        text = "".join(b.text for b in result.content if isinstance(b, TextContent))
        return text, result.is_error
    return str(result), False
