"""Figures per task of a mix: the same reward and accuracy, split by each prompt's `task` label.

A run that mixes tasks (reasoning-gym's datasets) reports, per label, `reward_mean/<task>` and
`accuracy/<task>` each iteration, `heldout_accuracy/<task>` where held-out accuracy is measured,
and in the summary each task's reward first and last and its held-out accuracy before and after.
Prompts without a label (a single task) give no per-task figure at all. Plain functions of
records, like figures.py; nothing here runs the pipeline or reads the config.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from cadence.types import Group, Prompt


def task_figures(groups: Sequence[Group]) -> dict[str, float]:
    """Per task label among the groups' prompts: mean reward and accuracy (reward >= 1) of its
    samples, `reward_mean/<task>` and `accuracy/<task>`."""
    rewards: dict[str, list[float]] = {}
    for g in groups:
        if g.prompt.task:
            rewards.setdefault(g.prompt.task, []).extend(g.rewards)
    figures: dict[str, float] = {}
    for task, values in sorted(rewards.items()):
        figures[f"reward_mean/{task}"] = sum(values) / len(values)
        figures[f"accuracy/{task}"] = sum(r >= 1.0 for r in values) / len(values)
    return figures


def task_accuracy(prompts: Sequence[Prompt], scores: Sequence[float]) -> dict[str, float]:
    """Per task label: the fraction of its prompts whose score is >= 1, `accuracy/<task>`."""
    scored: dict[str, list[float]] = {}
    for p, s in zip(prompts, scores, strict=True):
        if p.task:
            scored.setdefault(p.task, []).append(s)
    return {
        f"accuracy/{task}": sum(s >= 1.0 for s in values) / len(values)
        for task, values in sorted(scored.items())
    }


def task_summary(
    records: Sequence[dict[str, Any]], before: dict[str, float], after: dict[str, float]
) -> dict[str, float]:
    """Each task's `reward_mean_first/<task>` (its first iteration) and `reward_mean_last/<task>`
    (mean over the last 10% of the iterations that trained it), and from the held-out figures
    (`heldout_accuracy/<task>` before and after RL) `accuracy_before/<task>` and
    `accuracy_after/<task>`, as `summary` names the run's own."""
    out: dict[str, float] = {}
    tasks = sorted(
        {k.partition("/")[2] for r in records for k in r if k.startswith("reward_mean/")}
    )
    for task in tasks:
        values = [r[f"reward_mean/{task}"] for r in records if f"reward_mean/{task}" in r]
        tail = values[-max(1, math.ceil(len(values) / 10)) :]
        out[f"reward_mean_first/{task}"] = values[0]
        out[f"reward_mean_last/{task}"] = sum(tail) / len(tail)
    for when, figures in (("before", before), ("after", after)):
        for key, value in sorted(figures.items()):
            out[f"accuracy_{when}/{key.partition('/')[2]}"] = value
    return out
