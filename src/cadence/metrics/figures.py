"""The figures every run reports, computed from what was trained, the spans and a source's stats.

Per iteration: the samples' figures (reward, accuracy, staleness, lengths), the pipeline's
(busy and idle time of generation and training, their overlap, efficiency, queue depth) and each
stage's (busy, idle, rows per second, rows waiting). Per run: the summary. Everything here is a
plain function of records; nothing runs the pipeline or reads the config.
"""

from __future__ import annotations

import math
from typing import Any

from cadence.metrics.trace import Tracer, overlap_length
from cadence.types import Completion, Group, SourceStats

TRAIN_SPANS = ("forward_backward", "optimizer_step")

# stage -> (track prefix of its workers' spans, span names that are its work)
STAGE_SPANS = {
    "gen": ("worker", ("generate",)),
    "reward": ("reward", ("score",)),
    "teacher": ("teacher", ("teach",)),
    "train": ("learner", TRAIN_SPANS),
}


def tpspd(num_tokens: float, wall_s: float, num_devices: int = 1) -> float:
    """Tokens per second per device: trained prompt + response tokens / (wall x devices)."""
    return num_tokens / max(wall_s, 1e-9) / max(num_devices, 1)


def binomial_stderr(accuracy: float, n: int) -> float:
    """Standard error of an accuracy measured on `n` independent problems: sqrt(p(1-p)/n)."""
    if n <= 0 or math.isnan(accuracy):
        return math.nan
    return math.sqrt(accuracy * (1.0 - accuracy) / n)


def sample_figures(groups: list[Group], version: int, max_staleness: int) -> dict[str, Any]:
    """Reward, accuracy (reward >= 1), reward errors, response length and staleness of the
    groups trained at learner `version`."""
    staleness = [version - g.policy_version for g in groups]
    completions = [c for g in groups for c in g.completions]
    rewards = [c.reward for c in completions]
    n = len(completions)
    return (
        {
            "reward_mean": sum(rewards) / n,
            "accuracy": sum(r >= 1.0 for r in rewards) / n,
            "reward_errors": sum(c.reward_error is not None for c in completions),
            "reward_timeouts": sum(c.reward_timed_out for c in completions),
            "num_groups": len(groups),
            "constant_reward_groups": sum(
                len({c.reward for c in g.completions}) == 1 for g in groups
            ),  # no learning signal for group-relative advantages
            "response_tokens_mean": sum(len(c.token_ids) for c in completions) / n,
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": max(staleness),
            "staleness_hist": [staleness.count(s) for s in range(max_staleness + 1)],
        }
        | episode_figures(completions)
        | trajectory_figures(groups, version, max_staleness)
    )


def trajectory_figures(groups: list[Group], version: int, max_staleness: int) -> dict[str, Any]:
    """Versions inside each trajectory (partial rollouts mix them; otherwise one per trajectory,
    its group's): `trajectory_spans`, the mean number of distinct versions in one;
    `trajectory_staleness_mean` / `_worst`, learner version minus its oldest token's; and
    `tokens_by_version/<lag>`, policy tokens sampled by version `version - lag`, lag 0..N."""
    spans, lags = [], []
    counts = [0] * (max_staleness + 1)
    for g in groups:
        for c in g.completions:
            stamps = c.token_versions or [g.policy_version] * len(c.token_ids)
            mask = c.loss_mask or [1] * len(stamps)
            spans.append(len(set(stamps)) or 1)
            lags.append(version - min(stamps, default=g.policy_version))
            for v, m in zip(stamps, mask, strict=True):
                if m and 0 <= version - v <= max_staleness:
                    counts[version - v] += 1
    n = max(len(spans), 1)
    return {
        "trajectory_spans": sum(spans) / n,
        "trajectory_staleness_mean": sum(lags) / n,
        "trajectory_staleness_worst": max(lags, default=0),
    } | {f"tokens_by_version/{lag}": count for lag, count in enumerate(counts)}


def episode_figures(completions: list[Completion]) -> dict[str, float]:
    """Multi-turn episodes (none: no figures): policy turns per episode, tool calls, errors and
    timeouts (counts over the iteration), seconds episodes waited on their environment (summed
    over episodes), and the share of response tokens the policy wrote (trained) against the
    environment's (never trained)."""
    episodes = [c.episode for c in completions if c.episode is not None]
    if not episodes:
        return {}
    tokens = sum(len(c.token_ids) for c in completions)
    env_tokens = sum(e.env_tokens for e in episodes)
    return {
        "turns_mean": sum(e.turns for e in episodes) / len(episodes),
        "tool_calls": sum(e.tool_calls for e in episodes),
        "tool_errors": sum(e.tool_errors for e in episodes),
        "tool_timeouts": sum(e.tool_timeouts for e in episodes),
        "env_s": sum(e.env_s for e in episodes),
        "trained_token_frac": (tokens - env_tokens) / max(tokens, 1),
        "env_token_frac": env_tokens / max(tokens, 1),
    }


