"""The history gate of the learning tests: curves of trusted runs kept in the repository
(tests/history/learning.json), and each CI run compared with them step by step.

A run's figure at iteration i must lie in the band the trusted runs drew there (seeds 0-4 of the
same test: their lowest and highest value) widened by `MARGIN` of the figure's scale on each side:
two-sided, for a run far better than its history is as suspect as one far worse (a reward read
from the wrong field, a learning rate ten times the intended one). A missing iteration, a missing
figure or a NaN is an error. Refresh on purpose, never to make a test pass:

    CADENCE_LEARNING_SEEDS=0,1,2,3,4 CADENCE_LEARNING_HISTORY=refresh \\
        .venv/bin/python -m pytest tests/pipeline/test_learning.py -p no:xdist

writes every run's curves to the history, which the commit then carries with its reason.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

HISTORY = Path(__file__).parent / "history" / "learning.json"
FIGURES = ("reward_mean", "entropy")
MARGIN = 0.1  # of the band's figure's scale: its largest absolute value over the history


def refreshing() -> bool:
    return os.environ.get("CADENCE_LEARNING_HISTORY") == "refresh"


def record(run: str, seed: int, records: list[dict]) -> None:
    """Keep `run`'s curves of `seed` in the history (refreshing only)."""
    history = json.loads(HISTORY.read_text()) if HISTORY.exists() else {}
    curves = {f: [r.get(f) for r in records] for f in FIGURES}
    history.setdefault(run, {})[str(seed)] = curves
    HISTORY.write_text(json.dumps(history, indent=1, sort_keys=True) + "\n")


def off_history(run: str, records: list[dict], history: dict | None = None) -> list[str]:
    """What in `records` lies outside `run`'s history band (empty: nothing)."""
    history = history if history is not None else json.loads(HISTORY.read_text())
    if run not in history:
        return [f"{run}: no history (refresh it: tests/history.py)"]
    trusted = list(history[run].values())
    bad = []
    for figure in FIGURES:
        curves = [t[figure] for t in trusted]
        scale = max(abs(v) for c in curves for v in c) or 1.0
        length = len(curves[0])
        got = [r.get(figure) for r in records]
        if len(got) != length:
            bad.append(f"{run} {figure}: {len(got)} iterations, the history has {length}")
            continue
        for i, value in enumerate(got):
            if value is None or not math.isfinite(value):
                bad.append(f"{run} {figure} iteration {i}: {value} (missing or not finite)")
                continue
            low = min(c[i] for c in curves) - MARGIN * scale
            high = max(c[i] for c in curves) + MARGIN * scale
            if not low <= value <= high:
                side = "above" if value > high else "below"
                bad.append(
                    f"{run} {figure} iteration {i}: {value:.4g} {side} the history's "
                    f"[{low:.4g}, {high:.4g}]"
                )
    return bad
