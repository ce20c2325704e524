"""`cadence study seeds`: does RL learn whatever the seed? The main job's config, run once per seed.

Every run starts from the same model (the config's `model.path`, e.g. the SFT warm start) and is
measured on the same held-out problems (`data.seed` fixes them); only `train.seed` changes: the
training stream's order and every sampling seed. Per seed the study records held-out accuracy
before and after RL with their standard errors, the gain, and the held-out curve; over seeds, the
mean and standard deviation of the gain. Rows are appended to `DIR/study.json` as each run ends
and a run an interruption left unfinished resumes from its checkpoint, so the study resumes where
it stopped. `DIR/study.md` holds the table, `DIR/study.png` held-out accuracy against iteration,
one line per seed.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from cadence.metrics.tables import markdown_table as table
from cadence.study.runs import train_or_resume


def run_seed(config: str | None, overrides: list[str], seed: int, out: Path) -> dict[str, Any]:
    summary = train_or_resume(
        config, [*overrides, f"train.seed={seed}", "metrics.progress=false"], out
    )
    curve = [[0, summary["accuracy_before"]]]  # [iterations trained, held-out accuracy]
    for line in (out / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "heldout_accuracy" in r:
            curve.append([r["iteration"] + 1, r["heldout_accuracy"]])
    if curve[-1][0] != summary["iterations"]:
        curve.append([summary["iterations"], summary["accuracy_after"]])
    return {
        "seed": seed,
        "accuracy_before": summary["accuracy_before"],
        "accuracy_before_stderr": summary["accuracy_before_stderr"],
        "accuracy_after": summary["accuracy_after"],
        "accuracy_after_stderr": summary["accuracy_after_stderr"],
        "gain": summary["accuracy_after"] - summary["accuracy_before"],
        "num_heldout": summary["num_heldout"],
        "reward_first": summary["reward_mean_first"],
        "reward_last": summary["reward_mean_last"],
        "kl_last": summary["kl_last"],
        "wall_s": summary["wall_s"],
        "iterations": summary["iterations"],
        "curve": curve,
    }


def study_seeds(
    config: str | None, overrides: list[str], seeds: list[int], out: Path
) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "study.json"
    rows: list[dict[str, Any]] = json.loads(path.read_text()) if path.exists() else []
    done = {r["seed"] for r in rows}
    for i, seed in enumerate(seeds, start=1):
        if seed in done:
            print(f"[{i}/{len(seeds)}] seed {seed}: done earlier, kept")
            continue
        start = time.perf_counter()
        row = run_seed(config, overrides, seed, out / "runs" / f"seed-{seed}")
        rows.append(row)
        path.write_text(json.dumps(rows, indent=2) + "\n")  # nothing lost if a later run fails
        print(
            f"[{i}/{len(seeds)}] seed {seed}: held-out {row['accuracy_before']:.3f} -> "
            f"{row['accuracy_after']:.3f} (gain {100 * row['gain']:+.1f} points, "
            f"{time.perf_counter() - start:.0f}s)",
            flush=True,
        )
    rows = [r for r in rows if r["seed"] in set(seeds)]
    plot(rows, out / "study.png")
    (out / "study.md").write_text(markdown_table(rows))
    return rows


def gain_stats(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """Mean and sample standard deviation of the gain over seeds (std NaN for one seed)."""
    gains = [r["gain"] for r in rows]
    std = statistics.stdev(gains) if len(gains) > 1 else math.nan
    return statistics.fmean(gains), std


def markdown_table(rows: list[dict[str, Any]]) -> str:
    n = rows[0]["num_heldout"] if rows else 0
    header = ["seed", f"held-out before ({n} problems)", "held-out after", "gain (points)"]
    cells = [
        [
            r["seed"],
            f"{r['accuracy_before']:.3f} ± {r['accuracy_before_stderr']:.3f}",
            f"{r['accuracy_after']:.3f} ± {r['accuracy_after_stderr']:.3f}",
            f"{100 * r['gain']:+.1f}",
            f"{r['wall_s']:.0f} s",
        ]
        for r in sorted(rows, key=lambda r: r["seed"])
    ]
    if rows:
        mean, std = gain_stats(rows)
        cells.append(["mean ± std", "", "", f"{100 * mean:+.1f} ± {100 * std:.1f}", ""])
    return table([*header, "RL wall time"], cells) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.5), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for r in sorted(rows, key=lambda r: r["seed"]):
        xs, ys = zip(*r["curve"], strict=True)
        ax.plot(xs, ys, marker="o", label=f"seed {r['seed']} ({100 * r['gain']:+.1f})")
    ax.set_xlabel("iteration")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    if rows:
        mean, std = gain_stats(rows)
        ax.set_title(f"held-out accuracy per seed: gain {100 * mean:+.1f} ± {100 * std:.1f} points")
    fig.savefig(path, format="png")
    return path
