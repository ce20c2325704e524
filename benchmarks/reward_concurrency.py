"""What `reward.concurrency` buys: a slow reward scored in a rollout, and what it costs a CPU-bound
math-verify reward.

`sleep`: a reward that waits `--reward-s` per call (a sandbox, a judge, an HTTP verifier), scored
in a rollout worker's `rollout` of `--prompts` x `--group-size` samples from a scripted engine
(generation takes no time, so the wall time is the scoring's), at each of `--concurrency`.
Concurrency 1 is one call after another, as every colocated run and held-out evaluation scored
before the runner.

`math`: the math reward on `--calls` completions of the default task (half right, half off by
one), scored the way a colocated learner scored them before the runner (one call after another
in the main thread, each under `TimedReward`'s SIGALRM deadline), then by the runner at each of
`--concurrency` with the same deadline; math-verify's parse cache cleared before each pass
(`cold`, every answer parsed once) or kept (`warm`, answers repeat). The ways are interleaved,
`--repeats` times; the median per-call wall time and CPU time (the process's, every thread's)
of each are reported: on a machine shared with other jobs the CPU time is the steadier figure.

    .venv/bin/python benchmarks/reward_concurrency.py sleep [--concurrency 1,8,32]
    .venv/bin/python benchmarks/reward_concurrency.py math [--calls 256] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from cadence.data import ArithmeticTask
from cadence.engine import SamplingParams, ScriptedEngine
from cadence.rewards import MathReward, RewardCall, RewardRunner, TimedReward, safe_reward
from cadence.rewards import math as math_module
from cadence.rollout import RolloutWorker
from cadence.types import Prompt


def sleep_suite(args: argparse.Namespace) -> None:
    def sleeps(prompt: str, completion: str, answer: str) -> float:
        time.sleep(args.reward_s)
        return 1.0

    prompts = [Prompt(f"u{i}", f"question {i}", "1", i) for i in range(args.prompts)]
    n = args.prompts * args.group_size
    print(f"{n} calls of a {args.reward_s:g}-s reward ({args.prompts} prompts x {args.group_size})")
    for c in args.concurrency:
        worker = RolloutWorker(
            ScriptedEngine(lambda ids, seed: [1, 2]),
            tokenizer=lambda text, add_special_tokens=False: {"input_ids": [len(text)]},
            reward=RewardRunner(sleeps, concurrency=c, timeout_s=args.reward_s + 10),
            sampling=SamplingParams(max_new_tokens=4),
            group_size=args.group_size,
            run_seed=0,
        )
        t0 = time.perf_counter()
        groups = worker.rollout(prompts, iteration=0, version=0)
        elapsed = time.perf_counter() - t0
        assert sum(c.reward for g in groups for c in g.completions) == n
        serial = n * args.reward_s
        print(f"concurrency {c:3d}: {elapsed:7.2f} s  (one call after another: {serial:g} s)")


def completions(n: int) -> list[RewardCall]:
    """Calls of the default task's reference solutions: half right, half off by one."""
    task = ArithmeticTask(difficulty=1, seed=0)
    out = []
    for i, example in zip(range(n), task.train_iter(), strict=False):
        head, _, final = example.answer.rpartition("####")
        text = example.answer if i % 2 else f"{head}#### {int(final.strip()) + 1}"
        out.append(RewardCall(example.question, text, example.answer))
    return out


def math_suite(args: argparse.Namespace) -> None:
    calls = completions(args.calls)
    timed = TimedReward(MathReward(), args.timeout_s, "math")

    def before(calls: list[RewardCall]) -> list[float]:
        return [safe_reward(timed, c.prompt, c.completion, c.answer).value for c in calls]

    ways: dict[str, Callable[[list[RewardCall]], list[float]]] = {"before (serial, alarm)": before}
    for c in args.concurrency:
        runner = RewardRunner(MathReward(), concurrency=c, timeout_s=args.timeout_s, name="math")
        ways[f"runner, concurrency {c}"] = lambda calls, r=runner: [x.value for x in r.score(calls)]
    expected = before(calls)
    for cache in ("cold", "warm"):
        wall: dict[str, list[float]] = {name: [] for name in ways}
        cpu: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.repeats):
            for name, way in ways.items():
                if cache == "cold":
                    math_module._parse_cached.cache_clear()
                t0, c0 = time.perf_counter(), time.process_time()
                values = way(calls)
                wall[name].append((time.perf_counter() - t0) / len(calls) * 1e6)
                cpu[name].append((time.process_time() - c0) / len(calls) * 1e6)
                assert values == expected, name
        base = statistics.median(wall["before (serial, alarm)"])
        base_cpu = statistics.median(cpu["before (serial, alarm)"])
        for name in ways:
            w, c = statistics.median(wall[name]), statistics.median(cpu[name])
            print(
                f"{cache} {name:26s} wall {w:7.1f} us/call x{w / base:.2f}   "
                f"cpu {c:7.1f} us/call x{c / base_cpu:.2f}   (medians of {args.repeats})"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("suite", choices=["sleep", "math"])
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated")
    ap.add_argument("--reward-s", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--calls", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--timeout-s", type=float, default=10.0)
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    (sleep_suite if args.suite == "sleep" else math_suite)(args)


if __name__ == "__main__":
    main()
