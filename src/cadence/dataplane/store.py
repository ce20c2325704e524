"""The sample store: samples stream between stages through a table that knows, per row and per
field, what is written and which consumer has taken it (AsyncFlow's TransferQueue,
arXiv 2507.01663).

One class serves in-process and in a Ray actor: the actor constructs it (give the actor
`max_concurrency > 1` so a blocked `get` does not block `put`). It holds no thread beyond a
condition variable, which pickling leaves out and unpickling rebuilds. Values are stored by
reference: a consumer must not mutate what it gets. This module must not import Ray or torch.

Read on: docs/pipeline.md#how-it-is-built.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from cadence.dataplane.samplers import Entry, Sampler, Unit, in_order
from cadence.dataplane.staleness import unit_within_staleness
from cadence.types import SampleBatch, SampleRow


class StoreClosed(RuntimeError):
    """The store was closed: nothing more will be put, and nothing is left for this get."""


class Store(Protocol):
    """What stages call on a sample store: `SampleStore` in this process, or the same class in a
    Ray actor behind a forwarding handle (`backend.ray.store.ActorStore`)."""

    def put(self, rows: Sequence[SampleRow], fields: Mapping[str, Sequence[Any]]) -> None: ...

    def get(
        self,
        fields: Sequence[str],
        batch_size: int,
        task: str,
        timeout: float | None = None,
        *,
        groups: bool = True,
        sampler: Sampler = ...,
        version: int | None = None,
        max_staleness: int = 0,
        min_size: int | None = None,
        iteration: int | None = None,
    ) -> SampleBatch: ...

    def depth(
        self,
        fields: Sequence[str],
        task: str,
        *,
        groups: bool = False,
        iteration: int | None = None,
        units: bool = False,
    ) -> int: ...

    def clear(self, iteration: int) -> int: ...

    def close(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...


class SampleStore:
    """Rows of samples, fields written by stages, consumed exactly once per task. Thread-safe.

    `remember_cleared` bounds how many cleared iterations the store remembers in order to
    ignore late writes to them; a write later than that would recreate its row.
    """

    def __init__(self, remember_cleared: int = 1024) -> None:
        self._rows: dict[int, Entry] = {}
        self._groups: dict[int, dict[int, Entry]] = {}  # group -> index_in_group -> entry
        self._iterations: dict[int, set[int]] = {}  # iteration -> its groups
        self._cleared = _Recent(remember_cleared)
        self._closed = False
        self._put: Counter[str] = Counter()  # field -> rows written
        self._got: Counter[str] = Counter()  # task -> rows handed out
        self._dropped: Counter[str] = Counter()  # task -> rows refused as too stale
        self._wait_s: dict[str, float] = {}  # task -> seconds spent inside get
        self._late_rows = 0
        self._waiting = 0  # gets blocked right now
        self._cond = threading.Condition()

    def __getstate__(self) -> dict[str, Any]:
        with self._cond:
            state = self.__dict__.copy()
        del state["_cond"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._waiting = 0  # waiters do not travel with a copy
        self._cond = threading.Condition()

    # -- writing ---------------------------------------------------------------------------

    def put(self, rows: Sequence[SampleRow], fields: Mapping[str, Sequence[Any]]) -> None:
        """Write `fields[name][i]` to `rows[i]`, creating rows not seen before. All or nothing:
        a bad row or value raises before anything is written."""
        for name, values in fields.items():
            if len(values) != len(rows):
                raise ValueError(f"field {name!r} has {len(values)} values for {len(rows)} rows")
        with self._cond:
            if self._closed:
                raise StoreClosed("put on a closed store")
            live = [i for i, r in enumerate(rows) if r.iteration not in self._cleared]
            self._late_rows += len(rows) - len(live)
            check_put([rows[i] for i in live], fields, self._rows, self._groups)
            for i in live:
                entry = self._entry(rows[i])
                for name, values in fields.items():
                    entry.data[name] = values[i]
            for name in fields:
                self._put[name] += len(live)
            self._cond.notify_all()

    def _entry(self, row: SampleRow) -> Entry:
        entry = self._rows.get(row.index)
        if entry is None:
            entry = self._rows[row.index] = Entry(row)
            self._groups.setdefault(row.group, {})[row.index_in_group] = entry
            self._iterations.setdefault(row.iteration, set()).add(row.group)
        return entry

    def clear(self, iteration: int) -> int:
        """Free every row of `iteration`; later writes to it are ignored. Returns rows freed."""
        with self._cond:
            freed = 0
            for group in self._iterations.pop(iteration, set()):
                for entry in self._groups.pop(group).values():
                    del self._rows[entry.row.index]
                    freed += 1
            self._cleared.add(iteration)
            return freed

    def close(self) -> None:
        """No more puts; every blocked get wakes, takes what is ready, or raises StoreClosed."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- reading ---------------------------------------------------------------------------

    def get(
        self,
        fields: Sequence[str],
        batch_size: int,
        task: str,
        timeout: float | None = None,
        *,
        groups: bool = True,
        sampler: Sampler = in_order,
        version: int | None = None,
        max_staleness: int = 0,
        min_size: int | None = None,
        iteration: int | None = None,
    ) -> SampleBatch:
        """Take up to `batch_size` ready units for `task` (see the module docstring)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {batch_size}")
        if min_size is not None and not 1 <= min_size <= batch_size:
            raise ValueError(f"min_size must be in 1..batch_size ({batch_size}); got {min_size}")
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None; got {timeout}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0; got {max_staleness}")
        fields = tuple(fields)
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        with self._cond:
            dropped = [0, 0]  # rows, units
            wake = batch_size if min_size is None else min_size
            while True:
                units, num_dropped = self._ready(
                    fields, task, groups, version, max_staleness, iteration
                )
                dropped = [dropped[0] + num_dropped[0], dropped[1] + num_dropped[1]]
                left = None if deadline is None else deadline - time.monotonic()
                if len(units) >= wake or self._closed:
                    break
                if left is not None and left <= 0:
                    if min_size is not None:
                        units = []  # fewer than min_size: none
                    break
                self._waiting += 1
                try:
                    self._cond.wait(left)
                finally:
                    self._waiting -= 1
            self._wait_s[task] = self._wait_s.get(task, 0.0) + time.monotonic() - start
            if not units and self._closed:
                raise StoreClosed(f"store closed; nothing left for task {task!r}")
            chosen = _checked(sampler(units, batch_size), units, batch_size)
            return self._take(chosen, fields, task, dropped)

    def _ready(
        self,
        fields: tuple[str, ...],
        task: str,
        groups: bool,
        version: int | None,
        bound: int,
        iteration: int | None,
    ) -> tuple[list[Unit], tuple[int, int]]:
        """Units ready for `task`, after dropping (consuming) the too stale; (rows, units)
        dropped."""
        units: list[Unit] = []
        dropped, dropped_units = 0, 0
        for unit in self._units(groups, iteration):
            if not all(task not in e.consumed and all(f in e.data for f in fields) for e in unit):
                continue
            if version is not None and not unit_within_staleness(unit, version, bound, task):
                for e in unit:
                    e.consumed.add(task)
                dropped += len(unit)
                dropped_units += 1
                self._dropped[task] += len(unit)
                continue
            units.append(unit)
        return units, (dropped, dropped_units)

    def _units(self, groups: bool, iteration: int | None = None) -> list[Unit]:
        if iteration is None:
            members_of = list(self._groups.values())
        else:
            members_of = [self._groups[g] for g in self._iterations.get(iteration, ())]
        if not groups:
            if iteration is None:
                return [(e,) for e in self._rows.values()]
            return sorted(((e,) for m in members_of for e in m.values()), key=_first_index)
        return sorted(
            (
                tuple(members[i] for i in range(len(members)))
                for members in members_of
                if len(members) == next(iter(members.values())).row.group_size
            ),
            key=_first_index,
        )

    def _take(
        self, units: list[Unit], fields: tuple[str, ...], task: str, dropped: list[int]
    ) -> SampleBatch:
        entries = [e for u in units for e in u]
        for e in entries:
            e.consumed.add(task)
        self._got[task] += len(entries)
        return SampleBatch(
            rows=[e.row for e in entries],
            data={f: [e.data[f] for e in entries] for f in fields},
            num_dropped=dropped[0],
            num_dropped_units=dropped[1],
        )

    # -- figures ---------------------------------------------------------------------------

    def depth(
        self,
        fields: Sequence[str],
        task: str,
        *,
        groups: bool = False,
        iteration: int | None = None,
        units: bool = False,
    ) -> int:
        """Rows ready for `task` and not yet taken by it (in whole ready groups if `groups`; of
        `iteration` only, if given); with `units`, how many units (groups or rows) those are."""
        fields = tuple(fields)
        with self._cond:
            return sum(
                1 if units else len(u)
                for u in self._units(groups, iteration)
                if all(task not in e.consumed and all(f in e.data for f in fields) for e in u)
            )

    @property
    def num_rows(self) -> int:
        with self._cond:
            return len(self._rows)

    def stats(self) -> dict[str, Any]:
        """Counters a stage can report: rows stored, rows put per field, rows got and dropped and
        seconds spent in get per task, late rows ignored, and gets blocked right now."""
        with self._cond:
            return {
                "rows": len(self._rows),
                "groups": len(self._groups),
                "iterations": len(self._iterations),
                "put": dict(self._put),
                "got": dict(self._got),
                "dropped": dict(self._dropped),
                "wait_s": dict(self._wait_s),
                "late_rows": self._late_rows,
                "waiting": self._waiting,
            }


class _Recent:
    """A set that remembers only its `size` most recently added items."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"remember_cleared must be >= 1; got {size}")
        self._order: deque[int] = deque()
        self._items: set[int] = set()
        self._size = size

    def add(self, item: int) -> None:
        if item in self._items:
            return
        self._order.append(item)
        self._items.add(item)
        if len(self._order) > self._size:
            self._items.discard(self._order.popleft())

    def __contains__(self, item: int) -> bool:
        return item in self._items

    def __len__(self) -> int:
        return len(self._items)


