"""How an environment's settings travel to a worker process, and how it builds the environment.

`check_env` loads and checks what a spec names (tools, environment classes) without building
anything, so a bad name fails before a run starts; `make_env` builds the environment in the
worker, with the worker's tokenizer (chat-format environments render with its template).

A verifiers environment (`kind = "verifiers"`) is only named here (`VerifiersEnv`): its library
runs its own episodes, which the rollout worker drives (rollout/verifiers.py); nothing here
imports verifiers.
"""

from __future__ import annotations

from dataclasses import dataclass

from cadence.choices import env_kind
from cadence.envs.base import Budget, Environment
from cadence.envs.tool_env import ToolEnv
from cadence.envs.tools import load_tools


@dataclass(frozen=True)
class EnvSpec:
    """Plain, picklable settings a worker process builds its environment from (`make_env`)."""

    kind: str = "single_turn"  # one of cadence.choices.ENV_KINDS
    tools: tuple[str, ...] = ()  # "tool": "calculator" or "package.module:function"
    max_turns: int = 4
    max_total_tokens: int = 256
    tool_timeout_s: float = 5.0
    factory: str = ""  # "class", "openenv": "package.module:Class"
    factories: tuple[tuple[str, str], ...] = ()  # "class": (name, "module:Class"), by row
    chat_template: str | None = None  # chat kinds: Jinja text in place of the tokenizer's own
    renderer: str = "plain"  # "verifiers": "plain" (cadence's) or "model" (the chat template's)

    def __post_init__(self) -> None:
        env_kind(self.kind)  # a kind it does not know raises, naming those it does
        if self.kind == "class" and bool(self.factory) == bool(self.factories):
            raise ValueError("env kind 'class' needs a factory or factories, not both")
        if self.kind == "openenv" and not self.factory:
            raise ValueError("env kind 'openenv' needs a factory")
        if self.kind == "verifiers" and not self.factory:
            raise ValueError("env kind 'verifiers' needs a factory: 'module:function'")
        if self.renderer not in ("plain", "model"):
            raise ValueError(f"renderer {self.renderer!r} is unknown; allowed: plain, model")


@dataclass(frozen=True)
class VerifiersEnv:
    """A verifiers environment by its factory, and how its turns are rendered to tokens."""

    factory: str
    renderer: str = "plain"
    stop: tuple[str, ...] = ()  # the renderer's stops travel with each request instead


def check_env(spec: EnvSpec) -> None:
    """Load what `spec` names and check it against its contract; raises ValueError (a
    `FactoryError` for environment classes) with the reason."""
    if spec.kind == "tool":
        load_tools(spec.tools)
    elif spec.kind == "class":
        _factories(spec)
    elif spec.kind == "openenv":
        from cadence.envs.openenv import load_openenv

        load_openenv(spec.factory)


def make_env(spec: EnvSpec, tokenizer=None) -> Environment | VerifiersEnv | None:
    """The environment `spec` describes; None for "single_turn" (the worker's one-turn path).
    The chat kinds need the worker's `tokenizer`; a template that cannot carry tool calls
    raises `ChatToolsError` with the reason."""
    if spec.kind == "single_turn":
        return None
    if spec.kind == "verifiers":
        return VerifiersEnv(spec.factory, spec.renderer)
    budget = Budget(spec.max_turns, spec.max_total_tokens)
    if spec.kind == "tool":
        return ToolEnv(load_tools(spec.tools), budget, timeout_s=spec.tool_timeout_s)
    if tokenizer is None:
        raise ValueError(f"env kind {spec.kind!r} writes in the chat template: give the tokenizer")
    from cadence.envs.chat_tools import ChatFormat

    if spec.kind == "class":
        from cadence.envs.classes import ClassEnv

        chat = ChatFormat(tokenizer, spec.chat_template)
        return ClassEnv(_factories(spec), chat, budget, spec.tool_timeout_s)
    from cadence.envs.openenv import OpenEnvEnv, is_mcp, load_openenv

    cls = load_openenv(spec.factory)  # a text environment calls no tools: its template needs none
    chat = ChatFormat(tokenizer, spec.chat_template, tools=is_mcp(cls))
    return OpenEnvEnv(cls, chat, budget, spec.tool_timeout_s)


def _factories(spec: EnvSpec):
    from cadence.envs.classes import load_factory

    if spec.factory:
        return {None: load_factory(spec.factory)}
    return {name: load_factory(s, f"env.factories.{name}") for name, s in spec.factories}
