"""Seconds per optimizer step of each tool `--suite race` runs, at each torch thread count: which
count the race should give each tool on this machine (`train.threads` for cadence,
`--trl-threads` for TRL).

Each cell is the race's own training loop (`race_cadence`, `race_trl`) on the race's workload,
stopped after `--steps` optimizer steps, in a process of its own forked from the fork server, as
the race runs it. The cells alternate (cadence, TRL, then the next thread count), and the whole
sequence runs `--repeats` times, so a drift of the machine's speed falls on every cell alike; a
cell's figure is the median of its repeats, its training seconds over its steps (snapshot saving
left out, as in the race). Writes JSON after every cell. Nothing else should run meanwhile.

    .venv/bin/python benchmarks/race_threads.py --config configs/smollm2.toml --steps 3 \
        --threads 1,2 --out runs/race-threads
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main(argv: list[str] | None = None) -> int:
    from cadence.bench.common import machine, run_apart
    from cadence.bench.race import race_cadence, race_config, race_trl

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/smollm2.toml")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per cell")
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--set", action="append", default=[], help="a config override (repeatable)")
    p.add_argument("--out", default="runs/race-threads")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    threads = [int(t) for t in a.threads.split(",")]
    cells: dict[str, list[float]] = {}
    report = {"config": a.config, "steps": a.steps, "overrides": a.set, "machine": machine()}
    for repeat in range(a.repeats):
        for n in threads:
            for tool, loop in (("cadence", race_cadence), ("trl", race_trl)):
                cfg = race_config(a.config, [*a.set, f"train.threads={n}"], 600, a.steps)
                start = time.perf_counter()
                # snapshots every steps + 1: only the final one is saved
                snapshots = run_apart(loop, cfg, out / f"{tool}-t{n}-r{repeat}", a.steps + 1)
                last = snapshots[-1]
                per_step = last.seconds / last.step
                cells.setdefault(f"{tool} {n}", []).append(per_step)
                wall = time.perf_counter() - start
                print(
                    f"{tool}, {n} threads: {per_step:.1f} s a step ({last.step} steps, "
                    f"{wall:.0f} s with start-up)",
                    flush=True,
                )
                report["s_per_step"] = {k: statistics.median(v) for k, v in cells.items()}
                report["repeats"] = cells
                (out / "race_threads.json").write_text(json.dumps(report, indent=2) + "\n")
    named = [f"{n} thread{'s' if n > 1 else ''}" for n in threads]
    rows = ["| s a step | " + " | ".join(named) + " | fastest |"]
    rows.append("|---" * (len(threads) + 2) + "|")
    for tool in ("cadence", "trl"):
        s = {n: report["s_per_step"][f"{tool} {n}"] for n in threads}
        best = min(s, key=s.get)
        rows.append(f"| {tool} | " + " | ".join(f"{v:.1f} s" for v in s.values()) + f" | {best} |")
    (out / "race_threads.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
