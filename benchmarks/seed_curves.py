"""Runs of one config over several seeds, drawn together: held-out accuracy against iteration for
each seed with the seeds' mean and min-max band (left), and each task's held-out accuracy, the
mean over seeds (right, for a mix), or for multi-turn episodes each seed's policy turns per
episode (`turns_mean`) and sampled reward per iteration (right); the Markdown rows of before,
after and gain per seed (with episodes: turns and tool calls per episode, first -> last).

    python benchmarks/seed_curves.py runs/smollm2-rg-s0 runs/smollm2-rg-s1 runs/smollm2-rg-s2 \\
        --out docs/smollm2-rg.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import tomllib
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def points(run: Path) -> tuple[dict, dict[str, list[tuple[int, float]]]]:
    """The run's summary, and per curve name ('' overall, else the task) its (iteration, accuracy)
    points: before at 0, every held-out evaluation, after at the last iteration."""
    s = json.loads((run / "summary.json").read_text())
    records = _records(run)
    tasks = [k.split("/", 1)[1] for k in s if k.startswith("accuracy_before/")]
    curves = {
        name: [(0, s["accuracy_before" + (f"/{name}" if name else "")])] for name in ["", *tasks]
    }
    for r in records:
        for name in curves:
            key = "heldout_accuracy" + (f"/{name}" if name else "")
            if key in r:
                curves[name].append((r["iteration"] + 1, r[key]))
    for name in curves:
        if curves[name][-1][0] != s["iterations"]:
            curves[name].append(
                (s["iterations"], s["accuracy_after" + (f"/{name}" if name else "")])
            )
    return s, curves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    loaded = [points(run) for run in args.runs]
    fig = Figure(figsize=(12, 4.2), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    overall, by_task = fig.subplots(1, 2)
    for run, (_, curves) in zip(args.runs, loaded, strict=True):
        xs, ys = zip(*curves[""], strict=True)
        overall.plot(xs, ys, marker="o", alpha=0.6, label=run.name)
    # the band: the seeds' evaluations share their iterations except the last one
    common = sorted(set.intersection(*({x for x, _ in c[""]} for _, c in loaded)))
    at = [[dict(c[""])[x] for _, c in loaded] for x in common]
    overall.fill_between(common, [min(v) for v in at], [max(v) for v in at], alpha=0.15)
    overall.plot(common, [statistics.mean(v) for v in at], color="black", label="mean")
    overall.set(title="held-out accuracy (greedy), each seed", xlabel="iteration", ylim=(0, 1))
    overall.legend(loc="upper left", fontsize="small")
    tasks = [n for n in loaded[0][1] if n]
    for name in tasks:
        xs = sorted(set.intersection(*({x for x, _ in c[name]} for _, c in loaded)))
        ys = [statistics.mean(dict(c[name])[x] for _, c in loaded) for x in xs]
        by_task.plot(xs, ys, marker="o", label=name)
    by_task.set(
        title="held-out accuracy per task, mean of the seeds", xlabel="iteration", ylim=(0, 1)
    )
    if not tasks:
        episodes(by_task, args.runs)
    by_task.legend(loc="lower right", fontsize="small")
    for ax in (overall, by_task):
        ax.grid(alpha=0.3)
    fig.savefig(args.out, format="png")
    for run, (s, _) in zip(args.runs, loaded, strict=True):
        gain = s["accuracy_after"] - s["accuracy_before"]
        row = (
            f"| {run.name} | {s['accuracy_before']:.3f} | {s['accuracy_after']:.3f} ± "
            f"{s['accuracy_after_stderr']:.3f} | {100 * gain:+.1f} | {s['iterations']} |"
        )
        turns = [r for r in _records(run) if "turns_mean" in r]
        if turns:
            size = tomllib.loads((run / "config.toml").read_text())["rollout"]["group_size"]
            per = [r["tool_calls"] / (r["num_groups"] * size) for r in turns]
            row += f" {turns[0]['turns_mean']:.2f} -> {turns[-1]['turns_mean']:.2f} |"
            row += f" {per[0]:.2f} -> {per[-1]:.2f} |"
        print(row)


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def episodes(ax, runs: list[Path]) -> None:
    """Each seed's policy turns per episode (solid, left axis) and sampled reward (dashed, right
    axis) per iteration."""
    reward = ax.twinx()
    per_run = [[r for r in _records(run) if "turns_mean" in r] for run in runs]
    for i, (run, rs) in enumerate(zip(runs, per_run, strict=True)):
        xs = [r["iteration"] + 1 for r in rs]
        color = f"C{i}"
        ax.plot(xs, [r["turns_mean"] for r in rs], color=color, label=f"{run.name} turns")
        reward.plot(xs, [r["reward_mean"] for r in rs], color=color, ls="--", alpha=0.6)
    top = max(r["turns_mean"] for rs in per_run for r in rs)
    ax.set(title="policy turns per episode (solid), sampled reward (dashed)", ylim=(0, top + 0.5))
    ax.set_ylabel("turns_mean")
    reward.set(ylim=(0, 1), ylabel="reward_mean")


if __name__ == "__main__":
    main()
