"""Held-out accuracy: greedy decoding, scored by the run's reward function.

With an environment (`env.kind = "tool"`) each held-out problem is a greedy episode, tools and
all, run by the same rollout worker code that training uses; without one, a single response.
Either way a prompt is fed as training feeds it (`prompt_ids`: truncated where it was cut to fit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from cadence.engine import Engine, Request, SamplingParams
from cadence.envs import Environment
from cadence.rewards import RewardFn, safe_reward
from cadence.rollout.worker import RolloutWorker, prompt_ids
from cadence.types import Completion, Prompt


def evaluate(
    engine: Engine,
    tokenizer,
    reward: RewardFn,
    prompts: list[Prompt],
    sampling: SamplingParams,
    env: Environment | None = None,
) -> dict[str, float]:
    """Fraction of held-out prompts whose greedy answer scores >= 1, and mean response length."""
    greedy = replace(sampling, temperature=0.0)
    if env is not None:
        completions = _episodes(engine, tokenizer, reward, prompts, greedy, env)
    else:
        completions = _responses(engine, tokenizer, prompts, greedy)
    correct, tokens = 0, 0
    for p, c in zip(prompts, completions, strict=True):
        correct += safe_reward(reward, p.text, c.text, p.answer).value >= 1.0
        tokens += len(c.token_ids)
    n = max(len(prompts), 1)
    return {"accuracy": correct / n, "response_tokens_mean": tokens / n}


def _responses(engine, tokenizer, prompts, greedy) -> list[Completion]:
    requests = [Request(prompt_ids(p, tokenizer), [0]) for p in prompts]
    return [c for (c,) in engine.generate(requests, greedy)]


def _episodes(engine, tokenizer, reward, prompts, greedy, env) -> list[Completion]:
    worker = RolloutWorker(engine, tokenizer, None, greedy, 1, 0, env=env)
    return [g.completions[0] for g in worker.rollout(prompts, 0, 0)]


@dataclass
class Evaluator:
    """Held-out accuracy of the learner's current policy, as the run loop asks for it."""

    model: Any  # the learner's policy: put in eval mode first (the engine may share it)
    engine: Engine
    tokenizer: Any
    reward: RewardFn
    prompts: list[Prompt]
    sampling: SamplingParams
    env: Environment | None = None
    sync: Callable[..., None] | None = None  # brings an engine with its own copy to the policy

    def results(self) -> dict[str, float]:
        """`evaluate`'s figures for the policy as it is now."""
        self.model.eval()
        if self.sync is not None:
            self.sync()
        return evaluate(
            self.engine, self.tokenizer, self.reward, self.prompts, self.sampling, self.env
        )

    def __call__(self) -> float:
        return self.results()["accuracy"]
