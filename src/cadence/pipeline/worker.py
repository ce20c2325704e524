"""A rollout worker: turns (prompts, group_size, version) into complete, scored groups.

It owns an engine and the reward function. Colocated, it runs in the learner's thread on the
learner's own model; the same class is what worker processes run. Scoring happens here, off the
learner's critical path once workers are separate.
"""

from __future__ import annotations

import time

from cadence.engine import Engine, Request, SamplingParams, derive_seed
from cadence.rewards import RewardFn, safe_reward
from cadence.types import Group, Prompt


class RolloutWorker:
    def __init__(
        self,
        engine: Engine,
        tokenizer,
        reward: RewardFn,
        sampling: SamplingParams,
        group_size: int,
        run_seed: int,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.reward = reward
        self.sampling = sampling
        self.group_size = group_size
        self.run_seed = run_seed

    def encode(self, prompt: Prompt) -> list[int]:
        return self.tokenizer(prompt.text, add_special_tokens=False)["input_ids"]

    def rollout(self, prompts: list[Prompt], iteration: int, version: int) -> list[Group]:
        """Generate and score `group_size` responses for each prompt, as one engine batch."""
        start = time.perf_counter()
        prompt_ids = [self.encode(p) for p in prompts]
        requests = [
            Request(
                ids,
                [derive_seed(self.run_seed, iteration, p.index, j) for j in range(self.group_size)],
            )
            for p, ids in zip(prompts, prompt_ids, strict=True)
        ]
        outputs = self.engine.generate(requests, self.sampling)
        groups = []
        for prompt, ids, completions in zip(prompts, prompt_ids, outputs, strict=True):
            for c in completions:
                result = safe_reward(self.reward, prompt.text, c.text, prompt.answer)
                c.reward, c.reward_error = result.value, result.error
            groups.append(Group(prompt, ids, completions, version, iteration))
        elapsed = time.perf_counter() - start
        for g in groups:
            g.gen_s = elapsed / len(groups)
        return groups
