"""Learning gates: what every end-to-end run of the suite must show in its metrics.jsonl, checked
after each test on the runs it wrote (conftest.py's `learning_gates`), as slime, prime-rl and
NeMo-RL assert theirs in CI.

On-policy (`sync`, `periodic`), every iteration:
- every group was generated at the version the learner published (`staleness_max` 0, none
  dropped): the workers loaded what the learner wrote;
- before the first optimizer step pi / pi_old is 1 on every fresh token where pi_old comes from a
  pass of its own (`first_step_ratio_abs_dev_max` <= 1e-6 in float32; not reported where pi_old
  is the policy's own log-probs detached, where it is 1 by construction; pi_old is the behaviour
  policy under the bypass and for pair losses, and there the engine bound below applies instead);
- the engine's log-probs are the learner's (`behaviour_logprob_abs_diff_max` under the bound of
  the engine and the environment kind, `BEHAVIOUR_BOUNDS`; in bfloat16 the mean,
  `behaviour_logprob_abs_diff_mean`, under `BF16_MEAN_BOUND`: the run itself stops past
  pipeline.behaviour_gap_max, 2e-2).

Each bound is the largest value recorded over the suite's runs (CADENCE_GATES_RECORD=FILE writes
every value checked, one JSON line per run and iteration) with room to spare, written beside it.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

# Recorded over one whole `make test` (2026-11-28, 273 iterations of on- and off-policy runs;
# float32 unless said), the largest value of each figure:
#   first_step_ratio_abs_dev_max, pi_old read from the policy: 0 (every mode, engine, kind)
#   behaviour_logprob_abs_diff_max:
#     continuous  single_turn 9.5e-7, tool 3.8e-6, class 9.5e-7, openenv 9.5e-7, verifiers 1.9e-6
#     vllm (CPU)  single_turn 9.5e-7, tool 4.8e-7
#     bfloat16 (colocated, the engine decodes the learner's model): 0
#   bfloat16 behaviour_logprob_abs_diff_mean (2026-12-02, the default task, 6 iterations, sync
#   colocated and periodic with a worker): 1.9e-4 to 3.5e-4 (max 0.03 to 0.06)
RATIO_BOUND = 1e-6
BF16_MEAN_BOUND = 2e-3
# engine -> the largest |engine log-prob - learner log-prob| allowed in float32, every env kind:
# about 5x the largest recorded (static: no end-to-end run records it; its unit test bounds it)
BEHAVIOUR_BOUNDS = {"continuous": 2e-5, "static": 2e-5, "vllm": 5e-6}
PAIR_LOSSES = ("online_dpo",)  # read no pi_old: their first-step ratio is not the gate's


def _setting(cfg: dict, section: str, key: str, default):
    return cfg.get(section, {}).get(key, default)


def run_dirs(root: Path) -> list[Path]:
    """Directories under `root` holding a run's metrics.jsonl and config.toml."""
    return [p.parent for p in root.rglob("metrics.jsonl") if (p.parent / "config.toml").is_file()]


def check_run(out: Path, test: str = "") -> list[str]:
    """What the run in `out` broke of the gates (empty: none); recorded when asked."""
    cfg = tomllib.loads((out / "config.toml").read_text())
    mode = _setting(cfg, "pipeline", "mode", "sync")
    engine = _setting(cfg, "rollout", "engine", "continuous")
    kind = _setting(cfg, "env", "kind", "single_turn")
    dtype = _setting(cfg, "model", "dtype", "float32")
    bypass = _setting(cfg, "algo", "correction_proximal", "decoupled") == "bypass"
    pair = _setting(cfg, "algo", "loss", "") in PAIR_LOSSES
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    broken = []
    for r in records:
        if "iteration" not in r or "policy_version" not in r:
            continue
        _record(test, out, mode, engine, kind, dtype, bypass, pair, r)
        if mode not in ("sync", "periodic"):
            continue
        if dtype == "bfloat16":
            mean = r.get("behaviour_logprob_abs_diff_mean")
            if mean is not None and mean > BF16_MEAN_BOUND:
                where = f"{out} iteration {r['iteration']} ({mode}, {engine}, bfloat16)"
                broken.append(f"{where}: behaviour_logprob_abs_diff_mean = {mean:.3g}")
            continue
        if dtype != "float32":
            continue
        where = f"{out} iteration {r['iteration']} ({mode}, {engine}, {kind})"
        if r.get("staleness_max", 0) != 0 or r.get("dropped_groups", 0) != 0:
            broken.append(f"{where}: a group not of the published version")
        ratio = r.get("first_step_ratio_abs_dev_max")
        if ratio is not None and not (bypass or pair) and ratio > RATIO_BOUND:
            broken.append(f"{where}: |ratio - 1| = {ratio:.3g} > {RATIO_BOUND:g} at the first step")
        diff, bound = r.get("behaviour_logprob_abs_diff_max"), BEHAVIOUR_BOUNDS.get(engine)
        if diff is not None and bound is not None and diff > bound:
            broken.append(f"{where}: behaviour_logprob_abs_diff_max = {diff:.3g} > {bound:g}")
    return broken


def _record(test, out, mode, engine, kind, dtype, bypass, pair, r) -> None:
    path = os.environ.get("CADENCE_GATES_RECORD")
    if not path:
        return
    keys = ("first_step_ratio_abs_dev_max", "behaviour_logprob_abs_diff_max", "staleness_max")
    line = {
        "test": test,
        "mode": mode,
        "engine": engine,
        "kind": kind,
        "dtype": dtype,
        "bypass": bypass,
        "pair": pair,
        "iteration": r["iteration"],
        **{k: r.get(k) for k in keys},
    }
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
