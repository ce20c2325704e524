"""`cadence bench --suite trl`: TRL's `GRPOTrainer` and cadence on one workload, side by side.

Both get the same local model and tokenizer, prompts in the same order, group size, response
cap, sampling, prompts per step, micro-batch, learning rate, clip range, KL coefficient, reward
function and torch threads, for the same number of optimizer steps; what each was actually given
is read back from it and written side by side. TRL runs with its CPU-compatible settings
(`CPU_SETTINGS`); a config with `model.lora` trains the same adapter in both. Every figure
(trained tokens, wall, TPSPD, generation and training busy, overlap) is defined the same way for
both: docs/benchmarks.md. trl is imported only inside `run_trl`.
"""

from __future__ import annotations

import json
from pathlib import Path

from cadence.bench.common import interleave, machine, median_row, package_version
from cadence.bench.runs import FIGURES, run_cadence, workload_config
from cadence.bench.trl_setup import (
    INSTALL_HINT,
    SHARED_SETTINGS,
    available,
    check_workload,
    run_trl,
)
from cadence.config import ConfigError
from cadence.metrics.tables import markdown_table as table

# ----------------------------------------------------------------------------- the suite

CELLS = ("cadence", "trl")


def bench_trl(config: str | Path | None, overrides: list[str], repeats: int, out: Path) -> dict:
    """cadence (the config's own pipeline) and TRL, interleaved; medians in bench.json/bench.md."""
    if not available():
        raise ConfigError(f"suite 'trl' needs trl, which is not installed: {INSTALL_HINT}")
    cfg = workload_config(config, overrides)
    check_workload(cfg)
    out.mkdir(parents=True, exist_ok=True)

    def run_cell(name: str, rep: int) -> dict:
        run = run_cadence if name == "cadence" else run_trl
        return run(cfg, out / "runs" / f"{name}-{rep}")

    samples = interleave(CELLS, repeats, run_cell)
    rows = {name: median_row(samples[name], FIGURES) for name in CELLS}
    report = {
        "suite": "trl",
        "repeats": repeats,
        "cadence_pipeline": {
            "mode": cfg.pipeline.mode,
            "placement": cfg.pipeline.placement,
            "shared_prompt": cfg.learner.shared_prompt,
            "shared_prompt_impl": cfg.learner.shared_prompt_impl,
            "reuse_old_logprobs": cfg.learner.reuse_old_logprobs,
        },
        "settings": {name: rows[name].pop("settings") for name in CELLS},
        "grpo_config": rows["trl"].pop("grpo_config"),
        "trl_version": package_version("trl"),
        "machine": machine(),
        "rows": [rows[name] for name in CELLS],
    }
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "bench.md").write_text(markdown_table(report) + "\n")
    return report


def settings_table(settings: dict[str, dict]) -> str:
    """The settings each tool reports it ran with, one row per setting."""
    cells = []
    for key in SHARED_SETTINGS:
        c, t = settings["cadence"][key], settings["trl"][key]
        cells.append([key, c, t, "yes" if c == t else "**no**"])
    return table(["setting", "cadence", "trl", "same"], cells)


def markdown_table(report: dict) -> str:
    rows = {r["tool"]: r for r in report["rows"]}
    base = rows["trl"]["tpspd"]
    header = [
        *("tool", "TPSPD", "x TRL", "wall s", "trained tokens", "gen busy s", "train busy s"),
        *("idle s", "prompt / response tokens (mean)", "reward first -> last"),
    ]
    cells = []
    for name in CELLS:
        r = rows[name]
        cells.append(
            [
                *(name, f"{r['tpspd']:,.0f}", f"{r['tpspd'] / base:.2f}", f"{r['wall_s']:.1f}"),
                *(f"{r['num_tokens']:,.0f}", f"{r['gen_busy_s']:.1f}", f"{r['train_busy_s']:.1f}"),
                f"{r['idle_s']:.1f}",
                f"{r['prompt_tokens_mean']:.1f} / {r['response_tokens_mean']:.1f}",
                f"{r['reward_mean_first']:.3f} -> {r['reward_mean_last']:.3f}",
            ]
        )
    pipe = report["cadence_pipeline"]
    return "\n".join(
        [
            table(header, cells),
            "",
            f"cadence pipeline: {pipe['mode']} / {pipe['placement']}, shared prompt "
            f"{'on (' + pipe['shared_prompt_impl'] + ')' if pipe['shared_prompt'] else 'off'}, "
            f"old-logprob reuse {'on' if pipe['reuse_old_logprobs'] else 'off'}; median of "
            f"{report['repeats']} interleaved repeats; trl {report['trl_version']}.",
            "",
            settings_table(report["settings"]),
        ]
    )
