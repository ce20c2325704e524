"""Samplers: which of the ready units a `SampleStore.get` takes, and the row entries they see.

A unit is what a get hands out whole: one row, or a group's rows in `index_in_group` order. A
sampler is a plain, picklable callable `(units, n) -> at most n of them`; it reads entries and
must not change them. "Whole groups" is the get's unit, not a sampler's choice, so every sampler
keeps groups whole. This module must not import Ray or torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cadence.types import SampleRow


@dataclass(slots=True, eq=False)
class Entry:
    """One stored row: its identity, the fields written so far, and the tasks that took it."""

    row: SampleRow
    data: dict[str, Any] = field(default_factory=dict)
    consumed: set[str] = field(default_factory=set)


# A unit is what a get hands out whole: one row, or a group's rows by index_in_group.
Unit = tuple[Entry, ...]
# A sampler picks at most `n` of the ready units (read-only: it must not change them).
Sampler = Callable[[Sequence[Unit], int], list[Unit]]


def in_order(units: Sequence[Unit], n: int) -> list[Unit]:
    """The `n` units with the lowest global index: first created, first out."""
    return sorted(units, key=lambda u: u[0].row.index)[:n]


@dataclass(frozen=True)
class LengthBalanced:
    """A sampler that mixes long and short units (length = summed `len` of `field` over a unit).

    Balanced means: the ready units are sorted by length and the batch takes them alternately
    from the long end and the short end (ceil(n/2) longest, floor(n/2) shortest), so the batch's
    length is close to n times the mean of the ready pool. Consumers that share a task and each
    take a batch from one pool therefore get near-equal token counts (equal when the lengths are
    evenly spread) instead of the first to ask getting all the short units. `field` must be
    among the fields the get asks for.
    """

    field: str

    def __call__(self, units: Sequence[Unit], n: int) -> list[Unit]:
        if not all(self.field in e.data for u in units for e in u):
            raise ValueError(f"LengthBalanced: the get must ask for field {self.field!r}")
        pool = deque(sorted(units, key=lambda u: (self._length(u), u[0].row.index)))
        taken: list[Unit] = []
        while pool and len(taken) < n:
            taken.append(pool.pop() if len(taken) % 2 == 0 else pool.popleft())
        return sorted(taken, key=lambda u: u[0].row.index)

    def _length(self, unit: Unit) -> int:
        return sum(len(e.data[self.field]) for e in unit)
