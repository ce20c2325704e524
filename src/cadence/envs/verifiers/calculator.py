"""cadence's `calculator` as a verifiers tool server (a `vf.Toolset`), for environments whose
tasks give the policy a calculator.

Read on: docs/envs.md.
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
