"""`cadence bench --suite ranks`: one learner process against learner ranks, side by side.

Read on: docs/benchmarks.md.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from cadence.bench.shared_prompt import synthetic_groups
from cadence.metrics.tables import markdown_table as table

# the workload: groups of one prompt and G responses, fixed lengths
WORKLOAD = dict(num_groups=4, prompt_len=16, response_len=16, group_size=4)
TIMEOUT_S = 3600.0  # an iteration of a large model on a few CPU cores takes minutes


class OneLearner:
    """The single-process learner as a run builds it, in a process of its own (a rank transport
    spawns it)."""

    def __init__(self, rank: int, cfg, pad_id: int, threads: int) -> None:
        from cadence.builder import build_learner, build_scorer
        from cadence.models import DTYPES, load_model

        torch.set_num_threads(threads)
        model = load_model(cfg.model.path, dtype=DTYPES[cfg.model.dtype], device=cfg.model.device)
        self.learner = build_learner(cfg, model, pad_id)
        self.scorer = build_scorer(cfg)

    def train(self, groups) -> dict[str, Any]:
        from cadence.learner.rank import state_bytes

        start = time.perf_counter()
        stats = _train(self.learner, self.scorer, groups)
        return {"time_s": time.perf_counter() - start, "stats": stats} | {
            "state": state_bytes(self.learner)
        }

    def close(self) -> None:
        pass


def _train(learner, scorer, groups) -> dict[str, Any]:
    """One iteration on `groups`, tagged with the learner's version so they count as fresh."""
    fresh = [replace(g, policy_version=learner.version) for g in groups]
    stats = learner.train_iteration(scorer.score(fresh), len(fresh))
    return stats | scorer.end_iteration()


def _one_process(cfg, pad_id: int, threads: int, groups, iterations: int) -> dict[str, Any]:
    from cadence.backend.ranks import BUILD, LocalRanks

    ranks = LocalRanks(
        OneLearner,
        1,
        spawn_args=lambda r: (cfg, pad_id, threads),
        timeout_s=TIMEOUT_S,
        name="learner",
    )
    try:
        ranks.call(0, BUILD)
        for _ in range(iterations):
            ranks.call(0, OneLearner.train.__name__, groups)
        replies = ranks.wait()[0][1:]
    finally:
        ranks.close()
    last = replies[-1]
    return {
        "times": [r["time_s"] for r in replies],
        "peak_rss_mb": [last["stats"]["learner_peak_rss_mb"]],
        "state": [last["state"]],
        "gather_s": 0.0,
    }


def _ranks(spec, model, groups, iterations: int) -> dict[str, Any]:
    from cadence.learner import Scorer
    from cadence.learner.driver import start_local_ranks
    from cadence.metrics import Tracer

    tracer = Tracer()
    learner = start_local_ranks(spec, model, tracer)
    scorer = Scorer(spec.algo)
    try:
        times, stats = [], {}
        for _ in range(iterations):
            start = time.perf_counter()
            stats = _train(learner, scorer, groups)
            times.append(time.perf_counter() - start)
        state = learner.ranks.describe()
    finally:
        learner.close()
    gathers = [s.duration for s in tracer.spans if s.name == "gather_weights"]
    return {
        "times": times,
        "peak_rss_mb": stats["learner_rank_peak_rss_mb"],
        "state": state,
        "gather_s": statistics.median(gathers[1:] or gathers),
    }


def bench_ranks(
    config: str | None, overrides: list[str], repeats: int, out: Path, iterations: int = 3
) -> list[dict]:
    """The cells above for the config's model and learner settings: N = `learner.ranks` (2
    when the config has 1) ranks against one process, T = `train.threads` (0: `all_threads`)."""
    from cadence.builder import all_threads, rank_spec
    from cadence.config import load_config
    from cadence.models import load_model, load_tokenizer

    cfg = load_config(config, overrides)
    ranks = cfg.learner.ranks if cfg.learner.ranks > 1 else 2
    threads = cfg.train.threads or all_threads()
    tokenizer = load_tokenizer(cfg.model.path)
    model = load_model(cfg.model.path)  # the driver's copy, for the ranks' gathered weights
    vocab = model.get_input_embeddings().num_embeddings
    groups = synthetic_groups(vocab, **WORKLOAD)
    base = replace(rank_spec(cfg, tokenizer.pad_token_id), timeout_s=TIMEOUT_S)
    cells = {f"1 x {threads} threads": None}
    for strategy in ("fsdp", "ddp"):
        cells[f"{ranks} x {threads // ranks} thread(s) {strategy}"] = replace(
            base, world_size=ranks, strategy=strategy, threads=max(1, threads // ranks)
        )
    samples: dict[str, list[dict]] = {name: [] for name in cells}
    for rep in range(repeats):
        for name, spec in cells.items():
            if spec is None:
                result = _one_process(cfg, tokenizer.pad_token_id, threads, groups, iterations)
            else:
                result = _ranks(spec, model, groups, iterations)
            samples[name].append(result)
            print(f"repeat {rep + 1}/{repeats} {name}: {result['times']}", flush=True)
    rows = [_row(name, runs, groups) for name, runs in samples.items()]
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "bench.md").write_text(markdown_table(rows) + "\n")
    return rows


def _row(name: str, runs: list[dict], groups) -> dict:
    per_iteration = [statistics.median(r["times"][1:] or r["times"]) for r in runs]
    state = runs[-1]["state"]
    mb = 2**20
    return {
        "cell": name,
        "iteration_s": statistics.median(per_iteration),
        "iteration_s_all": per_iteration,
        "gather_s": statistics.median(r["gather_s"] for r in runs),
        "num_tokens": sum(g.num_tokens for g in groups),
        "peak_rss_mb_per_process": [
            statistics.median(p) for p in zip(*(r["peak_rss_mb"] for r in runs), strict=True)
        ],
        "param_mb": [s["param_bytes"] / mb for s in state],
        "optimizer_mb": [s["optimizer_bytes"] / mb for s in state],
        "frozen_mb": [s["frozen_bytes"] / mb for s in state],
        "repeats": len(runs),
    }


def markdown_table(rows: list[dict]) -> str:
    one = rows[0]["iteration_s"]
    header = [
        *("cell", "iteration s", "x the single process", "of which gathering weights s"),
        *("peak RSS MB per process", "parameters + Adam + frozen MB per process"),
    ]
    cells = []
    for r in rows:
        state = [
            f"{p:,.0f} + {o:,.0f} + {f:,.0f}"
            for p, o, f in zip(r["param_mb"], r["optimizer_mb"], r["frozen_mb"], strict=True)
        ]
        rss = ", ".join(f"{m:,.0f}" for m in r["peak_rss_mb_per_process"])
        speed = f"{one / r['iteration_s']:.2f}"
        cells.append([r["cell"], f"{r['iteration_s']:.2f}", speed, f"{r['gather_s']:.2f}"])
        cells[-1] += [rss, "; ".join(state)]
    return table(header, cells)
