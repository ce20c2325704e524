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

from cadence.engine import Engine, Releases, Request, generate_by_steps
from cadence.metrics.tasks import task_accuracy
from cadence.rewards import RewardCall
from cadence.rollout.worker import RolloutWorker, prompt_ids
from cadence.types import Prompt


def evaluate(worker: RolloutWorker, prompts: list[Prompt]) -> dict[str, float]:
    """Fraction of held-out prompts whose greedy answer scores >= 1, their mean score (partial
    credit counts there, as reasoning-gym's graders give it), and mean response length;
    with task labels, each task's fraction too (`accuracy/<task>`). `worker` is the evaluation
    worker (`build_worker(evaluation_spec(...))`: greedy, one sample, the run's reward)."""
    if worker.reward is None:
        raise ValueError("held-out evaluation needs a worker with a reward function")
    greedy = replace(worker.sampling, temperature=0.0)
    if worker.episodes is not None:  # scored as training scores them: the environment's first
        completions = [g.completions[0] for g in worker.rollout(prompts, 0, 0)]
        scores = [c.reward for c in completions]
    else:
        requests = [Request(prompt_ids(p, worker.tokenizer), [0]) for p in prompts]
        completions = [c for (c,) in generate_by_steps(worker.engine, requests, greedy)]
        calls = [
            RewardCall(p.text, c.text, p.answer, p.metadata)
            for p, c in zip(prompts, completions, strict=True)
        ]
        scores = [result.value for result in worker.reward.score(calls)]
    correct = sum(s >= 1.0 for s in scores)
    tokens = sum(len(c.token_ids) for c in completions)
    n = max(len(prompts), 1)
    figures = {
        "accuracy": correct / n,
        "score_mean": sum(scores) / n,
        "response_tokens_mean": tokens / n,
    }
    return figures | task_accuracy(prompts, scores)


@dataclass
class Evaluator:
    """Held-out accuracy of the learner's current policy, as the run loop asks for it: each call
    builds the evaluation worker on `engine` (`make_worker`, as the builder wires it:
    `build_worker` with `evaluation_spec`), runs it and closes it (an environment's episodes let
    go of what they hold), and an engine that can frees its cache until the next call. With
    `open_engine` each call opens the engine it decodes with and closes it after (a transient
    copy on a GPU: `close` frees it)."""

    model: Any  # the learner's policy: put in eval mode first (the engine may share it)
    engine: Engine | None
    make_worker: Callable[[Engine], RolloutWorker]
    prompts: list[Prompt]
    sync: Callable[..., None] | None = None  # brings an engine with its own copy to the policy
    by_task: dict[str, float] = field(default_factory=dict)  # of the last call, per task label
    open_engine: Callable[[], tuple[Engine, Callable[[], None]]] | None = None

    def results(self) -> dict[str, float]:
        """`evaluate`'s figures for the policy as it is now."""
        self.model.eval()
        if self.sync is not None:
            self.sync()
        if self.open_engine is not None:
            engine, close = self.open_engine()
        else:
            assert self.engine is not None, "an Evaluator has an engine or opens one"
            engine, close = self.engine, lambda: None
        worker = self.make_worker(engine)
        try:
            return evaluate(worker, self.prompts)
        finally:
            worker.close()
            if isinstance(engine, Releases) and not engine.busy:
                engine.release()
            close()

    def __call__(self) -> float:
        result = self.results()
        self.by_task = {
            f"heldout_{key}": value for key, value in result.items() if key.startswith("accuracy/")
        }
        return result["accuracy"]

    def tasks(self) -> dict[str, float]:
        """`heldout_accuracy/<task>` of the last call ({} before the first, or without labels)."""
        return dict(self.by_task)
