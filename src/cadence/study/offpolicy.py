"""`cadence study offpolicy`: how much staleness each loss tolerates, as a reproducible grid.

For every loss and every staleness bound N the same workload is trained from the same model with
the same seed (N = 0 is `periodic`, N >= 1 is `offpolicy` with `pipeline.max_staleness = N`), and
the run's final held-out accuracy, sampled reward and KL to the reference are recorded, as in the
Asynchronous RLHF paper's off-policyness study (reward and KL per loss and degree of
off-policyness). Rows are appended to `DIR/study.json` as each run ends, so an interrupted study
resumes where it stopped; `DIR/study.png` plots accuracy and reward against KL, one line per loss.
Variants (`--variants`) add, for every N >= 1, the same run with partial rollouts
(`pipeline.partial_rollout`), with and without a rollout correction.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from cadence.metrics.tables import markdown_table as table
from cadence.study.runs import train_or_resume

# study loss name -> config overrides
LOSSES: dict[str, list[str]] = {
    "grpo": ["algo.loss='ppo_clip'", "algo.advantage='grpo'"],
    "rloo": ["algo.loss='rloo'", "algo.advantage='rloo'"],
    "online_dpo": ["algo.loss='online_dpo'", "algo.kl_coef=0.0"],
}


# study variant name -> config overrides (the partial ones for N >= 1 only: offpolicy mode)
VARIANTS: dict[str, list[str]] = {
    "plain": [],
    "partial": ["pipeline.partial_rollout=true"],
    "partial-corrected": [
        "pipeline.partial_rollout=true",
        "algo.rollout_correction='sequence_mask'",  # TRL's default, clip_max 3
        "algo.correction_clip_max=3.0",
    ],
}


def cell_overrides(loss: str, staleness: int, variant: str = "plain") -> list[str]:
    mode = "periodic" if staleness == 0 else "offpolicy"
    return [
        *LOSSES[loss],
        *VARIANTS[variant],
        "pipeline.placement='separate'",
        f"pipeline.mode='{mode}'",
        f"pipeline.max_staleness={staleness}",
        "metrics.progress=false",
        "train.eval_every=0",
    ]


def run_cell(
    config: str | None,
    overrides: list[str],
    loss: str,
    staleness: int,
    out: Path,
    variant: str = "plain",
):
    summary = train_or_resume(config, [*overrides, *cell_overrides(loss, staleness, variant)], out)
    return {
        "loss": loss,
        "staleness": staleness,
        "variant": variant,
        "accuracy": summary["accuracy_after"],
        "accuracy_before": summary["accuracy_before"],
        "accuracy_se": summary.get("accuracy_after_stderr", 0.0),
        "reward": summary["reward_mean_last"],
        "kl": summary["kl_last"],
        "wall_s": summary["wall_s"],
        "tpspd": summary["tpspd_overall"],
        "iterations": summary["iterations"],
    }


def study_offpolicy(
    config: str | None,
    overrides: list[str],
    losses: list[str],
    staleness: list[int],
    out: Path,
    variants: tuple[str, ...] = ("plain",),
) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "study.json"
    rows: list[dict] = json.loads(path.read_text()) if path.exists() else []
    done = {_key(r) for r in rows}
    cells = [
        (loss, n, v)
        for loss in losses
        for n in staleness
        for v in variants
        if v == "plain" or n >= 1  # partial rollouts are an offpolicy option
    ]
    for i, (loss, n, v) in enumerate(cells, start=1):
        name = f"{loss} N={n}" + ("" if v == "plain" else f" {v}")
        if (loss, n, v) in done:
            print(f"[{i}/{len(cells)}] {name}: done earlier, kept")
            continue
        start = time.perf_counter()
        folder = f"{loss}-N{n}" + ("" if v == "plain" else f"-{v}")
        row = run_cell(config, overrides, loss, n, out / "runs" / folder, v)
        rows.append(row)
        path.write_text(json.dumps(rows, indent=2) + "\n")  # nothing lost if a later run fails
        print(
            f"[{i}/{len(cells)}] {name}: accuracy {row['accuracy']:.3f}, reward "
            f"{row['reward']:.3f}, KL {row['kl']:.4f} ({time.perf_counter() - start:.0f}s)",
            flush=True,
        )
    rows = [r for r in rows if _key(r) in set(cells)]
    plot(rows, out / "study.png")
    (out / "study.md").write_text(markdown_table(rows))
    return rows


def _key(row: dict) -> tuple[str, int, str]:
    return row["loss"], row["staleness"], row.get("variant", "plain")  # older rows: plain


def markdown_table(rows: list[dict]) -> str:
    header = ["loss", "N", "variant", "held-out accuracy", "reward (last 10%)", "KL to reference"]
    order = list(VARIANTS)
    cells = []
    for r in sorted(rows, key=lambda r: (r["loss"], r["staleness"], order.index(_key(r)[2]))):
        se = f" ± {r['accuracy_se']:.3f}" if r.get("accuracy_se") else ""
        accuracy = f"{r['accuracy']:.3f}{se}"
        row = [r["loss"], r["staleness"], _key(r)[2], accuracy, f"{r['reward']:.3f}"]
        cells.append([*row, f"{r['kl']:.4f}", f"{r['tpspd']:,.0f}"])
    return table([*header, "TPSPD"], cells) + "\n"


def plot(rows: list[dict], path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    for ax, key, label in zip(
        axes, ("accuracy", "reward"), ("held-out accuracy", "reward"), strict=True
    ):
        for loss, variant in dict.fromkeys((r["loss"], _key(r)[2]) for r in rows):
            pts = sorted(
                (r for r in rows if (r["loss"], _key(r)[2]) == (loss, variant)),
                key=lambda r: r["staleness"],
            )
            label = loss if variant == "plain" else f"{loss} {variant}"
            ax.plot([r["kl"] for r in pts], [r[key] for r in pts], marker="o", label=label)
            for r in pts:
                ax.annotate(f"N={r['staleness']}", (r["kl"], r[key]), fontsize="x-small")
        ax.set_xlabel("KL to reference (last 10% of iterations)")
        ax.set_ylabel(label)
        ax.legend(fontsize="small")
    fig.suptitle("off-policyness study: each point is one run, N = max staleness")
    fig.savefig(path, format="png")
    return path
