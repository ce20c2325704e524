"""Deterministic environments for tests: a scripted one, and a single turn.

`ScriptedEnv(script, budget)` answers turn t of an episode with `script(prompt, t, turn_text)`;
`replies(...)` makes the common script "reply these texts in order, then end".
`SingleTurnEnv` ends every episode after its first turn: through the multi-turn machinery it must
give exactly what the single-turn path gives (a test holds the two together).
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
    turns: list[str] = field(default_factory=list)  # the policy's turns, as read

    def step(self, turn: str) -> EnvReply:
        self.turns.append(turn)
        return self.script(self.prompt, len(self.turns) - 1, turn)


class ScriptedEnv:
    def __init__(self, script: Script, budget: Budget, stop: tuple[str, ...] = ()) -> None:
        self.script, self.budget, self.stop = script, budget, stop
        self.episodes: list[ScriptedEpisode] = []

    def start(self, prompt: Prompt) -> ScriptedEpisode:
        episode = ScriptedEpisode(prompt, self.script)
        self.episodes.append(episode)
        return episode


class SingleTurnEnv(ScriptedEnv):
    def __init__(self, max_total_tokens: int = 1 << 20) -> None:
        super().__init__(
            lambda prompt, turn, text: EnvReply(done=True), Budget(1, max_total_tokens)
        )
