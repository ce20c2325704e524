"""OpenEnv environments for the tests, written on openenv-core's own base classes (the package
ships none that runs in-process): a text game and an MCP environment with tools. Importing this
imports openenv-core (slow: FastAPI, FastMCP and Gradio come with it)."""

from __future__ import annotations

import re
import threading

from fastmcp import FastMCP
from openenv.core.env_server import (
    Action,
    CallToolAction,
    Environment,
    MCPEnvironment,
    Observation,
    State,
)

RELEASE = threading.Event()  # a hung step's thread ends when a test sets it


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    feedback: str = ""


class GuessNumber(Environment[GuessAction, GuessObservation, State]):
    """Guess the row's answer: 'higher' or 'lower' after each guess, reward 1 and done when
    right, -0.1 for a turn without a number."""

    def __init__(self) -> None:
        super().__init__()
        self._state = State()
        self.target = 0
        self.seeds: list[int | None] = []

    def reset(self, seed=None, episode_id=None, answer: str = "", **kwargs) -> GuessObservation:
        self.seeds.append(seed)
        self.target = int(answer.rpartition("####")[2])
        self._state = State(step_count=0)
        return GuessObservation(feedback=" Guess the number.")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        numbers = re.findall(r"-?\d+", action.message)
        if not numbers:
            return GuessObservation(feedback="Write a number.", reward=-0.1)
        guess = int(numbers[-1])
        if guess == self.target:
            return GuessObservation(feedback="right", done=True, reward=1.0)
        return GuessObservation(feedback="higher" if guess < self.target else "lower")

    @property
    def state(self) -> State:
        return self._state


class Sums(MCPEnvironment):
    """Tools over MCP: `add`, and `submit`, which ends the episode with reward 1 for the row's
    answer (0 otherwise)."""

    def __init__(self) -> None:
        mcp = FastMCP("sums")

        @mcp.tool()
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        @mcp.tool()
        def submit(answer: int) -> str:
            """Give the final answer."""
            return "submitted"

        super().__init__(mcp)
        self._state = State()
        self.target = 0

    def reset(self, seed=None, episode_id=None, answer: str = "", **kwargs) -> Observation:
        self.target = int(answer.rpartition("####")[2])
        return Observation()

    def step(self, action: Action, timeout_s=None, **kwargs) -> Observation:
        observation = super().step(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction) and action.tool_name == "submit":
            observation.done = True
            observation.reward = float(action.arguments.get("answer") == self.target)
        return observation

    def _step_impl(self, action: Action, timeout_s=None, **kwargs) -> Observation:
        return Observation(metadata={"error": f"unknown action {type(action).__name__}"})

    @property
    def state(self) -> State:
        return self._state


class TwoFields(Action):
    x: str
    y: str


class NotText(Environment[TwoFields, Observation, State]):
    def reset(self, seed=None, episode_id=None, **kwargs) -> Observation:
        return Observation()

    def step(self, action: TwoFields, timeout_s=None, **kwargs) -> Observation:
        return Observation(done=True)

    @property
    def state(self) -> State:
        return State()


class NotAnEnvironment:
    def reset(self) -> None:
        return None


class Broken(Environment[GuessAction, GuessObservation, State]):
    """A text environment broken as the row's `mode` says: 'raises' (step raises), 'nan' (a NaN
    reward), 'huge' (a 5,000-word observation), 'hangs' (step waits for RELEASE), 'never_done'
    (never ends an episode); anything else ends the first step with reward 1."""

    def reset(self, seed=None, episode_id=None, mode: str = "", **kwargs) -> GuessObservation:
        self.mode = mode
        return GuessObservation(feedback=" Go.")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        if self.mode == "raises":
            raise RuntimeError("the simulator crashed")
        if self.mode == "hangs":
            RELEASE.wait(60)
        if self.mode == "nan":
            return GuessObservation(done=True, reward=float("nan"))
        if self.mode == "huge":
            return GuessObservation(feedback="x " * 5000)
        if self.mode == "never_done":
            return GuessObservation(feedback="again")
        return GuessObservation(done=True, reward=1.0)

    @property
    def state(self) -> State:
        return State()
