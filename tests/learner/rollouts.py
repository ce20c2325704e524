"""Groups sampled from the tiny test model, a recorder of what the learner's loss sees, and the
run loop's two steps around a learner (Scorer, then Trainer)."""

from __future__ import annotations

from dataclasses import fields

from cadence.algo import AlgoParams
from cadence.engine import HFEngine, SamplingParams
from cadence.learner import LearnerParams
from cadence.rollout import RolloutWorker
from cadence.types import Prompt
from recording import Recorder, train  # noqa: F401  (the learner tests import them from here)

LEARNER_KEYS = {f.name for f in fields(LearnerParams)}


def split_params(**kw) -> tuple[LearnerParams, AlgoParams]:
    """Learner and algorithm settings from one set of keywords, each to the record it belongs in."""
    learner = {k: v for k, v in kw.items() if k in LEARNER_KEYS}
    algo = {k: v for k, v in kw.items() if k not in LEARNER_KEYS}
    return LearnerParams(**learner), AlgoParams(**algo)


class LengthReward:
    """Rewards short answers: gives the groups a spread of rewards without a trained model."""

    def __call__(self, prompt: str, completion: str, answer: str) -> float:
        return 1.0 if len(completion) < 20 else 0.0


def sample_groups(model, tokenizer, n=4, group_size=4):
    """`n` groups of `group_size` responses of at most 10 tokens, tagged policy version 0."""
    params = SamplingParams(max_new_tokens=10, stop_token_ids=(tokenizer.eos_token_id,))
    worker = RolloutWorker(
        HFEngine(model, tokenizer), tokenizer, LengthReward(), params, group_size, run_seed=3
    )
    prompts = [
        Prompt(f"p{i}", f"Question: What is {i} + {i}?\nAnswer: ", "#### 0", i) for i in range(n)
    ]
    return worker.rollout(prompts, iteration=0, version=0)


def older_behaviour(groups, delta):
    """Lower the recorded behaviour log-probs by `delta`, as if older weights had sampled them:
    pi_old / pi_behaviour = exp(delta) on every token."""
    for g in groups:
        for c in g.completions:
            c.logprobs = [lp - delta for lp in c.logprobs]
