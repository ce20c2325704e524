"""The planner's prediction against the real pipeline, on this machine.

1. Calibrate (`cadence plan --calibrate`): the real engine and learner on `--model`, with the
   workload of `--config`; the model's own sampled response lengths are the distribution.
2. Predict each mode's wall time per iteration on this machine's split (the config's workers and
   learner threads), with the engine the config selects (`rollout.engine`, continuous by default).
3. Run each mode for real (`--iterations`, no held-out evaluation), interleaved across
   `--repeats`, and read `metrics.jsonl`.

Modes (`--modes`, the planner's names): by default sync-colocated, sync and periodic, and
offpolicy-1 when the config accepts `pipeline.mode = "offpolicy"` (detected, not assumed); any of
`cadence plan`'s modes may be named, e.g. `--modes offpolicy-1,partial-1` (partial-N runs
`offpolicy` with `pipeline.partial_rollout = true`, partial-N-recompute with
`pipeline.partial_rollout_kv = "recompute"`). Measured wall time per iteration is the
mean over the iterations after the first (which pays warm-up); the prediction is the simulation's
steady state. Writes `plan_vs_measured.json` and `.md` in `--out`.

    .venv/bin/python benchmarks/plan_vs_measured.py [--config configs/default.toml]
        [--model runs/sft] [--iterations 6] [--repeats 1] [--out runs/plan-vs-measured]
        [--modes sync,offpolicy-1,partial-1]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from cadence.config import ConfigError, PipelineConfig, load_config
from cadence.plan import load_spec, plan
from cadence.plan.calibrate import calibrate_to
from cadence.plan.spec import parse_mode

# mode label -> (pipeline.mode, pipeline.placement)
MODES = {
    "sync-colocated": ("sync", "colocated"),
    "sync": ("sync", "separate"),
    "periodic": ("periodic", "separate"),
}


def offpolicy_overrides(config: str, base: list[str]) -> list[str] | None:
    """Overrides for offpolicy N=1 if the config accepts that mode, else None."""
    stale = [k for k in PipelineConfig.model_fields if "stale" in k or "lag" in k]
    extra = [f"pipeline.{stale[0]}=1"] if stale else []
    try:
        load_config(
            config, [*base, "pipeline.mode='offpolicy'", "pipeline.placement='separate'", *extra]
        )
    except ConfigError as e:
        print(f"offpolicy not run: the config does not accept it ({e})")
        return None
    if not stale:
        print("offpolicy: no staleness key found in [pipeline]; assuming its default is N = 1")
    else:
        print(f"offpolicy: setting pipeline.{stale[0]} = 1")
    return ["pipeline.mode='offpolicy'", "pipeline.placement='separate'", *extra]


def run_real(config: str, overrides: list[str], out: Path) -> dict[str, float]:
    """One real run; per-iteration means over the iterations after the first."""
    from cadence.builder import build_run, train

    if out.exists():
        shutil.rmtree(out)  # metrics.jsonl is appended to: start clean
    cfg = load_config(config, [*overrides, "metrics.progress=false", "train.eval_every=0"])
    train(build_run(cfg), out, evaluate=False)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = records[1:] or records

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in steady)

    return {
        "wall_s": mean("wall_s"),
        "gen_busy_s": mean("gen_busy_s"),
        "train_busy_s": mean("train_busy_s"),
        "response_tokens_mean": mean("response_tokens_mean"),
        "num_tokens": mean("num_tokens"),
    }


def predict(config: str, base: list[str], model: str, labels: list[str], out: Path) -> dict:
    cfg = load_config(config, base)
    spec_base = calibrate_to(cfg, model, out / "calibration", log=print)
    split = cfg.pipeline.num_workers * cfg.pipeline.threads_per_worker
    spec = load_spec(
        None,
        [f"plan.modes={labels!r}", f"plan.splits=[{split}]", "plan.iterations=8"],
        base=spec_base,
    )
    result = plan(spec)
    (cluster,) = result.clusters
    return {label: cluster.best[label] for label in labels}


def table(rows: list[dict]) -> str:
    lines = [
        "| mode | predicted s/iter | measured s/iter | measured / predicted "
        "| gen busy s (pred / meas) | train busy s (pred / meas) | response tokens (pred / meas) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p, m = r["predicted"], r["measured"]
        lines.append(
            f"| {r['mode']} | {p['wall_s']:.2f} | {m['wall_s']:.2f} "
            f"| {m['wall_s'] / p['wall_s']:.2f} "
            f"| {p['gen_busy_s']:.2f} / {m['gen_busy_s']:.2f} "
            f"| {p['train_busy_s']:.2f} / {m['train_busy_s']:.2f} "
            f"| {p['response_tokens_mean']:.1f} / {m['response_tokens_mean']:.1f} |"
        )
    return "\n".join(lines)


def modes_to_run(config: str, base: list[str], names: list[str] | None) -> dict[str, list[str]]:
    """Mode label -> its config overrides. Default: MODES, and offpolicy-1 where the config
    accepts it; named modes are parsed as the planner parses them."""
    if names is not None:
        return {name: mode_overrides(name) for name in names}
    modes = {
        label: [f"pipeline.mode='{m}'", f"pipeline.placement='{p}'"]
        for label, (m, p) in MODES.items()
    }
    extra = offpolicy_overrides(config, base)
    if extra is not None:
        modes["offpolicy-1"] = extra
    return modes


def mode_overrides(name: str) -> list[str]:
    """The run config of one of the planner's modes: 'partial-2' -> offpolicy, max_staleness 2,
    partial rollouts keeping the KV cache."""
    mode, placement, staleness, partial = parse_mode(name)
    overrides = [f"pipeline.mode='{mode}'", f"pipeline.placement='{placement}'"]
    if mode == "offpolicy":
        overrides.append(f"pipeline.max_staleness={staleness}")
    if partial:
        overrides += ["pipeline.partial_rollout=true", f"pipeline.partial_rollout_kv='{partial}'"]
    return overrides


def row(label: str, predicted, samples: list[dict]) -> dict:
    return {
        "mode": label,
        "predicted": {
            "wall_s": predicted.wall_s,
            "gen_busy_s": predicted.gen_busy_s,
            "train_busy_s": predicted.train_busy_s,
            "num_tokens": predicted.tokens_per_iteration,
            "response_tokens_mean": predicted.response_tokens_mean,
        },
        "measured": {k: statistics.median(s[k] for s in samples) for k in samples[0]},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/default.toml")
    ap.add_argument("--model", default=None, help="model directory (default: the config's)")
    ap.add_argument("--iterations", type=int, default=6, help="real iterations per mode")
    ap.add_argument("--repeats", type=int, default=1, help="real runs per mode (median)")
    ap.add_argument("--out", default="runs/plan-vs-measured")
    ap.add_argument("--modes", default=None, help="comma-separated planner mode names")
    args = ap.parse_args()
    out = Path(args.out)
    model = args.model or load_config(args.config).model.path
    base = [f"train.iterations={args.iterations}", f"model.path='{model}'"]
    names = args.modes.split(",") if args.modes else None
    modes = modes_to_run(args.config, base, names)
    predicted = predict(args.config, base, model, list(modes), out)
    samples: dict[str, list[dict]] = {label: [] for label in modes}
    for rep in range(args.repeats):  # interleaved: drift hits every mode alike
        for label, overrides in modes.items():
            print(f"repeat {rep + 1}/{args.repeats}: running {label} ...", flush=True)
            samples[label].append(run_real(args.config, [*base, *overrides], out / label))
    rows = [row(label, predicted[label], samples[label]) for label in modes]
    (out / "plan_vs_measured.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "plan_vs_measured.md").write_text(table(rows) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
