"""cadence's `calculator` as a verifiers tool server (a `vf.Toolset`), for environments whose
tasks give the policy a calculator.

verifiers serves a toolset as an MCP server in a process of its own, started as
`python -m cadence.envs.verifiers.calculator` (so it needs nothing but cadence and verifiers
installed); a taskset offers it with

    @classmethod
    def toolsets(cls, config):
        return [CalculatorToolset(vf.SharedToolsetConfig())]

Its one tool is named `calculator` (no server prefix), the name a policy warm-started on the
calculator's demonstrations writes; an expression it refuses comes back as the tool's error.
"""

from __future__ import annotations

import verifiers.v1 as vf

from cadence.envs.calculator import calculator


class CalculatorToolset(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # tools keep their own names: `calculator`, not `calculator_toolset_...`

    @vf.tool
    def calculator(self, expression: str) -> str:
        """The value of an arithmetic expression: digits, '.', + - * / // % ** and parentheses
        ("3 + 4" -> "7")."""
        return calculator(expression)


if __name__ == "__main__":
    CalculatorToolset.run()
