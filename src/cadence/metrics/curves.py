"""Learning curves a person would look at: `curves.png` beside `timeline.png` in every run.

Four panels against iteration, from the run's per-iteration records: the sampled reward, the
held-out accuracy with its standard error (before RL at iteration 0, every `train.eval_every`
iterations, and after RL at the end), the KL to the reference, and the mean response length.
Drawn with matplotlib's Agg canvas (no display needed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def heldout_points(
    records: Sequence[dict[str, Any]], before: tuple[float, float], after: tuple[float, float]
) -> list[tuple[int, float, float]]:
    """(iterations trained, accuracy, standard error) of every held-out measurement: before RL,
    every evaluation the records hold, and after RL (unless the last evaluation was at the end)."""
    points = [(0, *before)]
    for r in records:
        if "heldout_accuracy" in r:
            stderr = r.get("heldout_accuracy_stderr", math.nan)
            points.append((r["iteration"] + 1, r["heldout_accuracy"], stderr))
    end = records[-1]["iteration"] + 1 if records else 0
    if points[-1][0] != end:
        points.append((end, *after))
    return [p for p in points if not math.isnan(p[1])]


def _line(ax: Axes, records: Sequence[dict[str, Any]], key: str, title: str) -> None:
    xs = [r["iteration"] + 1 for r in records if key in r]
    ys = [r[key] for r in records if key in r]
    ax.plot(xs, ys, color="tab:blue", linewidth=1.2)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("iteration")
    ax.grid(alpha=0.3)


def draw_curves(
    records: Sequence[dict[str, Any]],
    out: Path,
    before: tuple[float, float] = (math.nan, math.nan),
    after: tuple[float, float] = (math.nan, math.nan),
    title: str = "",
) -> Path:
    """Write the four panels to `out` (a PNG); `before`/`after` are (accuracy, stderr)."""
    fig = Figure(figsize=(11, 6.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    _line(axes[0][0], records, "reward_mean", "sampled reward (mean)")
    ax = axes[0][1]
    points = heldout_points(records, before, after)
    if points:
        xs, ys, errs = zip(*points, strict=True)
        errs = [0.0 if math.isnan(e) else e for e in errs]
        ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3, color="tab:green")
    ax.set_title("held-out accuracy (greedy, ± standard error)", fontsize=10)
    ax.set_xlabel("iteration")
    ax.grid(alpha=0.3)
    if any("distill_reverse_kl" in r for r in records):  # distillation: the teacher's gap
        _line(axes[1][0], records, "distill_reverse_kl", "reverse KL to the teacher (sampled)")
    else:
        _line(axes[1][0], records, "kl", "KL to reference")
    _line(axes[1][1], records, "response_tokens_mean", "response length (tokens, mean)")
    if title:
        fig.suptitle(title)
    fig.savefig(out)
    return out
