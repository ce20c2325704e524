"""The tool environment (`env.kind = "tool"`): the policy calls named Python functions.

Each policy turn is read for a call (envs/syntax.py has the syntax): a turn without one is the
final answer and ends the episode (the run's reward function scores the whole transcript); a
call runs through the `ToolBox` and its result, or an error message, is the reply. A call that
fails costs the episode that turn, nothing more; calls, errors and timeouts are counted.
"""

from __future__ import annotations

import time

from cadence.envs.base import Budget, EnvReply
from cadence.envs.syntax import CALL_END, MalformedCall, error_text, parse_call
from cadence.envs.tools import Tool, ToolBox
from cadence.types import Prompt


class ToolEnv:
    stop = (CALL_END,)
    eos_ends_episode = True  # a turn without a call, ended by EOS, is the final answer

    def __init__(self, tools: dict[str, Tool], budget: Budget, timeout_s: float = 5.0) -> None:
        self.budget = budget
        self.toolbox = ToolBox(tools, timeout_s)

    def start(self, prompt: Prompt) -> ToolEpisode:
        return ToolEpisode(self.toolbox)


class ToolEpisode:
    """Stateless: every turn is read on its own (the transcript lives in the worker)."""

    prompt_text = None  # the task's prompt, as rendered

    def __init__(self, toolbox: ToolBox) -> None:
        self.toolbox = toolbox

    def finish(self) -> float | None:
        return None  # the run's reward function scores the transcript

    def step(self, turn: str) -> EnvReply:
        try:
            call = parse_call(turn)
        except MalformedCall as e:
            now = time.perf_counter()
            reply = EnvReply(error_text(str(e)), tool_calls=1, tool_errors=1)
            reply.spans.append(("tool", now, now))
            return reply
        if call is None:
            return EnvReply(done=True)
        outcome = self.toolbox.call(*call)
        return EnvReply(
            outcome.reply,
            tool_calls=1,
            tool_errors=int(outcome.error),
            tool_timeouts=int(outcome.timeout),
            spans=[("tool", outcome.start, outcome.end)],
        )
