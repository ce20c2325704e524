"""Views of a run's spans: a Chrome trace (Perfetto, chrome://tracing) and a Gantt PNG.

Both views put tracks in one order: learner tracks, then the producer, then workers by number
(worker-2 before worker-10), then reward and teacher workers by number, then queues (rows
waiting for a stage), then anything else alphabetically. This module only reads `Span` records
after the fact: it must not record spans, hold a tracer, or touch matplotlib's global
state (no pyplot, no backend switch), so drawing is safe from any thread and inside tests.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from cadence.metrics.files import atomic_write
from cadence.metrics.trace import Sample, Span

__all__ = ["chrome_trace", "draw_timeline", "order_tracks", "write_chrome_trace"]

_PID = 1
_US_PER_S = 1e6
_BAR_HEIGHT = 0.8


def _natural_key(text: str) -> tuple[int | str, ...]:
    # Digits compare as numbers so worker-2 sorts before worker-10.
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text))


_GROUPS = ("learner", "producer", "worker", "reward", "teacher", "queue")


def _track_key(track: str) -> tuple[int, tuple[int | str, ...]]:
    for group, prefix in enumerate(_GROUPS):
        if track.startswith(prefix):
            return group, _natural_key(track)
    return len(_GROUPS), (track,)


def order_tracks(tracks: Iterable[str]) -> list[str]:
    """Distinct tracks: learner*, producer*, worker-N by N, reward-N and teacher-N by N, queue*,
    then the rest alphabetically."""
    return sorted(set(tracks), key=_track_key)


def _metadata_events(track: str, tid: int) -> list[dict]:
    return [
        {"ph": "M", "name": "thread_name", "pid": _PID, "tid": tid, "args": {"name": track}},
        {
            "ph": "M",
            "name": "thread_sort_index",
            "pid": _PID,
            "tid": tid,
            "args": {"sort_index": tid},
        },
    ]


def _complete_event(span: Span, tid: int) -> dict:
    return {
        "name": span.name,
        "cat": span.track,
        "ph": "X",
        "ts": span.start * _US_PER_S,
        "dur": span.duration * _US_PER_S,
        "pid": _PID,
        "tid": tid,
    }


def _counter_event(sample: Sample) -> dict:
    return {
        "name": f"{sample.track} {sample.name}",
        "ph": "C",
        "ts": sample.t * _US_PER_S,
        "pid": _PID,
        "args": {sample.name: sample.value},
    }


def chrome_trace(spans: list[Span], samples: list[Sample] = ()) -> dict:
    """Chrome trace-event JSON: one thread per track (tid in track order), one X event per span,
    one C (counter) event per sample."""
    tids = {track: tid for tid, track in enumerate(order_tracks(s.track for s in spans))}
    events = [event for track, tid in tids.items() for event in _metadata_events(track, tid)]
    events += [_complete_event(span, tids[span.track]) for span in spans]
    events += [_counter_event(s) for s in samples]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(spans: list[Span], path: str | Path, samples: list[Sample] = ()) -> Path:
    """Write `chrome_trace(spans, samples)` as compact JSON; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, json.dumps(chrome_trace(spans, samples), separators=(",", ":")))


# The pipeline's own span names keep one colour in every picture; other names take the rest.
_KNOWN = ("generate", "forward_backward", "optimizer_step", "weight_sync", "score", "tool")


def _name_colours(spans: list[Span]) -> dict[str, tuple[float, ...]]:
    palette = colormaps["tab10"].colors
    colours: dict[str, tuple[float, ...]] = {n: palette[i] for i, n in enumerate(_KNOWN)}
    for span in spans:
        if span.name not in colours:
            colours[span.name] = palette[len(colours) % len(palette)]
    return {n: c for n, c in colours.items() if any(s.name == n for s in spans)}


def _draw_spans(ax: Axes, spans: list[Span], tracks: list[str]) -> None:
    rows = {track: row for row, track in enumerate(tracks)}
    colours = _name_colours(spans)
    labelled: set[str] = set()
    for span in spans:
        label = span.name if span.name not in labelled else None
        labelled.add(span.name)
        y = rows[span.track] - _BAR_HEIGHT / 2
        ax.broken_barh(
            [(span.start, span.duration)], (y, _BAR_HEIGHT), color=colours[span.name], label=label
        )
    ax.set_yticks(range(len(tracks)), tracks)
    ax.set_ylim(len(tracks) - 0.5, -0.5)  # row 0 (the learner) on top


_LINE_COLOURS = ("black", "firebrick", "navy", "darkgreen")


def _draw_samples(
    ax: Axes, samples: list[Sample], tracks: list[str], capacity: Mapping[str, float]
) -> None:
    """Each track's counter as a step line inside its row: bottom empty, top its capacity (from
    `capacity` by counter name, else the counter's largest value shown)."""
    rows = {track: row for row, track in enumerate(tracks)}
    names = sorted({s.name for s in samples})
    for i, name in enumerate(names):
        mine = [s for s in samples if s.name == name]
        cap = capacity.get(name) or max(max(s.value for s in mine), 1.0)
        label: str | None = f"{name} (row height = {cap:g})"
        for track in tracks:
            points = sorted((s.t, s.value) for s in mine if s.track == track)
            if not points:
                continue
            y = [rows[track] + _BAR_HEIGHT / 2 - _BAR_HEIGHT * min(v / cap, 1.0) for _, v in points]
            colour = _LINE_COLOURS[i % len(_LINE_COLOURS)]
            ts = [t for t, _ in points]
            ax.step(ts, y, where="post", color=colour, linewidth=0.8, label=label)
            label = None


def _draw_marks(ax: Axes, marks: list[tuple[float, str]]) -> None:
    # Only the first mark with a given non-empty label reaches the legend; a label per
    # iteration boundary would swamp it.
    labelled: set[str] = set()
    for x, label in marks:
        show = bool(label) and label not in labelled
        labelled.add(label)
        ax.axvline(x, color="0.3", linestyle="--", linewidth=0.8, label=label if show else None)


def draw_timeline(
    spans: list[Span],
    path: str | Path,
    title: str = "cadence timeline",
    marks: list[tuple[float, str]] | None = None,
    samples: list[Sample] = (),
    capacity: float | Mapping[str, float] = 1.0,
) -> Path:
    """Gantt chart PNG: one row per track, one bar per span coloured by span name.

    `marks` are (seconds, label) dashed vertical lines, e.g. iteration starts; give a label to
    the first only. `samples` (counters, e.g. occupied engine slots, rows waiting in a queue) are
    drawn as step lines inside their track's row (a track of samples only gets a row of its own),
    full height meaning `capacity`: one number for every counter, or one per counter name (a name
    left out is scaled to its largest value). An empty `spans` still writes a PNG that says "no
    spans".
    """
    if not isinstance(capacity, Mapping):
        capacity = {s.name: capacity for s in samples}
    tracks = order_tracks([s.track for s in spans] + ([s.track for s in samples] if spans else []))
    fig = Figure(figsize=(12, 1 + 0.5 * max(len(tracks), 1)), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel("seconds")
    if spans:
        _draw_spans(ax, spans, tracks)
        _draw_samples(ax, list(samples), tracks, capacity)
    else:
        ax.text(0.5, 0.5, "no spans", ha="center", va="center", transform=ax.transAxes)
        ax.set_yticks([])
    _draw_marks(ax, marks or [])
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image = io.BytesIO()
    fig.savefig(image, format="png")
    return atomic_write(path, image.getvalue())
