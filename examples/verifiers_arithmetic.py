"""A verifiers environment for cadence to train: arithmetic questions, cadence's calculator as
the environment's tool server, a rubric of correctness. configs/verifiers.toml runs it.

It is written as any verifiers 0.4 environment is (verifiers.v1): a `TaskData` with the row's
fields, a `Task` whose `@vf.reward` methods are the rubric, a `Taskset` that loads the rows (here
from an in-memory data set: cadence's arithmetic generator, one-step sums and differences up to
999) and offers its tools (`toolsets`: cadence's calculator as an MCP server that verifiers
starts), and `load_environment` returning the `vf.Env`. The harness is cadence's in-process chat
loop (verifiers' own `null` harness runs the same loop as a program it installs with uv; the
in-process one needs neither uv nor the network); verifiers finds a taskset and its harness by
module name, hence `__all__` and `taskset.id = "verifiers_arithmetic"`.

    PYTHONPATH=examples cadence train configs/verifiers.toml --out runs/verifiers
"""

from __future__ import annotations

from itertools import islice

import verifiers.v1 as vf

from cadence.data.tasks import ArithmeticTask
from cadence.envs.verifiers.calculator import CalculatorToolset
from cadence.envs.verifiers.harness import InProcessChatHarness

__all__ = ["ArithmeticTaskset", "InProcessChatHarness"]

NUM_ROWS = 2000


def rows(n: int = NUM_ROWS) -> list[dict[str, str]]:
    """The data set: `n` questions and their final answers."""
    task = ArithmeticTask(difficulty=1, seed=0, max_operand=999)
    return [
        {"question": e.question, "answer": e.answer.rpartition("####")[2].strip()}
        for e in islice(task.train_iter(), n)
    ]


class ArithmeticData(vf.TaskData):
    question: str
    answer: str


class ArithmeticTaskItem(vf.Task[ArithmeticData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1 when the last reply's final line is '#### ANSWER'."""
        final = trace.last_reply.rpartition("####")[2].strip()
        return float(final == self.data.answer)


class ArithmeticConfig(vf.TasksetConfig):
    num_rows: int = NUM_ROWS


class ArithmeticTaskset(vf.Taskset[ArithmeticTaskItem, ArithmeticConfig]):
    @classmethod
    def toolsets(cls, config: ArithmeticConfig) -> list[vf.Toolset]:
        return [CalculatorToolset(vf.SharedToolsetConfig())]

    def load(self) -> list[ArithmeticTaskItem]:
        return [
            ArithmeticTaskItem(
                ArithmeticData(prompt=f"Question: {row['question']}\nAnswer: ", **row),
                self.config.task,
            )
            for row in rows(self.config.num_rows)
        ]


def load_environment(max_turns: int = 3) -> vf.Env:
    """The environment: up to `max_turns` model turns, in a local (subprocess) runtime."""
    config = vf.SingleAgentEnvConfig(
        taskset={"id": "verifiers_arithmetic"},
        agent={"runtime": {"type": "subprocess"}, "max_turns": max_turns},
    )
    return vf.load_environment(config)
