"""The line of a worker's finished groups waiting on their rewards: each group's reward calls
start as soon as it is generated (an environment's own rewards taken as given), and groups leave
in the order they finished, once their scores are in. A reward that fails is a counted error on
its completion, never a stopped run (rewards/). It never generates nor touches the engine.
docs/data.md#rewards.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

from cadence.rewards import RewardCall, RewardResult, RewardScorer
from cadence.types import Completion, Group, Prompt


@dataclass
class Job:
    """A prompt of a task, from its submission until its group is handed out."""

    task: Hashable
    prompt: Prompt
    prompt_ids: list[int]
    iteration: int
    version: int
    submitted: float


@dataclass
class _Scoring:
    """A generated group whose rewards are being computed."""

    job: Job
    completions: list[Completion]
    scored: list[int]  # positions of the completions the reward function scores
    results: cf.Future[list[RewardResult]] | None  # None: nothing to score


class ScoringLine:
    """Finished groups in the order they finished, each scored by `reward` (None: a reward
    stage scores later, or the environment did)."""

    def __init__(self, reward: RewardScorer | None) -> None:
        self.reward = reward
        self._line: deque[_Scoring] = deque()

    def __bool__(self) -> bool:
        return bool(self._line)

    def holds(self, task: Hashable) -> bool:
        return any(s.job.task == task for s in self._line)

    def wait(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the head of the line's scores."""
        if self._line and (head := self._line[0].results) is not None:
            cf.wait([head], timeout=timeout_s)

    def add(self, job: Job, completions: list[Completion], env_rewards: list | None = None) -> None:
        """Rewards: an environment's own where it gave one, else the reward function's, whose
        calls start now."""
        scored = []
        for i, c in enumerate(completions):
            if env_rewards is not None and env_rewards[i] is not None:
                c.reward = env_rewards[i]
                if not math.isfinite(c.reward):  # never into the advantages: a counted error
                    c.reward, c.reward_error = 0.0, f"environment: non-finite reward {c.reward}"
            elif self.reward is not None:
                scored.append(i)
        p = job.prompt
        calls = [RewardCall(p.text, completions[i].text, p.answer, p.metadata) for i in scored]
        results = self.reward.submit(calls) if calls and self.reward is not None else None
        self._line.append(_Scoring(job, completions, scored, results))

    def done(self) -> list[tuple[Hashable, Group]]:
        """The groups at the head of the line whose scores are in, as (task, group)."""
        out = []
        while self._line and (self._line[0].results is None or self._line[0].results.done()):
            s = self._line.popleft()
            results = s.results.result() if s.results is not None else []
            for i, result in zip(s.scored, results, strict=True):
                s.completions[i].reward = result.value
                s.completions[i].reward_error = result.error
            job = s.job
            group = Group(job.prompt, job.prompt_ids, s.completions, job.version, job.iteration)
            group.gen_s = time.perf_counter() - job.submitted
            out.append((job.task, group))
        return out
