"""What a reward computed beside an in-process engine costs the engine, and what reward processes
(`reward.stage = "separate"`, the default with vLLM) give back: a synthetic GPU on CPU.

The engine stands in for in-process vLLM on a GPU: each step holds the GIL for `--host-ms` of
Python (scheduling, input preparation), then waits `--kernel-ms` with the GIL released (the
kernels running on the GPU); each sample takes 8-`--max-steps` steps, so groups finish one after
another. The reward stands in for math-verify on long answers: `--reward-ms` of pure Python a
call (GIL held). A rollout of `--prompts` x `--group-size` samples is scored each way:
- `inline`: the worker scores each group between two engine steps (reward.stage = 'worker',
  concurrency 1: what a colocated vLLM run did);
- `threads`: the worker's reward runner with `--threads` calls in flight, in this process;
- `processes N`: reward processes beside the worker (N of them).
Reported: the wall time of the rollout (scores in), the time to the engine's last step (the
GPU's share: beside `not scored`, the rollout with no reward), and the longest gap between two
engine steps. The ways are interleaved, `--repeats`
times; medians.

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/reward_gil.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import sys
import time
from collections.abc import Hashable
from pathlib import Path

from cadence.backend import RewardProcesses
from cadence.engine import Request, SamplingParams
from cadence.rewards import RewardRunner, RewardSpec
from cadence.rollout import RolloutWorker
from cadence.types import Completion, Prompt

REWARD_MS = float(os.environ.get("CADENCE_BENCH_REWARD_MS", "5"))


def burn(prompt: str, completion: str, answer: str) -> float:
    """`REWARD_MS` of pure Python, the GIL held throughout; 1 for an even-length completion."""
    end = time.perf_counter() + REWARD_MS / 1000
    while time.perf_counter() < end:
        pass
    return float(len(completion) % 2 == 0)


burn.concurrency = 1  # type: ignore[attr-defined]  # computes, as math-verify does


class GpuLikeEngine:
    """A streaming engine whose steps hold the GIL for `host_s`, then release it for
    `kernel_s`; each sample ends after a seeded 8..`max_steps` steps."""

    owns_weights = False

    def __init__(self, host_s: float, kernel_s: float, max_steps: int) -> None:
        self.host_s, self.kernel_s, self.max_steps = host_s, kernel_s, max_steps
        self.occupancy: list[tuple[float, int]] = []
        self.steps, self.step_times = 0, []
        self._left: dict[Hashable, list[int]] = {}

    @property
    def busy(self) -> bool:
        return bool(self._left)

    def add(self, key: Hashable, request: Request, params: SamplingParams) -> None:
        self._left[key] = [random.Random(s).randint(8, self.max_steps) for s in request.seeds]

    def step(self) -> list[tuple[Hashable, list[Completion]]]:
        end = time.perf_counter() + self.host_s
        while time.perf_counter() < end:
            pass
        time.sleep(self.kernel_s)
        self.steps += 1
        self.step_times.append(time.perf_counter())
        done = []
        for key, left in list(self._left.items()):
            left[:] = [n - 1 for n in left]
            if max(left) <= 0:
                del self._left[key]
                n = self.steps
                samples = [Completion([1] * n, [-1.0] * n, "x" * n, "length") for _ in left]
                done.append((key, samples))
        return done


def rollout(reward, args: argparse.Namespace) -> dict[str, float]:
    engine = GpuLikeEngine(args.host_ms / 1000, args.kernel_ms / 1000, args.max_steps)
    worker = RolloutWorker(
        engine,
        tokenizer=lambda text, add_special_tokens=False: {"input_ids": [len(text)]},
        reward=reward,
        sampling=SamplingParams(max_new_tokens=args.max_steps),
        group_size=args.group_size,
        run_seed=0,
    )
    prompts = [Prompt(f"u{i}", f"question {i}", "1", i) for i in range(args.prompts)]
    t0 = time.perf_counter()
    worker.rollout(prompts, iteration=0, version=0)
    wall = time.perf_counter() - t0
    times = [t0, *engine.step_times]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return {
        "wall_s": wall,
        "decode_s": times[-1] - t0,
        "max_gap_ms": max(gaps) * 1000,
    }


def main() -> None:
    global REWARD_MS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--host-ms", type=float, default=1.0)
    p.add_argument("--kernel-ms", type=float, default=10.0)
    p.add_argument("--max-steps", type=int, default=64)
    p.add_argument("--reward-ms", type=float, default=REWARD_MS)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--processes", default="1,2")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    os.environ["CADENCE_BENCH_REWARD_MS"] = str(args.reward_ms)  # reward processes read it
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, here)
    REWARD_MS = args.reward_ms
    spec = RewardSpec("rule", "reward_gil:burn")
    procs = {n: RewardProcesses(spec, n) for n in map(int, args.processes.split(","))}
    ways = {
        "not scored": lambda: None,
        "inline": lambda: RewardRunner(burn, concurrency=1),
        f"threads {args.threads}": lambda: RewardRunner(burn, concurrency=args.threads),
        **{f"processes {n}": (lambda pr=pr: pr) for n, pr in procs.items()},
    }
    results: dict[str, list[dict[str, float]]] = {name: [] for name in ways}
    try:
        for _ in range(args.repeats):
            for name, make in ways.items():
                reward = make()
                results[name].append(rollout(reward, args))
    finally:
        for pr in procs.values():
            pr.close()
    n = args.prompts * args.group_size
    print(
        f"{n} samples ({args.prompts} x {args.group_size}), steps of {args.host_ms:g} ms host "
        f"+ {args.kernel_ms:g} ms kernel, 8-{args.max_steps} steps a sample, reward "
        f"{args.reward_ms:g} ms of Python a call; medians of {args.repeats}"
    )
    print("| scored | rollout s | decoding s (to the last step) | longest gap between steps |")
    print("|---|---|---|---|")
    for name, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(
            f"| {name} | {med['wall_s']:.2f} | {med['decode_s']:.2f} | {med['max_gap_ms']:.0f} ms |"
        )


if __name__ == "__main__":
    main()
