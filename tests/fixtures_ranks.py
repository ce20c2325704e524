"""Rank objects for the rank-process tests: spawned processes import them from here."""

from __future__ import annotations

import os


class EchoRank:
    """Answers `echo` with (rank, value, pid); `fail` raises; `sleep` blocks."""

    def __init__(self, rank: int, greeting: str) -> None:
        self.rank, self.greeting = rank, greeting
        self.closed = False

    def echo(self, value):
        return self.rank, value, self.greeting, os.getpid()

    def fail(self, message: str):
        raise ValueError(f"rank {self.rank} refuses: {message}")

    def sleep(self, seconds: float):
        import time

        time.sleep(seconds)

    def close(self) -> None:
        self.closed = True
