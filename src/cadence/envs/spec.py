"""How an environment's settings travel to a worker process, and how it builds the environment.

A verifiers environment (`kind = "verifiers"`) is only named here (`VerifiersEnv`): its library
runs its own episodes, which the rollout worker drives (rollout/verifiers.py); nothing here
imports verifiers."""

from __future__ import annotations

from dataclasses import dataclass

from cadence.envs.base import KINDS, Budget, Environment
from cadence.envs.tool_env import ToolEnv
from cadence.envs.tools import load_tools


@dataclass(frozen=True)
class EnvSpec:
    """Plain, picklable settings a worker process builds its environment from (`make_env`)."""

    kind: str = "single_turn"  # "single_turn" | "tool" | "verifiers"
    tools: tuple[str, ...] = ()  # "calculator" or "package.module:function"
    max_turns: int = 4
    max_total_tokens: int = 256
    tool_timeout_s: float = 5.0
    factory: str = ""  # "verifiers": "module:function" returning the verifiers environment
    renderer: str = "plain"  # "verifiers": "plain" (cadence's) or "model" (the chat template's)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"env kind {self.kind!r} is unknown; allowed: {', '.join(KINDS)}")
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


def make_env(spec: EnvSpec) -> Environment | VerifiersEnv | None:
    """The environment `spec` describes; None for "single_turn" (the worker's one-turn path)."""
    if spec.kind == "single_turn":
        return None
    if spec.kind == "verifiers":
        return VerifiersEnv(spec.factory, spec.renderer)
    budget = Budget(spec.max_turns, spec.max_total_tokens)
    return ToolEnv(load_tools(spec.tools), budget, timeout_s=spec.tool_timeout_s)
