"""Held-out accuracy: greedy decoding, scored by the run's reward function."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from cadence.engine import Engine, Request, SamplingParams
from cadence.rewards import RewardFn, safe_reward
from cadence.types import Prompt


def evaluate(
    engine: Engine,
    tokenizer,
    reward: RewardFn,
    prompts: list[Prompt],
    sampling: SamplingParams,
) -> dict[str, float]:
    """Fraction of held-out prompts whose greedy answer scores >= 1, and mean response length."""
    greedy = replace(sampling, temperature=0.0)
    requests = [
        Request(tokenizer(p.text, add_special_tokens=False)["input_ids"], [0]) for p in prompts
    ]
    outputs = engine.generate(requests, greedy)
    correct, tokens = 0, 0
    for p, (c,) in zip(prompts, outputs, strict=True):
        correct += safe_reward(reward, p.text, c.text, p.answer).value >= 1.0
        tokens += len(c.token_ids)
    n = max(len(prompts), 1)
    return {"accuracy": correct / n, "response_tokens_mean": tokens / n}


@dataclass
class Evaluator:
    """Held-out accuracy of the learner's current policy, as the run loop asks for it."""

    model: Any  # the learner's policy: put in eval mode first (the engine may share it)
    engine: Engine
    tokenizer: Any
    reward: RewardFn
    prompts: list[Prompt]
    sampling: SamplingParams

    def __call__(self) -> float:
        self.model.eval()
        return evaluate(self.engine, self.tokenizer, self.reward, self.prompts, self.sampling)[
            "accuracy"
        ]
