"""A reward stage's scorers: what a reward worker builds from a `RewardSpec` and runs on a
micro-batch of rows (backend/reward_stage.py carries them to processes).

kind "rule": the reward function on (prompt text, response text, reference), through the reward
runner exactly as a rollout worker scores; kind "model": a learned reward model on the token
ids. A non-finite score is a reward error. Nothing here starts a process or reads the config.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from cadence.rewards.concurrent import RewardCall, load_runner

RULE_FIELDS = ("prompt", "response_text")
MODEL_FIELDS = ("prompt_ids", "response_ids")


@dataclass(frozen=True)
class RewardSpec:
    """Everything a reward worker needs to build its scorer (plain, picklable values)."""

    kind: str  # "rule" | "model"
    function: str = "math"  # kind "rule": 'math' or 'module:function'
    model_path: str | None = None  # kind "model": a sequence-classification directory
    batch_size: int = 32  # kind "model": responses per forward pass
    threads: int = 1  # torch threads of each reward worker
    dtype: str = "float32"
    timeout_s: float = 0.0  # kind "rule": longest one call may take (0: no limit)
    answer_format: str = "auto"  # kind "rule", function "math": reward.answer_format
    concurrency: int | None = None  # kind "rule": calls in flight at once (None: its default)
    device: str = "cpu"  # kind "model": where the reward model scores

    @property
    def fields(self) -> tuple[str, ...]:
        """The store fields the scorer reads."""
        return MODEL_FIELDS if self.kind == "model" else RULE_FIELDS


Scores = tuple[list[float], list[str | None]]  # (rewards, reward errors), one per row


class BatchScorer(Protocol):
    def __call__(self, data: dict[str, list]) -> Scores: ...


class RuleScorer:
    """A rule reward function over (prompt text, response text, reference answer)."""

    def __init__(
        self,
        function: str,
        answer_format: str = "auto",
        timeout_s: float = 0.0,
        concurrency: int | None = None,
    ) -> None:
        self.rewards = load_runner(function, answer_format, timeout_s, concurrency)

    def __call__(self, data: dict[str, list]) -> Scores:
        calls = [
            RewardCall(p.text, text, p.answer, p.metadata)
            for p, text in zip(data["prompt"], data["response_text"], strict=True)
        ]
        return self.score_calls(calls)

    def score_calls(self, calls: Sequence[RewardCall]) -> Scores:
        """The calls a rollout worker made, as it would have scored them."""
        results = self.rewards.score(calls)
        return [r.value for r in results], [r.error for r in results]


class ModelScorer:
    """A learned reward model over (prompt ids, response ids)."""

    def __init__(
        self, model_path: str, batch_size: int, dtype: str = "float32", device: str = "cpu"
    ) -> None:
        from cadence.models import DTYPES
        from cadence.rewards.model import RewardModel

        self.model = RewardModel.load(
            model_path, batch_size=batch_size, dtype=DTYPES[dtype], device=device
        )

    def __call__(self, data: dict[str, list]) -> Scores:
        scores = self.model.score_ids(data["prompt_ids"], data["response_ids"])
        return finite_scores(scores)


def finite_scores(scores: Sequence[float]) -> Scores:
    """Scores as rewards: a non-finite one is 0.0 with an error, as `safe_reward` makes it."""
    rewards: list[float] = []
    errors: list[str | None] = []
    for s in scores:
        ok = math.isfinite(s)
        rewards.append(float(s) if ok else 0.0)
        errors.append(None if ok else f"non-finite reward: got float {s!r}")
    return rewards, errors


def build_batch_scorer(spec: RewardSpec) -> BatchScorer:
    """The scorer a reward worker runs, as `spec` describes it."""
    if spec.kind == "model":
        if not spec.model_path:
            raise ValueError("a reward model stage needs reward.model_path")
        return ModelScorer(spec.model_path, spec.batch_size, spec.dtype, spec.device)
    return RuleScorer(spec.function, spec.answer_format, spec.timeout_s, spec.concurrency)
