"""The rollout-pool seam: what the producer drives, whatever runs the workers.

A `Pool` is a fixed number of worker slots on some backend: local processes (`LocalPool`), Ray
actors (`RayPool`) or threads in this process (`backend.fake.ThreadPool`, the test double). Each
slot runs the same `WorkerLoop` and answers the same messages; `InFlight` is the per-slot record
of prompts sent and not yet returned that lets a replacement regenerate exactly what was lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from cadence.backend.weights import WeightSync
from cadence.models.fingerprint import Fingerprints
from cadence.types import Group, Prompt


@dataclass
class TaskResult:
    """Groups of one task finished in one engine step (`task_done`: the task's last ones)."""

    worker: int
    task_id: int
    groups: list[Group]
    start: float  # time.perf_counter() in the worker (CLOCK_MONOTONIC: comparable across processes)
    end: float  # [start, end): busy time since the worker's previous result, without overlap
    task_done: bool = True
    occupancy: list[tuple[float, int]] = field(default_factory=list)  # (time, active slots)
    spans: list[tuple[str, float, float]] = field(default_factory=list)  # tool calls (name, a, b)


Lost = dict[int, tuple[list[Prompt], int]]  # task id -> (prompts not returned, iteration)


class Pool(Protocol):
    """A fixed number of worker slots on some backend.

    Messages to one worker are acted on in order (see `WorkerLoop`). `poll` returns the next
    ('groups', wid, TaskResult) or ('ack', wid, version), or None after the timeout; it raises
    `WorkerError` when a worker raised and `WorkerDied` (with `wid`) when one is gone.
    """

    timeout_s: float

    @property
    def weights(self) -> WeightSync: ...

    @property
    def num_workers(self) -> int: ...

    def submit(self, wid: int, task_id: int, prompts: list[Prompt], iteration: int) -> None: ...

    def send_sync_to(self, wid: int, version: int, expected: Fingerprints | None = None) -> None:
        """Worker `wid` is to load `version`, published with the fingerprints `expected` (None:
        not checked)."""
        ...

    def poll(self, timeout_s: float) -> tuple[str, int, Any] | None: ...

    def has_in_flight(self) -> bool: ...

    def replace(self, wid: int) -> Lost:
        """Put a fresh worker (no weights loaded yet) in slot `wid`; return the tasks the old one
        had not finished, by id, as (prompts not yet returned, iteration)."""
        ...

    def close(self) -> None: ...


class InFlight:
    """The prompts a worker has been sent and not yet returned, by task: what a replacement for
    it must be sent again. A group returned is struck off at once, so none is generated twice."""

    def __init__(self) -> None:
        self.tasks: Lost = {}

    def add(self, task_id: int, prompts: list[Prompt], iteration: int) -> None:
        self.tasks[task_id] = (list(prompts), iteration)

    def returned(self, result: TaskResult) -> None:
        prompts, iteration = self.tasks.get(result.task_id, ([], 0))
        done = {g.prompt.uid for g in result.groups}
        left = [p for p in prompts if p.uid not in done]
        if result.task_done or not left:
            self.tasks.pop(result.task_id, None)
        else:
            self.tasks[result.task_id] = (left, iteration)

    def uids(self) -> list[str]:
        return [p.uid for prompts, _ in self.tasks.values() for p in prompts]

    def shown(self) -> str:
        """The uids in flight for a message: the first eight, and how many in all."""
        uids = self.uids()
        return ", ".join(uids[:8]) + (f", ... ({len(uids)} in all)" if uids[8:] else "") or "none"

    def __bool__(self) -> bool:
        return bool(self.tasks)
