"""An OpenEnv environment for `configs/openenv.toml`: arithmetic with retries, written on
openenv-core's base classes as any OpenEnv environment is, and run in cadence's rollout worker
with no server (`env.kind = "openenv"`).

`reset` reads the row's reference answer (cadence passes the row as keywords); each `step` takes
the policy's whole turn as `ArithmeticAction.message`, grades its last number, and answers
"correct" (reward 1, done) or "wrong, try again" (reward 0), so a wrong first answer costs a
turn, not the episode. Load it with this directory on the path:
`PYTHONPATH=examples cadence train configs/openenv.toml ...`.
"""

from __future__ import annotations

import re

from openenv.core.env_server import Action, Environment, Observation, State


class ArithmeticAction(Action):
    message: str  # the policy's turn


class ArithmeticObservation(Observation):
    feedback: str = ""


class RetryArithmetic(Environment[ArithmeticAction, ArithmeticObservation, State]):
    def __init__(self) -> None:
        super().__init__()
        self._state = State()
        self.target = ""

    def reset(self, seed=None, episode_id=None, answer: str = "", **row) -> ArithmeticObservation:
        self.target = answer.rpartition("####")[2].strip()
        self._state = State(episode_id=episode_id, step_count=0)
        return ArithmeticObservation()  # nothing to add to the question

    def step(self, action: ArithmeticAction, timeout_s=None, **kwargs) -> ArithmeticObservation:
        self._state.step_count += 1
        numbers = re.findall(r"-?\d+(?:\.\d+)?", action.message)
        if numbers and numbers[-1] == self.target:
            return ArithmeticObservation(feedback="correct", done=True, reward=1.0)
        return ArithmeticObservation(feedback="wrong, try again", reward=0.0)

    @property
    def state(self) -> State:
        return self._state


def unread(prompt: str, completion: str, answer: str) -> float:
    """The run's reward for an episode the environment never judged (its turn ran into the
    token cap, so there was nothing whole to read): 0, so the environment is the only judge.
    `configs/smollm2-env.toml` sets it as `reward.function`."""
    return 0.0
