"""`cadence study offpolicy`: how much staleness each loss tolerates, as a reproducible grid.

For every loss and every staleness bound N the same workload is trained from the same model with
the same seed (N = 0 is `periodic`, N >= 1 is `offpolicy` with `pipeline.max_staleness = N`), and
the run's final held-out accuracy, sampled reward and KL to the reference are recorded, as in the
Asynchronous RLHF paper's off-policyness study (reward and KL per loss and degree of
off-policyness). Rows are appended to `DIR/study.json` as each run ends, so an interrupted study
resumes where it stopped; `DIR/study.png` plots accuracy and reward against KL, one line per loss.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from cadence.study.runs import train_or_resume

# study loss name -> config overrides
LOSSES: dict[str, list[str]] = {
    "grpo": ["algo.loss='ppo_clip'", "algo.advantage='grpo'"],
    "rloo": ["algo.loss='rloo'", "algo.advantage='rloo'"],
    "online_dpo": ["algo.loss='online_dpo'", "algo.kl_coef=0.0"],
}


def cell_overrides(loss: str, staleness: int) -> list[str]:
    mode = "periodic" if staleness == 0 else "offpolicy"
    return [
        *LOSSES[loss],
        "pipeline.placement='separate'",
        f"pipeline.mode='{mode}'",
        f"pipeline.max_staleness={staleness}",
        "metrics.progress=false",
        "train.eval_every=0",
    ]


def run_cell(config: str | None, overrides: list[str], loss: str, staleness: int, out: Path):
    summary = train_or_resume(config, [*overrides, *cell_overrides(loss, staleness)], out)
    return {
        "loss": loss,
        "staleness": staleness,
        "accuracy": summary["accuracy_after"],
        "accuracy_before": summary["accuracy_before"],
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
) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "study.json"
    rows: list[dict] = json.loads(path.read_text()) if path.exists() else []
    done = {(r["loss"], r["staleness"]) for r in rows}
    cells = [(loss, n) for loss in losses for n in staleness]
    for i, (loss, n) in enumerate(cells, start=1):
        if (loss, n) in done:
            print(f"[{i}/{len(cells)}] {loss} N={n}: done earlier, kept")
            continue
        start = time.perf_counter()
        row = run_cell(config, overrides, loss, n, out / "runs" / f"{loss}-N{n}")
        rows.append(row)
        path.write_text(json.dumps(rows, indent=2) + "\n")  # nothing lost if a later run fails
        print(
            f"[{i}/{len(cells)}] {loss} N={n}: accuracy {row['accuracy']:.3f}, reward "
            f"{row['reward']:.3f}, KL {row['kl']:.4f} ({time.perf_counter() - start:.0f}s)",
            flush=True,
        )
    rows = [r for r in rows if (r["loss"], r["staleness"]) in set(cells)]
    plot(rows, out / "study.png")
    (out / "study.md").write_text(markdown_table(rows))
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| loss | N | held-out accuracy | reward (last 10%) | KL to reference | TPSPD |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["loss"], r["staleness"])):
        lines.append(
            f"| {r['loss']} | {r['staleness']} | {r['accuracy']:.3f} | {r['reward']:.3f} | "
            f"{r['kl']:.4f} | {r['tpspd']:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    for ax, key, label in zip(
        axes, ("accuracy", "reward"), ("held-out accuracy", "reward"), strict=True
    ):
        for loss in dict.fromkeys(r["loss"] for r in rows):
            pts = sorted((r for r in rows if r["loss"] == loss), key=lambda r: r["staleness"])
            ax.plot([r["kl"] for r in pts], [r[key] for r in pts], marker="o", label=loss)
            for r in pts:
                ax.annotate(f"N={r['staleness']}", (r["kl"], r[key]), fontsize="x-small")
        ax.set_xlabel("KL to reference (last 10% of iterations)")
        ax.set_ylabel(label)
        ax.legend(fontsize="small")
    fig.suptitle("off-policyness study: each point is one run, N = max staleness")
    fig.savefig(path, format="png")
    return path
