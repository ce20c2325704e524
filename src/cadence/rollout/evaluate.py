"""Held-out accuracy: greedy decoding, scored by the run's reward function.

With an environment (`env.kind` other than "single_turn") each held-out problem is a greedy
episode, tools and all, run by the same rollout worker code that training uses and scored as
training scores it (the environment's own reward where it gives one: a class, an OpenEnv or a
verifiers environment); without one, a single response.
Either way a prompt is fed as training feeds it (`prompt_ids`: truncated where it was cut to fit).
Prompts labelled with a task (a mix) also give the accuracy of each task. The answers are scored
all at once through the reward runner (`reward.concurrency` calls in flight, each within
`reward.timeout_s`), not one after another.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from cadence.engine import Engine, Request, SamplingParams
from cadence.envs import Environment
from cadence.metrics.tasks import task_accuracy
from cadence.rewards import RewardCall, RewardFn, RewardRunner, as_runner
from cadence.rollout.worker import RolloutWorker, prompt_ids
from cadence.types import Completion, Prompt


def evaluate(
    engine: Engine,
    tokenizer,
    reward: RewardFn | RewardRunner,
    prompts: list[Prompt],
    sampling: SamplingParams,
    env: Environment | None = None,
) -> dict[str, float]:
    """Fraction of held-out prompts whose greedy answer scores >= 1, and mean response length;
    with task labels, each task's fraction too (`accuracy/<task>`)."""
    greedy = replace(sampling, temperature=0.0)
    if env is not None:  # scored as training scores them: the environment's reward first
        completions = _episodes(engine, tokenizer, reward, prompts, greedy, env)
        scores = [c.reward for c in completions]
    else:
        completions = _responses(engine, tokenizer, prompts, greedy)
        calls = [
            RewardCall(p.text, c.text, p.answer, p.metadata)
            for p, c in zip(prompts, completions, strict=True)
        ]
        scores = [result.value for result in as_runner(reward).score(calls)]
    correct = sum(s >= 1.0 for s in scores)
    tokens = sum(len(c.token_ids) for c in completions)
    n = max(len(prompts), 1)
    return {"accuracy": correct / n, "response_tokens_mean": tokens / n} | task_accuracy(
        prompts, scores
    )


def _responses(engine, tokenizer, prompts, greedy) -> list[Completion]:
    requests = [Request(prompt_ids(p, tokenizer), [0]) for p in prompts]
    return [c for (c,) in engine.generate(requests, greedy)]


def _episodes(engine, tokenizer, reward, prompts, greedy, env) -> list[Completion]:
    """Greedy episodes, scored by the worker (the environment's reward, else `reward`)."""
    worker = RolloutWorker(engine, tokenizer, reward, greedy, 1, 0, env=env)
    try:
        return [g.completions[0] for g in worker.rollout(prompts, 0, 0)]
    finally:
        worker.close()


@dataclass
class Evaluator:
    """Held-out accuracy of the learner's current policy, as the run loop asks for it."""

    model: Any  # the learner's policy: put in eval mode first (the engine may share it)
    engine: Engine
    tokenizer: Any
    reward: RewardFn | RewardRunner
    prompts: list[Prompt]
    sampling: SamplingParams
    env: Environment | None = None
    sync: Callable[..., None] | None = None  # brings an engine with its own copy to the policy
    by_task: dict[str, float] = field(default_factory=dict)  # of the last call, per task label

    def __post_init__(self) -> None:
        self.reward = as_runner(self.reward)  # one runner (and its threads) for every call

    def results(self) -> dict[str, float]:
        """`evaluate`'s figures for the policy as it is now."""
        self.model.eval()
        if self.sync is not None:
            self.sync()
        return evaluate(
            self.engine, self.tokenizer, self.reward, self.prompts, self.sampling, self.env
        )

    def __call__(self) -> float:
        result = self.results()
        self.by_task = {
            f"heldout_{key}": value for key, value in result.items() if key.startswith("accuracy/")
        }
        return result["accuracy"]

    def tasks(self) -> dict[str, float]:
        """`heldout_accuracy/<task>` of the last call ({} before the first, or without labels)."""
        return dict(self.by_task)