def _first_index(unit: Unit) -> int:
    return unit[0].row.index


def _checked(chosen: list[Unit], units: list[Unit], batch_size: int) -> list[Unit]:
    offered = {id(u) for u in units}
    if len(chosen) > batch_size or len({id(u) for u in chosen}) != len(chosen):
        raise ValueError(f"sampler returned {len(chosen)} units (duplicates?) for {batch_size}")
    if any(id(u) not in offered for u in chosen):
        raise ValueError("sampler returned a unit it was not offered")
    return chosen


def check_put(
    rows: Sequence[SampleRow],
    fields: Mapping[str, Sequence[Any]],
    stored: Mapping[int, Entry],
    groups: Mapping[int, Mapping[int, Entry]],
) -> None:
    """Refuse a put that would break the store's rows: an index twice, a row that conflicts with
    the stored one, a field written twice, a group whose rows disagree."""
    seen: set[int] = set()
    new_groups: dict[int, list[SampleRow]] = {}  # group -> its rows this put creates
    for row in rows:
        if not 0 <= row.index_in_group < row.group_size:
            raise ValueError(f"row {row}: index_in_group outside 0..group_size-1")
        if row.index in seen:
            raise ValueError(f"row index {row.index} appears twice in one put")
        seen.add(row.index)
        entry = stored.get(row.index)
        if entry is None:
            new_groups.setdefault(row.group, []).append(row)
        elif entry.row != row:
            raise ValueError(f"row {row} conflicts with the stored {entry.row}")
        elif written := [name for name in fields if name in entry.data]:
            raise ValueError(f"row {row.index}: field(s) {written} already written")
    for group, new in new_groups.items():
        members = [e.row for e in groups.get(group, {}).values()] + new
        if len({(r.group_size, r.iteration) for r in members}) > 1:
            raise ValueError(f"group {group}: rows disagree on group_size or iteration: {new}")
        if len({r.index_in_group for r in members}) < len(members):
            raise ValueError(f"group {group}: two rows share an index_in_group: {new}")
