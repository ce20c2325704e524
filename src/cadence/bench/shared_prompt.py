"""`cadence bench --suite shared-prompt`: one training iteration with each micro-batch layout.

Times `Learner.train_iteration` on the same fixed groups with sharing off (`unpacked`: every
response repeats its prompt) and on (`dense` 4-D mask, `prefix` prompt keys and values reused),
interleaved across repeats, after one untimed warm-up iteration each; the median is reported. The
learner is built from the workload config (loss, reference pass, micro-batch size), so the
reference forward is timed too. Two workloads:
- `default`: one iteration of the config's own workload (its prompts, sampled by its model);
- `long-prompt`: P=256 prompt tokens, R=64 response tokens, G=8, random token ids, where sharing
  computes G(P+R)/(P+GR) = 3.33x fewer tokens.
Writes `bench.json` and `bench.md` in `--out`.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from cadence.metrics.tables import markdown_table as table
from cadence.types import Completion, Group, Prompt

# variant -> (learner.shared_prompt, learner.shared_prompt_impl)
VARIANTS: dict[str, tuple[bool, str]] = {
    "off": (False, "prefix"),
    "dense": (True, "dense"),
    "prefix": (True, "prefix"),
}
LONG_PROMPT = dict(num_groups=8, prompt_len=256, response_len=64, group_size=8)


def default_groups(cfg, model, tokenizer) -> list[Group]:
    """One iteration's groups of the config's workload, sampled by its model."""
    from cadence.builder import (
        make_task,
        open_rollout_engine,
        prompt_render,
        rollout_worker,
    )
    from cadence.pipeline.prompts import PromptStream

    engine, _ = open_rollout_engine(cfg, tokenizer, model=model, kind="static")
    worker = rollout_worker(cfg, engine, tokenizer)
    prompts = PromptStream(make_task(cfg), prompt_render(cfg, tokenizer), cfg.data.task).next_batch(
        cfg.train.prompts_per_iteration
    )
    return worker.rollout(prompts, iteration=0, version=0)


def synthetic_groups(
    vocab: int, num_groups: int, prompt_len: int, response_len: int, group_size: int, seed: int = 0
) -> list[Group]:
    """Fixed-length groups of random tokens, rewards alternating 0/1 (non-zero advantages)."""
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    groups = []
    for i in range(num_groups):
        completions = [
            Completion(ids(response_len), [-1.0] * response_len, reward=float(j % 2))
            for j in range(group_size)
        ]
        groups.append(
            Group(Prompt(f"synthetic:{i}", "", "", i), ids(prompt_len), completions, 0, 0)
        )
    return groups


def _learner(cfg, model, pad_id: int, variant: str):
    """The run's learner on a copy of `model`, with the variant's layout."""
    from cadence.builder import build_learner, learner_params

    shared, impl = VARIANTS[variant]
    params = replace(learner_params(cfg), shared_prompt=shared, shared_prompt_impl=impl)
    return build_learner(cfg, copy.deepcopy(model), pad_id, params=params)


def _time_workload(cfg, model, pad_id: int, groups: list[Group], repeats: int) -> dict[str, dict]:
    from cadence.builder import build_scorer

    learners = {v: _learner(cfg, model, pad_id, v) for v in VARIANTS}
    scorer = build_scorer(cfg)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    stats: dict[str, dict] = {}
    for rep in range(repeats + 1):  # repeat 0 warms up and is not timed
        for variant, learner in learners.items():
            # the same groups each repeat, tagged with the learner's version so they count as
            # fresh: stale groups would take the behaviour log-probs and skip the old-policy pass
            fresh = [replace(g, policy_version=learner.version) for g in groups]
            start = time.perf_counter()
            stats[variant] = learner.train_iteration(scorer.score(fresh), len(fresh))
            if rep:
                times[variant].append(time.perf_counter() - start)
            scorer.end_iteration()
    return {
        v: {"time_s": statistics.median(times[v]), "time_all": times[v]} | stats[v]
        for v in VARIANTS
    }


def bench_shared_prompt(config: str | None, overrides: list[str], repeats: int, out: Path):
    from cadence.builder import set_threads
    from cadence.config import load_config
    from cadence.models import DTYPES, load_model, load_tokenizer

    cfg = load_config(config, overrides)
    set_threads(cfg.train.threads)
    tokenizer = load_tokenizer(cfg.model.path)
    model = load_model(cfg.model.path, dtype=DTYPES[cfg.model.dtype], device=cfg.model.device)
    vocab = model.get_input_embeddings().num_embeddings
    workloads = {
        "default": default_groups(cfg, model, tokenizer),
        "long-prompt": synthetic_groups(vocab, **LONG_PROMPT),
    }
    rows = []
    for name, groups in workloads.items():
        results = _time_workload(cfg, model, tokenizer.pad_token_id, groups, repeats)
        off = results["off"]
        for variant, r in results.items():
            rows.append(
                {
                    "workload": name,
                    "layout": variant,
                    "repeats": repeats,
                    "num_groups": len(groups),
                    "group_size": cfg.rollout.group_size if name == "default" else 8,
                    "prompt_tokens_mean": sum(len(g.prompt_ids) for g in groups) / len(groups),
                    "response_tokens_mean": sum(
                        len(c.token_ids) for g in groups for c in g.completions
                    )
                    / sum(g.group_size for g in groups),
                    "num_tokens": r["num_tokens"],
                    "tokens_computed": r["tokens_computed"],
                    "tokens_ratio": off["tokens_computed"] / r["tokens_computed"],
                    "time_s": r["time_s"],
                    "time_all": r["time_all"],
                    "speedup": off["time_s"] / r["time_s"],
                    "forward_passes_per_microbatch": r["forward_passes_per_microbatch"],
                }
            )
            print(
                f"{name} {variant}: {r['tokens_computed']:,.0f} tokens computed, "
                f"{r['time_s']:.3f}s per iteration",
                flush=True,
            )
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "bench.md").write_text(markdown_table(rows) + "\n")
    return rows


def markdown_table(rows: list[dict]) -> str:
    header = [
        *("workload", "layout", "prompt / response tokens (mean)", "tokens computed"),
        *("x fewer tokens", "iteration s", "speedup vs off"),
    ]
    cells = [
        [
            *(r["workload"], r["layout"]),
            f"{r['prompt_tokens_mean']:.0f} / {r['response_tokens_mean']:.1f}",
            *(f"{r['tokens_computed']:,.0f}", f"{r['tokens_ratio']:.2f}", f"{r['time_s']:.3f}"),
            f"{r['speedup']:.2f}",
        ]
        for r in rows
    ]
    return table(header, cells)
