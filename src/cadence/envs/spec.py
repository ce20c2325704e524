"""How an environment's settings travel to a worker process, and how it builds the environment."""

from __future__ import annotations

from dataclasses import dataclass

from cadence.envs.base import KINDS, Budget, Environment
from cadence.envs.tool_env import ToolEnv
from cadence.envs.tools import load_tools


@dataclass(frozen=True)
class EnvSpec:
    """Plain, picklable settings a worker process builds its environment from (`make_env`)."""

    kind: str = "single_turn"  # "single_turn" | "tool"
    tools: tuple[str, ...] = ()  # "calculator" or "package.module:function"
    max_turns: int = 4
    max_total_tokens: int = 256
    tool_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"env kind {self.kind!r} is unknown; allowed: {', '.join(KINDS)}")


def make_env(spec: EnvSpec) -> Environment | None:
    """The environment `spec` describes; None for "single_turn" (the worker's one-turn path)."""
    if spec.kind == "single_turn":
        return None
    budget = Budget(spec.max_turns, spec.max_total_tokens)
    return ToolEnv(load_tools(spec.tools), budget, timeout_s=spec.tool_timeout_s)
