"""Environment classes for the environment tests, loaded by import path as a user's would be
(TRL's environment_factory contract: reset(**row), tools as methods, optional get_reward)."""

from __future__ import annotations

import threading
from typing import ClassVar

RELEASE = threading.Event()  # a hung tool's thread ends when a test sets it


class Adder:
    """Adds numbers; rewards an episode whose last sum is the row's answer."""

    resets: ClassVar[list[dict]] = []  # every reset's keywords, across instances (tests read them)

    def __init__(self) -> None:
        self.last: int | None = None
        self.target = ""

    def reset(self, **row) -> str | None:
        Adder.resets.append(row)
        self.last, self.target = None, row["answer"].rpartition("####")[2].strip()
        return row.get("hint")

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        self.last = a + b
        return self.last

    def hang(self) -> str:
        """Never answers in time."""
        RELEASE.wait(60)
        return "too late"

    def get_reward(self) -> float:
        return float(str(self.last) == self.target)


class Echo:
    """No reward of its own: the run's reward function scores."""

    def reset(self, **row) -> None:
        return None

    def echo(self, text: str) -> str:
        """Say the text back.

        Args:
            text: What to say.
        """
        return f"echo {text}"


class Slow:
    """Async tools and reward, as TRL allows them."""

    def reset(self, **row) -> None:
        self.calls = 0

    async def double(self, x: int) -> int:
        """Double a number.

        Args:
            x: The number.
        """
        self.calls += 1
        return 2 * x

    async def get_reward(self) -> float:
        return float(self.calls)


class NoReset:
    def add(self, a: int) -> int:
        """Add.

        Args:
            a: A number.
        """
        return a


class NoTools:
    def reset(self, **row) -> None:
        return None

    def get_reward(self) -> float:
        return 0.0


class NoHints:
    def reset(self, **row) -> None:
        return None

    def add(self, a, b):
        """Add.

        Args:
            a: A number.
            b: A number.
        """


class NoArgsDoc:
    def reset(self, **row) -> None:
        return None

    def add(self, a: int, b: int) -> int:
        """Add two numbers."""
        return a + b


def not_a_class() -> Adder:
    return Adder()


class Constant:
    """Every episode is worth 1, whatever the policy writes."""

    def reset(self, **row) -> None:
        return None

    def noop(self) -> str:
        """Do nothing."""
        return ""

    def get_reward(self) -> float:
        return 1.0


class WordyReward(Constant):
    def get_reward(self) -> float:
        return "high"  # type: ignore[return-value]


class Broken:
    """An environment class broken as the row's `mode` says: 'raises' (get_reward raises), 'nan'
    (get_reward returns NaN), 'huge' (the tool answers 5,000 words), 'hangs' (get_reward waits
    for RELEASE), anything else healthy (reward 1)."""

    def reset(self, mode: str = "", **row) -> None:
        self.mode = mode

    def look(self) -> str:
        """Look around."""
        return "x " * 5000 if self.mode == "huge" else "a room"

    def get_reward(self) -> float:
        if self.mode == "raises":
            raise RuntimeError("the grader crashed")
        if self.mode == "hangs":
            RELEASE.wait(60)
        return float("nan") if self.mode == "nan" else 1.0
