"""What the reward deadline costs per call: the math reward called directly, and through
`TimedReward` from the main thread (a SIGALRM timer around the call) and from another thread
(each call handed to a helper thread and waited for), on the same completions.

The completions are the default task's reference solutions with the final number kept or moved
by one, in `--distinct` different texts; each is scored `--calls` times in total, so math-verify's
parse cache is warm after the first pass, as in a run where answers repeat. The two ways are
interleaved, `--repeats` times, and the median per-call time of each is reported with their ratio.

    .venv/bin/python benchmarks/reward_timeout.py [--calls 4000] [--distinct 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from cadence.data import ArithmeticTask
from cadence.rewards import MathReward, TimedReward


def completions(n: int) -> list[tuple[str, str, str]]:
    """(prompt, completion, answer) triples: half correct, half with the final number off by 1."""
    task = ArithmeticTask(difficulty=1, seed=0)
    out = []
    for i, example in zip(range(n), task.train_iter(), strict=False):
        head, _, final = example.answer.rpartition("####")
        wrong = str(int(final.strip()) + 1)
        text = example.answer if i % 2 else f"{head}#### {wrong}"
        out.append((example.question, text, example.answer))
    return out


def per_call_us(fn, triples: list, calls: int) -> float:
    t0 = time.perf_counter()
    for i in range(calls):
        fn(*triples[i % len(triples)])
    return (time.perf_counter() - t0) / calls * 1e6


def in_thread(fn, *args) -> float:
    out: list[float] = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    t.join()
    return out[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=4000)
    ap.add_argument("--distinct", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    triples = completions(args.distinct)
    direct, timed = MathReward(), TimedReward(MathReward(), 10.0, "math")
    ways = {
        "direct, main thread": lambda: per_call_us(direct, triples, args.calls),
        "TimedReward, main thread (alarm)": lambda: per_call_us(timed, triples, args.calls),
        "direct, other thread": lambda: in_thread(per_call_us, direct, triples, args.calls),
        "TimedReward, other thread (helper)": lambda: in_thread(
            per_call_us, timed, triples, args.calls
        ),
    }
    per_call_us(direct, triples, len(triples))  # warm math-verify's parse cache
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, way in ways.items():
            times[name].append(way())
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, us in medians.items():
        print(f"{name:36s} {us:8.1f} us/call (median of {args.repeats})")
    for thread in ("main thread", "other thread"):
        a = medians[f"direct, {thread}"]
        b = next(v for k, v in medians.items() if k.startswith(f"TimedReward, {thread}"))
        print(f"{thread}: timed / direct = {b / a:.2f} (+{b - a:.1f} us per call)")


if __name__ == "__main__":
    main()
