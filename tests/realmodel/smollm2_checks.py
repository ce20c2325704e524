"""What the real-model tests ask of the learner and of a finished response."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch

from cadence.algo import AlgoParams, PolicyBatch
from cadence.config import Config, load_config
from cadence.learner import Learner, LearnerParams, Scored, StepSums, score
from cadence.types import Group

IM_END = 2  # SmolLM2's `<|im_end|>`: its EOS, its pad and the end of an assistant turn

# Behaviour log-probs against the learner's, both fp32. The tiny models' tolerance, 1e-5, does
# not hold here, and no pair of fp32 computations of this model meets it: against a float64
# forward of the same sampled tokens, the continuous engine's log-probs were off by up to 7.6e-6
# and the learner's by 1.5e-5 (measured 2026-11-26; earlier samples: 1.4e-5 each, 2.3e-5
# apart). SmolLM2's logits reach |38|, where an fp32 ulp is 3.8e-6 (against about 1e-7 for a
# random tiny model's logits under 1), and a few ulps of rounding over 30 layers is the
# difference. Two fp32 paths may each be that far from the exact value, in opposite
# directions: 5e-5. (Measured gaps: tests print them; docs/development.md keeps the figures.)
LOGPROB_TOL = 5e-5


SYSTEM_PROMPT = "Answer with a number."


def run_config(model_dir, *overrides: str) -> Config:
    """A run on SmolLM2: arithmetic prompts in its chat template with a system prompt, groups of
    4 responses of at most 16 tokens, stop ids as the run derives them (tokenizer, generation
    config); then `overrides`."""
    return load_config(
        None,
        [
            f"model.path='{model_dir}'",
            "data.chat_template=true",
            f"data.system_prompt='{SYSTEM_PROMPT}'",
            "data.num_heldout=3",
            "rollout.max_new_tokens=16",
            "rollout.group_size=4",
            "rollout.max_num_seqs=8",
            *overrides,
        ],
    )


def first_layers(model: torch.nn.Module, n: int, out: Path) -> torch.nn.Module:
    """A copy of `model` with its first `n` decoder layers only, also saved to `out` (processes
    that load it by path): the real weights, modules and tied embedding at a fraction of the
    depth, for claims about how the model is sharded or sent rather than what 30 layers compute."""
    model = copy.deepcopy(model)
    model.model.layers = model.model.layers[:n]
    model.config.num_hidden_layers = n
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:n]
    model.save_pretrained(out)
    return model


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread inside (see conftest.py for why), as it was after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class Recording:
    """An engine that keeps what each `generate` returned (what an evaluator was given)."""

    def __init__(self, engine) -> None:
        self.engine, self.outputs = engine, []

    def generate(self, requests, params):
        out = self.engine.generate(requests, params)
        self.outputs.append(out)
        return out


def learner_batch(
    model, pad_id: int, groups, algo: AlgoParams | None = None, ref_model=None
) -> PolicyBatch:
    """The micro-batch the learner's loss sees for `groups` under `model` (see
    `recorded_batch`), from a `Learner` as the run builds it."""
    algo = algo or AlgoParams(kl_coef=0.0)
    learner = Learner(model, LearnerParams(micro_batch_groups=len(groups)), algo, pad_id, ref_model)
    return recorded_batch(learner, score(groups, algo))


def recorded_batch(learner: Learner, scored: list[Scored]) -> PolicyBatch:
    """What the loss of `learner` sees for `scored` (its log-probs, the reference's, the
    engine's behaviour log-probs, the mask): one forward and backward in the layout a run
    trains with (shared-prompt 'prefix'); no optimizer step, gradients dropped, eval mode
    again."""
    assert learner.layout == "prefix"  # the layout a run trains with, not a fallback
    seen: list[PolicyBatch] = []

    def recording(batch, params):
        seen.append(batch)
        return loss_fn(batch, params)

    loss_fn, learner.forward.loss_fn = learner.forward.loss_fn, recording
    try:
        learner.forward_backward(scored, StepSums())
    finally:
        learner.forward.loss_fn = loss_fn
        learner.model.zero_grad(set_to_none=True)
        learner.model.eval()
    (batch,) = seen
    return batch


def with_rewards(groups: list[Group], table: list[float]) -> list[Group]:
    """`groups` with each one's responses rewarded by `table` (the G rewards of every group):
    a fixed signal to train on, whatever the model answered."""
    return [
        replace(
            g, completions=[replace(c, reward=r) for c, r in zip(g.completions, table, strict=True)]
        )
        for g in groups
    ]


def logprob_gap(batch: PolicyBatch) -> float:
    """Largest |learner log-prob - behaviour log-prob| over the response tokens."""
    mask = batch.loss_mask.bool()
    assert batch.behaviour_logprobs is not None and mask.any()
    return (batch.logprobs.detach() - batch.behaviour_logprobs)[mask].abs().max().item()


def assert_ends_at_im_end(completions, max_new_tokens: int) -> int:
    """A response stops at its first `<|im_end|>`, keeps it, and says "eos"; one without it ran
    to the cap and says "length". Returns how many stopped."""
    stopped = 0
    for c in completions:
        if c.finish_reason == "eos":
            assert c.token_ids[-1] == IM_END and IM_END not in c.token_ids[:-1], c.token_ids
            assert len(c.token_ids) <= max_new_tokens
            stopped += 1
        else:
            assert c.finish_reason == "length" and IM_END not in c.token_ids, c
            assert len(c.token_ids) == max_new_tokens
        assert "<|im_end|>" not in c.text  # decoded without special tokens
    return stopped
