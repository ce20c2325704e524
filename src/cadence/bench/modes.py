"""`cadence bench --suite modes`: the same workload in several pipeline modes, side by side;
`--suite partial`: the same on a long-tailed workload, partial rollouts next to the modes.

Modes are interleaved across repeats (mode A, B, C, then A, B, C again) so that machine drift hits
all of them alike, and each figure is the median over repeats. Worker start-up is not timed; the
RL loop is (held-out evaluations are skipped). Writes `bench.json` and `bench.md` in `--out`.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from cadence.metrics.tables import markdown_table as table

# name -> (pipeline.mode, pipeline.placement)
MODES: dict[str, tuple[str, str]] = {
    "sync-colocated": ("sync", "colocated"),
    "sync": ("sync", "separate"),
    "periodic": ("periodic", "separate"),
    "offpolicy": ("offpolicy", "separate"),  # pipeline.max_staleness from the config (default 1)
    "partial": ("offpolicy", "separate"),  # offpolicy with partial rollouts, the KV cache kept
    "partial-recompute": ("offpolicy", "separate"),  # the prefixes re-prefilled
}
EXTRA: dict[str, list[str]] = {  # name -> the keys that set it apart from its mode
    "partial": ["pipeline.partial_rollout=true", "pipeline.partial_rollout_kv='keep'"],
    "partial-recompute": [
        "pipeline.partial_rollout=true",
        "pipeline.partial_rollout_kv='recompute'",
    ],
}
PARTIAL_SUITE = "sync,periodic,offpolicy,partial"
FIGURES = ("tpspd", "wall_s", "gen_busy_s", "train_busy_s", "pipeline_efficiency", "learner_idle")


def parse_modes(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODES]
    if unknown or not names:
        raise ValueError(f"unknown bench mode(s) {unknown}; allowed: {', '.join(MODES)}")
    return names


def run_once(config: str | None, overrides: list[str], name: str, out: Path) -> dict:
    from cadence.builder import build_run, train
    from cadence.config import load_config

    mode, placement = MODES[name]
    cfg = load_config(
        config,
        [
            *overrides,
            *EXTRA.get(name, []),
            f"pipeline.mode='{mode}'",
            f"pipeline.placement='{placement}'",
            "metrics.progress=false",
            "train.eval_every=0",
        ],
    )
    summary = train(build_run(cfg), out, evaluate=False)
    return {
        "tpspd": summary["tpspd_overall"],
        "wall_s": summary["wall_s"],
        "gen_busy_s": summary["gen_s"],
        "train_busy_s": summary["train_s"],
        "pipeline_efficiency": summary["pipeline_efficiency"],
        "learner_idle": 1.0 - summary["train_s"] / summary["wall_s"],  # what overlap can fill
        "mode": mode,
        "placement": placement,
    }


def bench(
    config: str | None, overrides: list[str], names: list[str], repeats: int, out: Path
) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    samples: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(repeats):
        for name in names:
            result = run_once(config, overrides, name, out / "runs" / f"{name}-{rep}")
            samples[name].append(result)
            print(
                f"repeat {rep + 1}/{repeats} {name}: tpspd {result['tpspd']:,.0f}, "
                f"wall {result['wall_s']:.1f}s",
                flush=True,
            )
    rows = []
    for name in names:
        first = samples[name][0]
        row = {
            "name": name,
            "mode": first["mode"],
            "placement": first["placement"],
            "repeats": repeats,
        }
        row |= {f: statistics.median(s[f] for s in samples[name]) for f in FIGURES}
        row["tpspd_all"] = [s["tpspd"] for s in samples[name]]
        rows.append(row)
    (out / "bench.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "bench.md").write_text(markdown_table(rows) + "\n")
    return rows


def markdown_table(rows: list[dict]) -> str:
    base = {r["name"]: r["tpspd"] for r in rows}
    ref = base.get("sync-colocated") or rows[0]["tpspd"]
    same, off = base.get("sync"), base.get("offpolicy")
    header = [
        *("name", "mode", "placement", "TPSPD", "x sync-colocated", "x sync (same placement)"),
        *("x offpolicy", "wall s", "gen busy s", "train busy s", "learner idle"),
        "pipeline efficiency",
    ]
    cells = []
    for r in rows:
        vs_same = f"{r['tpspd'] / same:.2f}" if same and r["placement"] == "separate" else "-"
        vs_off = f"{r['tpspd'] / off:.2f}" if off and r["placement"] == "separate" else "-"
        cells.append(
            [
                *(r["name"], r["mode"], r["placement"], f"{r['tpspd']:,.0f}"),
                *(f"{r['tpspd'] / ref:.2f}", vs_same, vs_off, f"{r['wall_s']:.1f}"),
                *(f"{r['gen_busy_s']:.1f}", f"{r['train_busy_s']:.1f}"),
                *(f"{r['learner_idle']:.2f}", f"{r['pipeline_efficiency']:.2f}"),
            ]
        )
    return table(header, cells)
