"""The environment seam: what a multi-turn episode is, and how its settings travel.

An `Environment` starts one `Episode` per sample from a task row (a `Prompt`). The rollout worker
then alternates: the policy writes a turn (the engine samples it with the whole episode so far as
its prompt); the episode reads the turn's text and answers with an `EnvReply`: text to append
(tokenised once, never trained), or `done` with an optional reward of its own. The worker, not
the episode, holds the tokens and enforces the `Budget` (turns, and tokens after the prompt).
However the episode ended, the worker then calls its `finish` once: the episode lets go of what
it holds and may give its reward there (an environment class's `get_reward`).

Read on: docs/envs.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from cadence.types import Prompt


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
    # the prompt this episode is played from, when the environment renders it; None: the task's
    # prompt as given. The G episodes of one prompt must agree (one prompt per group).
    prompt_text: str | None

    def step(self, turn: str) -> EnvReply:
        """Read the policy's latest turn (its text); reply, or end the episode."""
        ...

    def finish(self) -> float | None:
        """The episode is over, however it ended: let go of what it holds; its reward, or None
        for the run's reward function (a reward `step` gave with `done` comes first)."""
        ...


class Environment(Protocol):
    budget: Budget
    stop: tuple[str, ...]  # strings that end a policy turn (besides EOS), e.g. a call's end
    # True: EOS is the final answer and ends the episode (cadence's call syntax); False: EOS ends
    # the policy's message and the episode reads it (chat templates), any other end stops it
    eos_ends_episode: bool

    def start(self, prompt: Prompt) -> Episode: ...
