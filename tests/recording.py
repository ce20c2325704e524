"""A learner's loss that records what it was given, and the run loop's two steps around a
learner (Scorer, then Trainer), for tests of what reaches the loss (masks, log-probs, gradients)."""

import copy

from cadence.algo import AlgoParams
from cadence.learner import Learner, LearnerParams, Scorer


class Recorder:
    """Wraps the learner's loss: keeps each micro-batch's PolicyBatch, its log-probs' grads."""

    def __init__(self, learner):
        self.inner, self.batches = learner.forward.loss_fn, []
        learner.forward.loss_fn = self

    def __call__(self, batch, params):
        batch.logprobs.retain_grad()
        self.batches.append(batch)
        return self.inner(batch, params)


def train(learner, groups, scorer: Scorer | None = None) -> dict:
    """One iteration as the run loop runs it: `groups` through the scorer (a fresh one for the
    learner's algorithm unless given), then the learner; the learner's and the scorer's figures."""
    scorer = scorer or Scorer(learner.algo)
    return learner.train_iteration(scorer.score(iter(groups)), len(groups)) | scorer.end_iteration()


def recording_learner(model, tokenizer, layout, max_policy_tokens, **loss):
    """A learner of one group a micro-batch with a frozen reference (`layout` "unpacked",
    "prefix" or "dense"), and the Recorder of its loss."""
    ref = copy.deepcopy(model).requires_grad_(False)
    params = LearnerParams(
        lr=1e-3,
        micro_batch_groups=1,
        shared_prompt=layout != "unpacked",
        shared_prompt_impl=layout if layout != "unpacked" else "prefix",
    )
    algo = AlgoParams(kl_coef=0.05, max_policy_tokens=max_policy_tokens, **loss)
    learner = Learner(model, params, algo, tokenizer.pad_token_id, ref)
    return learner, Recorder(learner)