def pipeline_figures(tracer: Tracer, stats: SourceStats, start: float, wall: float) -> dict:
    """Busy, idle and overlap times of generation and training over one iteration. `gen_s` and
    `train_s` are the busy times under their older names."""
    gen_spans = tracer.select("worker", since=start, names=("generate",))
    gen = [(s.start, s.end) for s in gen_spans]
    train_spans = tracer.select("learner", since=start, names=TRAIN_SPANS)
    train = [(s.start, s.end) for s in train_spans]
    num_workers = max(len({s.track for s in gen_spans}), 1)
    num_ranks = max(len({s.track for s in train_spans}), 1)  # learner-0.. with learner.ranks
    gen_busy = sum(b - a for a, b in gen) / num_workers
    train_busy = sum(b - a for a, b in train) / num_ranks
    depths = stats.queue_depths or [0]
    return {
        "gen_s": gen_busy,
        "train_s": train_busy,
        "gen_busy_s": gen_busy,
        "train_busy_s": train_busy,
        "t_weight_sync": stats.weight_sync_s,
        "weight_sync_s": stats.weight_sync_s,  # the same, under the transport's name
        "weight_sync_bytes": stats.weight_sync_bytes,
        "t_first_group": stats.first_group,
        "t_last_group": stats.last_group,
        "learner_idle_s": stats.learner_wait_s,
        "worker_idle_s": max(wall - gen_busy, 0.0),
        "overlap_s": overlap_length(gen, train),
        "pipeline_efficiency": max(gen_busy, train_busy) / wall,
        "queue_depth": sum(depths) / len(depths),
        "queue_depth_max": max(depths),
    }


def stage_figures(
    tracer: Tracer,
    before: SourceStats,
    after: SourceStats,
    start: float,
    wall: float,
    rows_trained: int,
) -> dict[str, float]:
    """Per stage (gen, reward and teacher where such a stage scores, train) over one iteration,
    from the source's stats before and after it: `stage_S_busy_s` (work spans, mean per worker,
    inside the iteration), `stage_S_idle_s` (wall minus busy), `stage_S_rows_per_s` (samples
    the stage finished / wall) and `stage_S_queue_depth` (rows waiting for the stage,
    time-weighted mean: prompts x group size not yet generated; rows generated and not yet
    scored; rows in whole ready groups not yet taken by the learner)."""
    end = start + wall
    stages = {
        s: (workers, rows - before.stages.get(s, (0, 0))[1])
        for s, (workers, rows) in after.stages.items()
    }
    stages["train"] = (0, rows_trained)  # as many workers as tracks: ranks of the learner
    figures: dict[str, float] = {}
    for stage, (workers, rows) in stages.items():
        prefix, names = STAGE_SPANS[stage]
        spans = tracer.select(prefix, since=start, names=names)
        workers = workers or len({s.track for s in spans})
        busy = sum(max(min(s.end, end) - s.start, 0.0) for s in spans) / max(workers, 1)
        figures |= {
            f"stage_{stage}_busy_s": busy,
            f"stage_{stage}_idle_s": max(wall - busy, 0.0),
            f"stage_{stage}_rows_per_s": rows / wall if wall > 0 else 0.0,
            f"stage_{stage}_queue_depth": tracer.mean_level(f"queue-{stage}", start, end),
        }
    return figures


def summary(
    records: list[dict[str, Any]],
    accuracy_before: float,
    accuracy_after: float,
    loop_s: float,
    num_heldout: int = 0,
    **labels: Any,
) -> dict[str, Any]:
    """The run's figures (`summary.json`): `labels` (mode, placement) first, then held-out
    accuracy with its standard error on `num_heldout` problems, reward, KL and token figures,
    TPSPD over the loop's wall time, and busy times."""
    num_tokens = sum(r["num_tokens"] for r in records)
    tail = records[-max(1, math.ceil(len(records) / 10)) :]  # last 10% of iterations

    def tail_mean(key: str) -> float:
        return sum(r[key] for r in tail) / len(tail)

    distilled = all("distill_reverse_kl" in r for r in tail)
    gen = sum(r["gen_busy_s"] for r in records)
    train = sum(r["train_busy_s"] for r in records)
    return labels | {
        "iterations": len(records),
        "accuracy_before": accuracy_before,
        "accuracy_after": accuracy_after,
        "accuracy_before_stderr": binomial_stderr(accuracy_before, num_heldout),
        "accuracy_after_stderr": binomial_stderr(accuracy_after, num_heldout),
        "num_heldout": num_heldout,
        "reward_mean_first": records[0]["reward_mean"],
        "reward_mean_last": tail_mean("reward_mean"),
        "kl_last": tail_mean("kl"),
        **({"distill_reverse_kl_last": tail_mean("distill_reverse_kl")} if distilled else {}),
        "num_tokens": num_tokens,
        "tokens_computed": sum(r["tokens_computed"] for r in records),
        "positions_computed": sum(r.get("positions_computed", 0) for r in records),
        "reward_errors": sum(r["reward_errors"] for r in records),
        "reward_timeouts": sum(r["reward_timeouts"] for r in records),
        "constant_reward_iterations": sum(
            r["constant_reward_groups"] == r["num_groups"] for r in records
        ),
        "forward_passes_per_microbatch": tail_mean("forward_passes_per_microbatch"),
        "frozen_copies_mb": records[-1]["frozen_copies_mb"],
        "tpspd_overall": tpspd(num_tokens, loop_s),
        "gen_s": sum(r["gen_s"] for r in records),
        "train_s": sum(r["train_s"] for r in records),
        "pipeline_efficiency": max(gen, train) / loop_s,
        "wall_s": loop_s,
    }
