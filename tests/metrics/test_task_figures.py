"""Per-task figures of a mix, worked out by hand: each task's samples alone, unlabelled prompts
left out, and the summary named as the run's own figures are."""

from __future__ import annotations

import pytest

from cadence.metrics import task_accuracy, task_figures, task_summary
from cadence.types import Completion, Group, Prompt


def _group(task: str, rewards: list[float]) -> Group:
    completions = [Completion([1], [0.0], reward=r) for r in rewards]
    return Group(Prompt(f"{task}:0", "q", "a", task=task), [1], completions, 0, 0)


def test_task_figures_split_reward_and_accuracy_by_label() -> None:
    groups = [
        _group("chain_sum", [1.0, 0.0]),
        _group("basic_arithmetic", [0.5, 0.5]),
        _group("chain_sum", [1.0, 1.0]),
        _group("", [1.0, 1.0]),  # no label: in no task's figures
    ]
    figures = task_figures(groups)
    assert figures == pytest.approx(
        {
            "reward_mean/chain_sum": 0.75,  # (1 + 0 + 1 + 1) / 4
            "accuracy/chain_sum": 0.75,
            "reward_mean/basic_arithmetic": 0.5,
            "accuracy/basic_arithmetic": 0.0,  # 0.5 is partial credit, not a solved problem
        },
        abs=1e-12,
    )
    assert task_figures([_group("", [1.0])]) == {}


def test_task_accuracy_counts_scores_of_one() -> None:
    prompts = [Prompt(str(i), "q", "a", task=t) for i, t in enumerate(["a", "b", "a", "a", ""])]
    scores = [1.0, 0.2, 0.0, 1.0, 1.0]
    assert task_accuracy(prompts, scores) == pytest.approx({"accuracy/a": 2 / 3, "accuracy/b": 0})


def test_task_summary_first_last_and_heldout() -> None:
    records = [{"reward_mean/a": float(k)} for k in range(20)]  # 0 .. 19
    records[5]["reward_mean/b"] = 0.25  # b trained in two iterations only
    records[19]["reward_mean/b"] = 0.75
    out = task_summary(records, {"heldout_accuracy/a": 0.1}, {"heldout_accuracy/a": 0.4})
    assert out == pytest.approx(
        {
            "reward_mean_first/a": 0.0,
            "reward_mean_last/a": 18.5,  # last 10% of 20 iterations: 18 and 19
            "reward_mean_first/b": 0.25,
            "reward_mean_last/b": 0.75,  # last 10% of its 2 iterations: at least one
            "accuracy_before/a": 0.1,
            "accuracy_after/a": 0.4,
        }
    )
    assert task_summary([{"reward_mean": 1.0}], {}, {}) == {}
