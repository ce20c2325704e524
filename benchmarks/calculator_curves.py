"""The calculator task with and without its tool, side by side: held-out accuracy (with its
standard error) and sampled reward against iteration, from two runs' outputs (the data of each
run's curves.png), drawn to one PNG, with a Markdown table of the held-out points.

    python benchmarks/calculator_curves.py runs/calculator runs/calculator-notool \\
        --out docs/calculator.png
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from cadence.metrics.curves import heldout_points


def load(run: Path) -> tuple[list[dict], list[tuple[int, float, float]]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    s = json.loads((run / "summary.json").read_text())
    before = (s["accuracy_before"], s["accuracy_before_stderr"])
    after = (s["accuracy_after"], s["accuracy_after_stderr"])
    return records, heldout_points(records, before, after)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tool", type=Path)
    parser.add_argument("notool", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/calculator.png"))
    args = parser.parse_args()
    runs = {"with the calculator": load(args.tool), "no tool (baseline)": load(args.notool)}
    fig = Figure(figsize=(11, 4), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    acc, reward = fig.subplots(1, 2)
    for (name, (records, points)), colour in zip(
        runs.items(), ("tab:blue", "tab:gray"), strict=True
    ):
        xs, ys, es = zip(*points, strict=True)
        es = [0.0 if math.isnan(e) else e for e in es]
        acc.errorbar(xs, ys, yerr=es, marker="o", capsize=3, color=colour, label=name)
        reward.plot(
            [r["iteration"] + 1 for r in records], [r["reward_mean"] for r in records], color=colour
        )
    acc.set(title="held-out accuracy (greedy, ± standard error)", xlabel="iteration", ylim=(0, 1))
    reward.set(title="sampled reward (mean)", xlabel="iteration", ylim=(0, 1))
    for ax in (acc, reward):
        ax.grid(alpha=0.3)
    acc.legend(loc="upper left", fontsize="small")
    fig.savefig(args.out, format="png")
    print("| run | " + " | ".join(f"iter {x}" for x, _, _ in next(iter(runs.values()))[1]) + " |")
    print("|---" * (1 + len(next(iter(runs.values()))[1])) + "|")
    for name, (_, points) in runs.items():
        print(f"| {name} | " + " | ".join(f"{y:.3f} ± {e:.3f}" for _, y, e in points) + " |")


if __name__ == "__main__":
    main()
