"""The environment seam: what a multi-turn episode is, and how its settings travel.

An `Environment` starts one `Episode` per sample from a task row (a `Prompt`). The rollout worker
then alternates: the policy writes a turn (the engine samples it with the whole episode so far as
its prompt); the episode reads the turn's text and answers with an `EnvReply`: text to append
(tokenised once, never trained), or `done` with an optional reward of its own. The worker, not
the episode, holds the tokens and enforces the `Budget` (turns, and tokens after the prompt).

`Episode.step` may block (a tool call); the worker runs it off its engine's thread, so other
episodes decode meanwhile. It must not raise for anything the policy wrote: what the policy got
wrong is a reply the policy reads. It must return within a bounded time (a tool environment cuts
its tools off at their timeout).

This module must not import torch, an engine or a process: it is the seam, not the machinery
(that is `rollout/episodes.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from cadence.types import Prompt

KINDS = ("single_turn", "tool", "verifiers")


@dataclass(frozen=True)
class Budget:
    """How long an episode may run: policy turns, and tokens after the prompt (policy and
    environment together). An episode that reaches either ends there."""

    max_turns: int = 1
    max_total_tokens: int = 256

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_total_tokens < 1:
            raise ValueError(f"a budget needs max_turns >= 1 and max_total_tokens >= 1: {self}")


@dataclass
class EnvReply:
    """The environment's answer to one policy turn."""

    text: str = ""  # appended to the trajectory when not `done`
    done: bool = False  # the episode is over (the turn was its last)
    reward: float | None = None  # when done: the episode's reward; None: the reward function's
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    spans: list[tuple[str, float, float]] = field(default_factory=list)  # (name, start, end)


class Episode(Protocol):
    def step(self, turn: str) -> EnvReply:
        """Read the policy's latest turn (its text); reply, or end the episode."""
        ...


class Environment(Protocol):
    budget: Budget
    stop: tuple[str, ...]  # strings that end a policy turn (besides EOS), e.g. a call's end

    def start(self, prompt: Prompt) -> Episode: ...
