"""The planner's outputs: a rich table per cluster size, a PNG of TPSPD against the split, JSON.

Drawing follows metrics/timeline.py: a matplotlib `Figure` with the Agg canvas, never pyplot, so
nothing global changes and it is safe inside tests.
Must not: simulate, or decide anything (the planner has chosen the recommendation).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from cadence.plan.planner import ClusterPlan, PlanResult
from cadence.plan.sim import SimResult


def split_label(r: SimResult) -> str:
    s = r.shape
    if s.placement == "colocated":
        return f"{s.num_inference} shared"
    return f"{s.num_inference} + {s.num_training}"


def staleness_label(r: SimResult) -> str:
    total = sum(r.staleness.values())
    mean = sum(k * v for k, v in r.staleness.items()) / total
    return f"{mean:.2f} / {max(r.staleness)}"


def cluster_table(result: PlanResult, cluster: ClusterPlan) -> Table:
    rows = sorted(cluster.best.values(), key=lambda r: _mode_order(r.shape.label))
    base = cluster.best.get("sync-colocated") or cluster.best.get("sync") or rows[0]
    table = Table(
        title=f"cadence plan: {cluster.devices} x {result.profile.name}, "
        f"{result.spec.workload.prompts_per_iteration} prompts x "
        f"{result.spec.workload.group_size}, responses {result.lengths.describe()}",
        caption=f"x base: TPSPD over {base.shape.label}'s; * recommended; busy: fraction of "
        "wall time; slot use: active sequences / engine slots; GB / rank: training state a "
        f"learner rank holds ({result.spec.cluster.learner_strategy}), with one micro-batch's "
        "activations and logits",
    )
    for name in ["mode", "inference + training", "s / iter", "TPSPD", "x base"]:
        table.add_column(name, justify="left" if name == "mode" else "right", no_wrap=True)
    for name in ["inference busy", "training busy", "slot use", "staleness mean / max"]:
        table.add_column(name, justify="right")
    table.add_column("GB / rank", justify="right")
    for r in rows:
        mark = " *" if r is cluster.recommended else ""
        table.add_row(
            r.shape.label + mark,
            split_label(r),
            f"{r.wall_s:,.2f}",
            f"{r.tpspd:,.0f}",
            f"{r.tpspd / base.tpspd:.2f}",
            f"{r.inference_busy:.0%}",
            f"{r.training_busy:.0%}",
            f"{r.slot_utilization:.0%}",
            staleness_label(r),
            f"{r.rank_memory_bytes / 1e9:,.1f}",
        )
    return table


def recommendation(cluster: ClusterPlan) -> str:
    r = cluster.recommended
    where = (
        f"all {r.shape.num_inference} devices taking turns"
        if r.shape.placement == "colocated"
        else f"{r.shape.num_inference} inference + {r.shape.num_training} training devices"
    )
    return (
        f"{cluster.devices} devices: recommended {r.shape.label} with {where}: "
        f"TPSPD {r.tpspd:,.0f}, {r.wall_s:,.2f} s per iteration; "
        f"{r.rank_memory_bytes / 1e9:,.1f} GB per learner rank (state, activations, logits)"
    )


def weight_sync_line(result: PlanResult) -> str:
    """A version's trip to a separate engine: the transport, its copies, seconds and memory."""
    t = result.profile.separate
    how = (
        "measured (hardware.profile)"
        if result.spec.hardware.profile
        else f"{result.spec.cluster.weight_sync}, {t.sync_copies:.0f} copies"
    )
    return (
        f"weight sync to a separate engine ({how}): learner {t.publish_s:.3f} s, engine "
        f"{t.load_s:.3f} s per version, {t.sync_extra_bytes / 2**20:,.0f} MiB beside each engine"
    )


def print_plan(result: PlanResult, console: Console | None = None) -> None:
    console = console or Console()
    console.print(f"hardware: {result.profile.name} ({result.profile.source})")
    console.print(weight_sync_line(result))
    for cluster in result.clusters:
        console.print(cluster_table(result, cluster))
        console.print(recommendation(cluster) + "  (* in the table)")
    for note in result.notes:
        console.print(f"note: {note}")


def write_json(result: PlanResult, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(finite(result.to_dict()), indent=2) + "\n")
    return path


def finite(x):
    """JSON has no infinity or NaN: write them as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [finite(v) for v in x]
    return x


def draw_plan(result: PlanResult, path: str | Path) -> Path:
    """TPSPD against the number of inference devices, one line per mode, one panel per size."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = len(result.clusters)
    fig = Figure(figsize=(6.5 * n, 4.5))
    FigureCanvasAgg(fig)
    for idx, cluster in enumerate(result.clusters):
        _draw_cluster(fig.add_subplot(1, n, idx + 1), cluster, result.profile.name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _draw_cluster(ax, cluster: ClusterPlan, hardware: str) -> None:
    palette = colormaps["tab10"].colors
    labels = sorted({r.shape.label for r in cluster.results}, key=_mode_order)
    for n, label in enumerate(labels):
        runs = sorted(
            (r for r in cluster.results if r.shape.label == label),
            key=lambda r: r.shape.num_inference,
        )
        colour = palette[n % len(palette)]
        if runs[0].shape.placement == "colocated":
            ax.axhline(runs[0].tpspd, color=colour, linestyle="--", label=f"{label} (all devices)")
            continue
        xs = [r.shape.num_inference for r in runs]
        ax.plot(xs, [r.tpspd for r in runs], marker="o", markersize=3, color=colour, label=label)
    best = cluster.recommended
    if best.shape.placement == "separate":
        ax.plot(
            [best.shape.num_inference],
            [best.tpspd],
            marker="*",
            markersize=14,
            color="black",
            linestyle="none",
            label="recommended",
        )
    ax.set_xlabel(f"inference devices (of {cluster.devices}; the rest train)")
    ax.set_ylabel("TPSPD (trained tokens / s / device)")
    ax.set_title(f"{cluster.devices} x {hardware}")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _mode_order(label: str) -> tuple[int, int, int]:
    order = {"sync-colocated": 0, "sync": 1, "periodic": 2}
    if label in order:
        return order[label], 0, 0
    kind, n, *kv = label.split("-")  # offpolicy-N, partial-N, partial-N-recompute
    return 3, int(n), (kind == "partial") + bool(kv)
