"""A rule reward with the latency of a remote verifier: math-verify after a fixed wait.

For the reward-stage demo in the README (configs/reward-stage.toml). Its cost is waiting, not
computing, like a sandbox run or a judge behind an API: the case where more reward workers drain
the stage even on a machine with no spare cores. Load it by import path with this directory on
the path: `PYTHONPATH=examples cadence train ...` (reward workers inherit the environment).
"""

import time

from cadence.rewards import MathReward

LATENCY_S = 0.02  # per response
_math = MathReward()


def math_after_latency(prompt: str, completion: str, answer: str) -> float:
    time.sleep(LATENCY_S)
    return _math(prompt, completion, answer)
