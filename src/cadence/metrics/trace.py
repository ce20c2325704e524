"""Spans of work on named tracks (a worker, the learner), for busy/idle figures and the timeline.

A span is (name, track, start, end) in seconds since the tracer's origin; a sample is a counter's
value on a track from time t on (a worker's occupied engine slots). Recording is thread-safe;
nothing here draws or writes files.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    name: str
    track: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Sample:
    name: str
    track: str
    t: float
    value: float


class Tracer:
    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self.spans: list[Span] = []
        self.samples: list[Sample] = []
        self._lock = threading.Lock()

    def add_samples(self, name: str, track: str, points: Sequence[tuple[float, float]]) -> None:
        """Counter values from `time.perf_counter()` stamps (any process on this machine)."""
        with self._lock:
            self.samples.extend(Sample(name, track, t - self.origin, v) for t, v in points)

    def now(self) -> float:
        return time.perf_counter() - self.origin

    @contextmanager
    def span(self, name: str, track: str) -> Iterator[None]:
        start = self.now()
        try:
            yield
        finally:
            self.add(Span(name, track, start, self.now()))

    def add(self, span: Span) -> None:
        with self._lock:
            self.spans.append(span)

    def mean_level(self, track: str, start: float, end: float) -> float:
        """Time-weighted mean over [start, end] of the counter on `track`: its last value before
        `start` carries in (0 before its first sample). Reads back from the newest sample only
        until one before `start`, so the cost does not grow with the run."""
        level, points = 0.0, []
        with self._lock:
            for s in reversed(self.samples):
                if s.track != track:
                    continue
                if s.t <= start:
                    level = s.value
                    break
                points.append((s.t, s.value))
        if end <= start:
            return level
        total, t0 = 0.0, start
        for t, value in sorted(points):
            t = min(t, end)
            total += level * max(t - t0, 0.0)
            t0, level = max(t, t0), value
        total += level * max(end - t0, 0.0)
        return total / (end - start)

    def select(
        self, track_prefix: str, since: float = 0.0, names: tuple[str, ...] = ()
    ) -> list[Span]:
        """Spans on tracks starting with `track_prefix`, begun at `since` or later."""
        with self._lock:
            return [
                s
                for s in self.spans
                if s.track.startswith(track_prefix)
                and s.start >= since
                and (not names or s.name in names)
            ]


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def overlap_length(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Length of time covered by both interval sets (each may overlap itself)."""
    return union_length(xs) + union_length(ys) - union_length(xs + ys)
