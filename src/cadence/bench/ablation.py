"""`cadence bench --suite ablation`: where the speed comes from, on one workload, in one command.

Read on: docs/benchmarks.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import cadence.bench.trl_setup as trl_setup
from cadence.bench.common import interleave, machine, median_row, package_version
from cadence.bench.runs import FIGURES, run_cadence, workload_config
from cadence.config import Config, ConfigError, load_config
from cadence.metrics.tables import markdown_table as table

# pipeline name -> overrides
PIPELINES: dict[str, list[str]] = {
    "sync-colocated": ["pipeline.mode='sync'", "pipeline.placement='colocated'"],
    "sync": ["pipeline.mode='sync'", "pipeline.placement='separate'"],
    "periodic": ["pipeline.mode='periodic'", "pipeline.placement='separate'"],
    "offpolicy-1": [
        "pipeline.mode='offpolicy'",
        "pipeline.placement='separate'",
        "pipeline.max_staleness=1",
    ],
}
GRID_PIPELINES = ("sync-colocated", "sync", "periodic")
TRL = "trl"
ALL_ON = "share/reuse"
NO_SAVINGS = "noshare/noreuse"
TARGET_X_TRL = 3.0  # periodic with every saving on, against TRL's TPSPD


def cell_name(pipeline: str, shared: bool, reuse: bool) -> str:
    return f"{pipeline}/{'share' if shared else 'noshare'}/{'reuse' if reuse else 'noreuse'}"


def parse_cell(name: str) -> tuple[str, bool, bool]:
    """`periodic/share/noreuse` -> ("periodic", True, False); ValueError names what is allowed."""
    parts = name.split("/")
    if (
        len(parts) != 3
        or parts[0] not in PIPELINES
        or parts[1] not in ("share", "noshare")
        or parts[2] not in ("reuse", "noreuse")
    ):
        raise ValueError(
            f"unknown ablation cell '{name}'; a cell is '{TRL}' or PIPELINE/share|noshare/"
            f"reuse|noreuse with PIPELINE one of {', '.join(PIPELINES)} "
            "(e.g. periodic/share/reuse)"
        )
    return parts[0], parts[1] == "share", parts[2] == "reuse"


def cell_overrides(name: str) -> list[str]:
    pipeline, shared, reuse = parse_cell(name)
    return [
        *PIPELINES[pipeline],
        f"learner.shared_prompt={'true' if shared else 'false'}",
        f"learner.reuse_old_logprobs={'true' if reuse else 'false'}",
    ]


def offpolicy_support(config: str | Path | None, overrides: list[str]) -> str | None:
    """None when the config accepts one-step off-policy; otherwise the validation message."""
    try:
        load_config(config, [*overrides, *PIPELINES["offpolicy-1"]])
    except ConfigError as e:
        return str(e)
    return None


def default_cells(offpolicy: bool, trl: bool) -> list[str]:
    cells = [
        cell_name(p, s, r) for p in GRID_PIPELINES for s in (True, False) for r in (True, False)
    ]
    if offpolicy:
        cells.append(f"offpolicy-1/{ALL_ON}")
    if trl:
        cells.append(TRL)
    return cells


def choose_cells(
    text: str | None, config: str | Path | None, overrides: list[str]
) -> tuple[list[str], dict]:
    """The cells to run (`text`: comma-separated names, or None for the full grid) and why
    off-policy or TRL are left out. Raises ConfigError for an unknown or unavailable cell."""
    offpolicy_reason = offpolicy_support(config, overrides)
    trl_ok = trl_setup.available()
    notes = {
        "offpolicy_available": offpolicy_reason is None,
        "offpolicy_reason": offpolicy_reason,
        "trl_available": trl_ok,
    }
    if text is None:
        return default_cells(offpolicy_reason is None, trl_ok), notes
    cells = [c.strip() for c in text.split(",") if c.strip()]
    if not cells:
        raise ConfigError("--cells is empty; name at least one cell, e.g. periodic/share/reuse")
    if len(set(cells)) != len(cells):
        raise ConfigError(f"--cells names a cell twice: {cells}")
    for c in cells:
        if c == TRL:
            if not trl_ok:
                raise ConfigError(
                    f"cell '{TRL}' needs trl, which is not installed: {trl_setup.INSTALL_HINT}"
                )
            continue
        try:
            pipeline, _, _ = parse_cell(c)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if pipeline == "offpolicy-1" and offpolicy_reason is not None:
            raise ConfigError(
                f"cell '{c}' needs pipeline.mode = 'offpolicy' with pipeline.max_staleness = 1, "
                f"which this config does not accept: {offpolicy_reason}"
            )
    return cells, notes


def _cell_config(config: str | Path | None, overrides: list[str], name: str) -> Config:
    extra = [] if name == TRL else cell_overrides(name)
    return workload_config(config, [*overrides, *extra])


def _describe(name: str, cfg: Config) -> dict:
    if name == TRL:
        return {"name": name, "pipeline": "trl", "mode": "sync", "placement": "colocated"}
    pipeline, _, _ = parse_cell(name)
    return {
        "name": name,
        "pipeline": pipeline,
        "mode": cfg.pipeline.mode,
        "placement": cfg.pipeline.placement,
        "shared_prompt": cfg.learner.shared_prompt,
        "shared_prompt_impl": cfg.learner.shared_prompt_impl,
        "reuse_old_logprobs": cfg.learner.reuse_old_logprobs,
    }


def bench_ablation(
    config: str | Path | None,
    overrides: list[str],
    repeats: int,
    out: Path,
    cells: str | None = None,
) -> dict:
    """Run the grid (or the named `cells`), interleaved; write bench.json, bench.md, bench.png."""
    names, notes = choose_cells(cells, config, overrides)
    configs = {n: _cell_config(config, overrides, n) for n in names}  # fail early on bad input
    if TRL in configs:
        trl_setup.check_workload(configs[TRL])
    out.mkdir(parents=True, exist_ok=True)

    def run_cell(name: str, rep: int) -> dict:
        run = trl_setup.run_trl if name == TRL else run_cadence
        return run(configs[name], out / "runs" / f"{name.replace('/', '-')}-{rep}")

    samples = interleave(names, repeats, run_cell)
    rows = [_describe(n, configs[n]) | median_row(samples[n], FIGURES) for n in names]
    grpo_config = next((r.pop("grpo_config") for r in rows if r["name"] == TRL), None)
    add_ratios(rows)
    first = configs[names[0]]
    report = {
        "suite": "ablation",
        "repeats": repeats,
        "workload": {
            "config": str(config) if config is not None else None,
            "overrides": overrides,
            "iterations": first.train.iterations,
            "prompts_per_iteration": first.train.prompts_per_iteration,
            "group_size": first.rollout.group_size,
            "max_new_tokens": first.rollout.max_new_tokens,
            "kl_coef": first.algo.kl_coef,
            "model_path": first.model.path,
        },
        **notes,
        "trl_version": package_version("trl"),
        "grpo_config": grpo_config,
        "machine": machine(),
        "cells": rows,
    }
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "bench.md").write_text(markdown_report(report) + "\n")
    draw(rows, out / "bench.png")
    return report


def add_ratios(rows: list[dict]) -> None:
    """x TRL; x sync colocated with the same savings; x the same pipeline with no savings."""
    tpspd = {r["name"]: r["tpspd"] for r in rows}
    trl = tpspd.get(TRL)
    for r in rows:
        r["x_trl"] = r["tpspd"] / trl if trl else None
        r["x_sync_colocated"] = r["x_no_savings"] = None
        if r["name"] == TRL:
            continue
        pipeline, savings = r["name"].split("/", 1)
        colocated = tpspd.get(f"sync-colocated/{savings}")
        none = tpspd.get(f"{pipeline}/{NO_SAVINGS}")
        r["x_sync_colocated"] = r["tpspd"] / colocated if colocated else None
        r["x_no_savings"] = r["tpspd"] / none if none else None


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown_table(rows: list[dict]) -> str:
    header = [
        *("cell", "pipeline", "shared prompt", "old-logprob reuse", "TPSPD", "x TRL"),
        *("x sync-colocated (same savings)", "x no savings (same pipeline)", "wall s"),
        *("gen busy s", "train busy s", "overlap s", "idle s", "passes per micro-batch"),
        "tokens computed / trained",
    ]
    onoff = {True: "on", False: "off", None: "-"}
    cells = []
    for r in rows:
        computed = r.get("tokens_computed")
        ratio = computed / r["num_tokens"] if computed and r["num_tokens"] else None
        cells.append(
            [
                *(r["name"], r["pipeline"], onoff[r.get("shared_prompt")]),
                *(onoff[r.get("reuse_old_logprobs")], f"{r['tpspd']:,.0f}"),
                *(_num(r[k], ".2f") for k in ("x_trl", "x_sync_colocated", "x_no_savings")),
                *(f"{r[k]:.1f}" for k in ("wall_s", "gen_busy_s", "train_busy_s")),
                *(f"{r[k]:.1f}" for k in ("overlap_s", "idle_s")),
                _num(r.get("forward_passes_per_microbatch"), ".1f"),
                _num(ratio, ".2f"),
            ]
        )
    return table(header, cells)


def markdown_report(report: dict) -> str:
    w = report["workload"]
    rows = report["cells"]
    parts = [
        f"Workload: {w['config']} {' '.join(w['overrides'])}".rstrip()
        + f"; {w['iterations']} iterations x {w['prompts_per_iteration']} prompts x "
        f"{w['group_size']} samples, up to {w['max_new_tokens']} new tokens, kl_coef "
        f"{w['kl_coef']}. Median of {report['repeats']} interleaved repeats.",
        "",
        markdown_table(rows),
        "",
        "gen busy / train busy: generation (with scoring) and training busy time; overlap: both "
        "at once; idle: neither (wall - gen - train + overlap).",
    ]
    best = next((r for r in rows if r["name"] == f"periodic/{ALL_ON}"), None)
    if best is not None and best["x_trl"] is not None:
        verdict = "met" if best["x_trl"] >= TARGET_X_TRL else "not met"
        parts.append(
            f"periodic/{ALL_ON} is {best['x_trl']:.2f}x TRL's TPSPD "
            f"(target {TARGET_X_TRL:.0f}x: {verdict})."
        )
    if not report["offpolicy_available"]:
        parts.append(f"offpolicy-1 not run: {report['offpolicy_reason']}")
    if not report["trl_available"]:
        parts.append(f"TRL not run: trl is not installed ({trl_setup.INSTALL_HINT}).")
    return "\n".join(parts)


def draw(rows: list[dict], path: Path) -> None:
    """TPSPD per cell, and each cell's wall time split into gen only / both / train only / idle."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = [r["name"] for r in rows]
    ys = list(range(len(rows)))[::-1]  # first cell at the top
    fig = Figure(figsize=(14, 0.45 * len(rows) + 1.8))
    FigureCanvasAgg(fig)
    ax_rate, ax_time = fig.subplots(1, 2, sharey=True)
    colors = ["tab:gray" if n == TRL else "tab:blue" for n in names]
    ax_rate.barh(ys, [r["tpspd"] for r in rows], color=colors)
    trl = next((r["tpspd"] for r in rows if r["name"] == TRL), None)
    if trl:
        ax_rate.axvline(TARGET_X_TRL * trl, color="tab:red", linestyle="--", label="3x TRL")
        ax_rate.legend(loc="lower right")
    ax_rate.set_yticks(ys, names)
    ax_rate.set_xlabel("TPSPD (trained tokens / s / device)")
    ax_rate.set_title("throughput")
    left = [0.0] * len(rows)
    parts = [
        ("generation only", "tab:orange", lambda r: r["gen_busy_s"] - r["overlap_s"]),
        ("both", "tab:purple", lambda r: r["overlap_s"]),
        ("training only", "tab:green", lambda r: r["train_busy_s"] - r["overlap_s"]),
        ("idle", "lightgray", lambda r: r["idle_s"]),
    ]
    for label, color, width in parts:
        widths = [max(width(r), 0.0) for r in rows]
        ax_time.barh(ys, widths, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax_time.set_xlabel("seconds of wall time (median)")
    ax_time.set_title("where the time goes")
    ax_time.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
