"""verifiers environments for the tests, built here from a small in-memory data set: a single-turn
environment (the task stops after one model turn, as verifiers' reverse-text does) and a
multi-turn tool environment (cadence's calculator as the taskset's MCP tool server).

verifiers finds a taskset and a harness by module name: this module exports one of each, so
`taskset.id = "fixtures_verifiers"` loads both (the in-process chat harness is the default).
"""

from __future__ import annotations

import verifiers.v1 as vf

from cadence.data.tasks import ArithmeticTask
from cadence.envs.verifiers.calculator import CalculatorToolset
from cadence.envs.verifiers.harness import InProcessChatHarness

__all__ = ["ArithmeticTaskset", "InProcessChatHarness"]

# the in-memory data set: arithmetic questions with their final answers, as rows
ROWS = [
    {"question": e.question, "answer": e.answer.rpartition("####")[2].strip()}
    for e in ArithmeticTask(difficulty=1, seed=0).heldout()[:8]
]


class ArithmeticData(vf.TaskData):
    question: str
    answer: str


class ArithmeticTaskConfig(vf.TaskConfig):
    single_turn: bool = False


class ArithmeticTaskItem(vf.Task[ArithmeticData, vf.State, ArithmeticTaskConfig]):
    @vf.stop
    async def one_turn(self, trace: vf.Trace) -> bool:
        return self.config.single_turn and trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(f"#### {self.data.answer}" in trace.last_reply)

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) < 12)  # spreads a random policy's rewards


class ArithmeticConfig(vf.TasksetConfig):
    task: ArithmeticTaskConfig = ArithmeticTaskConfig()
    tools: bool = False


class ArithmeticTaskset(vf.Taskset[ArithmeticTaskItem, ArithmeticConfig]):
    @classmethod
    def toolsets(cls, config: ArithmeticConfig) -> list[vf.Toolset]:
        return [CalculatorToolset(vf.SharedToolsetConfig())] if config.tools else []

    def load(self) -> list[ArithmeticTaskItem]:
        return [
            ArithmeticTaskItem(
                ArithmeticData(prompt=f"Question: {row['question']}\nAnswer: ", **row),
                self.config.task,
            )
            for row in ROWS
        ]


def _env(taskset: dict, max_turns: int) -> vf.Env:
    agent = {"runtime": {"type": "subprocess"}, "max_turns": max_turns}
    config = {"taskset": {"id": "fixtures_verifiers", **taskset}, "agent": agent}
    return vf.load_environment(vf.SingleAgentEnvConfig.model_validate(config))


def single_turn() -> vf.Env:
    """One model turn per episode, no tools."""
    return _env({"task": {"single_turn": True}}, max_turns=1)


def tool_env() -> vf.Env:
    """Up to three model turns; each turn that calls the calculator gets its result."""
    return _env({"tools": True}, max_turns=3)


def not_an_env():
    return "an environment"
