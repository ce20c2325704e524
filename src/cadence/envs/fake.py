"""Deterministic environments for tests: a scripted one, and a single turn.

`ScriptedEnv(script, budget)` answers turn t of an episode with `script(prompt, t, turn_text)`;
`replies(...)` makes the common script "reply these texts in order, then end".
`SingleTurnEnv` ends every episode after its first turn: through the multi-turn machinery it must
give exactly what the single-turn path gives (a test holds the two together). `eos_ends_episode`
and `prompt_text` are set by a test that plays a chat environment's part; `finished` counts the
`finish` calls (the worker makes exactly one per episode).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from cadence.envs.base import Budget, EnvReply
from cadence.types import Prompt

Script = Callable[[Prompt, int, str], EnvReply]


def replies(*texts: str) -> Script:
    """Reply `texts[t]` to turn t; end the episode after the last."""

    def script(prompt: Prompt, turn: int, text: str) -> EnvReply:
        return EnvReply(texts[turn]) if turn < len(texts) else EnvReply(done=True)

    return script


@dataclass
class ScriptedEpisode:
    prompt: Prompt
    script: Script
    prompt_text: str | None = None
    turns: list[str] = field(default_factory=list)  # the policy's turns, as read
    finished: int = 0

    def step(self, turn: str) -> EnvReply:
        self.turns.append(turn)
        return self.script(self.prompt, len(self.turns) - 1, turn)

    def finish(self) -> float | None:
        self.finished += 1
        return None


class ScriptedEnv:
    def __init__(
        self,
        script: Script,
        budget: Budget,
        stop: tuple[str, ...] = (),
        eos_ends_episode: bool = True,
        prompt_text: Callable[[Prompt], str | None] = lambda prompt: None,
    ) -> None:
        self.script, self.budget, self.stop = script, budget, stop
        self.eos_ends_episode, self.prompt_text = eos_ends_episode, prompt_text
        self.episodes: list[ScriptedEpisode] = []

    def start(self, prompt: Prompt) -> ScriptedEpisode:
        episode = ScriptedEpisode(prompt, self.script, self.prompt_text(prompt))
        self.episodes.append(episode)
        return episode


class SingleTurnEnv(ScriptedEnv):
    def __init__(self, max_total_tokens: int = 1 << 20) -> None:
        super().__init__(
            lambda prompt, turn, text: EnvReply(done=True), Budget(1, max_total_tokens)
        )
