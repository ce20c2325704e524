"""The main job across its warm start: SFT seeds x RL seeds, each RL run stopped at a wall-clock
budget. For each SFT seed, `cadence sft` (cached when done) and `cadence study seeds` over the RL
seeds from that model (resumable: a second run with the same --out runs only what is missing);
then the Markdown table of docs/results.md, one row per cell: held-out before and after, gain,
iterations in the budget, held-out curve. Run it on an otherwise idle machine: the budget is
wall-clock, so anything beside it costs iterations.

    python benchmarks/warmstart_seeds.py --config configs/default.toml --sft-seeds 0,1,2 \\
        --rl-seeds 0,1 --minutes 5 --out runs/warmstart
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CADENCE = [sys.executable, "-m", "cadence.cli"]


def run_cell_grid(args: argparse.Namespace) -> None:
    for sft_seed in args.sft_seeds:
        model = args.out / f"sft-seed{sft_seed}"
        sets = ["--set", f"train.seed={sft_seed}", "--set", f"sft.out={model}"]
        subprocess.run([*CADENCE, "sft", args.config, *sets], check=True)
        study = [*CADENCE, "study", "seeds", "--config", args.config]
        study += [
            "--seeds",
            ",".join(map(str, args.rl_seeds)),
            "--out",
            str(_study(args, sft_seed)),
        ]
        study += ["--set", f"model.path={model}", "--set", f"train.max_minutes={args.minutes}"]
        subprocess.run(study, check=True)


def _study(args: argparse.Namespace, sft_seed: int) -> Path:
    return args.out / f"study-sft{sft_seed}"


def table(args: argparse.Namespace) -> str:
    lines = [
        "| SFT seed | RL seed | held-out before | after (± s.e.) | gain (points) | iterations |"
        " held-out at 50 / 100 / 150 |",
        "|---|---|---|---|---|---|---|",
    ]
    gains = []
    for sft_seed in args.sft_seeds:
        rows = json.loads((_study(args, sft_seed) / "study.json").read_text())
        for r in sorted(rows, key=lambda r: r["seed"]):
            curve = dict((int(i), a) for i, a in r["curve"])
            mid = " / ".join(f"{curve[i]:.3f}" if i in curve else "-" for i in (50, 100, 150))
            gains.append(100 * r["gain"])
            lines.append(
                f"| {sft_seed} | {r['seed']} | {r['accuracy_before']:.3f} | "
                f"{r['accuracy_after']:.3f} ± {r['accuracy_after_stderr']:.3f} | "
                f"{100 * r['gain']:+.1f} | {r['iterations']} | {mid} |"
            )
    lines.append(f"\nGain over {len(gains)} cells: {min(gains):+.1f} to {max(gains):+.1f} points.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.toml")
    parser.add_argument("--sft-seeds", type=_seeds, default=[0, 1, 2])
    parser.add_argument("--rl-seeds", type=_seeds, default=[0, 1])
    parser.add_argument("--minutes", type=float, default=5.0, help="RL budget per cell")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--table-only", action="store_true", help="the table of what is done")
    args = parser.parse_args(argv)
    if not args.table_only:
        run_cell_grid(args)
    text = table(args)
    (args.out / "warmstart.md").write_text(text)
    print(text, end="")
    return 0


def _seeds(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


if __name__ == "__main__":
    raise SystemExit(main())
