"""The learner on multi-turn trajectories: policy tokens get the engine's log-probs back, and
environment tokens take no part in the loss."""

import copy

import pytest
import torch

from cadence.algo import LossParams
from cadence.engine import ContinuousEngine, SamplingParams
from cadence.envs import Budget, ScriptedEnv, replies
from cadence.learner import Learner, LearnerParams
from cadence.models import load_model, load_tokenizer
from cadence.rollout import RolloutWorker
from cadence.types import Prompt


@pytest.fixture(scope="module")
def episodes(model_dir):
    """(model, tokenizer, groups), sampled once for the module."""
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    return model, tokenizer, _episodes(model, tokenizer)


def _episodes(model, tokenizer):
    """Two prompts x 3 samples of up to 3 policy turns of up to 6 tokens, each turn answered by a
    fixed reply: sampled by the continuous engine from the tiny model, in fp32."""
    params = SamplingParams(max_new_tokens=6, stop_token_ids=(tokenizer.eos_token_id,))
    env = ScriptedEnv(replies(" <result>12</result>", "\nok "), Budget(3, 64))
    reward = lambda prompt, completion, answer: float(len(completion) % 3)  # noqa: E731
    worker = RolloutWorker(
        ContinuousEngine(model, tokenizer, max_num_seqs=4), tokenizer, reward, params, 3, 7, env=env
    )
    prompts = [
        Prompt(f"p{i}", f"Question: What is {i} + 5?\nAnswer: ", "#### 0", i) for i in range(2)
    ]
    groups = worker.rollout(prompts, iteration=0, version=0)
    masks = [c.loss_mask for g in groups for c in g.completions]
    assert any(0 in m for m in masks), "no episode got an environment reply"
    return groups


class _Recorder:
    """Wraps the learner's loss: keeps each micro-batch's PolicyBatch, its log-probs' grads."""

    def __init__(self, learner):
        self.inner, self.batches = learner.loss_fn, []
        learner.loss_fn = self

    def __call__(self, batch, params):
        batch.logprobs.retain_grad()
        self.batches.append(batch)
        return self.inner(batch, params)


def _learner(model, tokenizer, layout, **loss):
    ref = copy.deepcopy(model).requires_grad_(False)
    params = LearnerParams(
        lr=1e-3,
        max_new_tokens=6,
        micro_batch_groups=1,
        shared_prompt=layout != "unpacked",
        shared_prompt_impl=layout if layout != "unpacked" else "prefix",
    )
    loss_params = LossParams(kl_coef=0.05, **loss)
    learner = Learner(model, params, loss_params, tokenizer.pad_token_id, ref)
    return learner, _Recorder(learner)


@pytest.mark.parametrize("layout", ["unpacked", "dense", "prefix"])
def test_policy_token_logprobs_from_the_learner_equal_the_engines(episodes, layout):
    model, tokenizer, groups = episodes
    learner, rec = _learner(copy.deepcopy(model), tokenizer, layout)
    learner.train_iteration(iter(groups), len(groups))
    for batch, group in zip(rec.batches, groups, strict=True):
        mask = batch.loss_mask.bool()
        want = [c.loss_mask + [0] * (mask.shape[1] - len(c.loss_mask)) for c in group.completions]
        assert torch.equal(mask, torch.tensor(want, dtype=torch.bool))
        diff = (batch.logprobs.detach() - batch.behaviour_logprobs)[mask].abs().max().item()
        assert diff <= 1e-5  # every policy token of every turn, under its whole context
        # environment tokens are not trained: no gradient reaches their log-probs
        env = ~mask & (
            torch.arange(mask.shape[1])
            < batch.loss_mask.new_tensor([len(c.token_ids) for c in group.completions])[:, None]
        )
        assert env.any()
        assert batch.logprobs.grad[env].abs().max().item() == 0.0
        assert batch.logprobs.grad[mask].abs().max().item() > 0.0


def _grads(model, tokenizer, groups, stale):
    learner, _ = _learner(copy.deepcopy(model), tokenizer, "prefix", tis_cap=0.0)
    learner.version = 1 if stale else 0  # stale: the behaviour log-probs are the ratio's base
    for g in groups:
        g.policy_version = 0
    grads = {}

    def keep(optimizer, args, kwargs):
        for n, p in learner.model.named_parameters():
            grads[n] = p.grad.detach().clone()

    learner.optimizer.register_step_pre_hook(keep)
    learner.train_iteration(iter(groups), len(groups))
    return grads


def _perturbed(groups, untrained_too=False):
    """A copy in which every environment token's recorded log-prob is replaced by noise (and,
    with `untrained_too`, its mask set to 1, as if it were trained)."""
    out = copy.deepcopy(groups)
    gen = torch.Generator().manual_seed(0)
    for g in out:
        for c in g.completions:
            for t, m in enumerate(c.loss_mask):
                if m == 0:
                    c.logprobs[t] = -5.0 * torch.rand((), generator=gen).item()
            if untrained_too:
                c.loss_mask = None
    return out


def test_environment_tokens_get_zero_gradient(episodes):
    # Stale groups take their recorded behaviour log-probs as the PPO ratio's base, token by
    # token, so the loss reads every recorded log-prob it trains on. Perturbing those of the
    # environment tokens leaves the gradient exactly as it was: they are not in the loss. The
    # same perturbation with the mask dropped does move it, so the check can fail.
    model, tokenizer, groups = episodes
    base = _grads(model, tokenizer, copy.deepcopy(groups), stale=True)
    same = _grads(model, tokenizer, _perturbed(groups), stale=True)
    assert all(torch.equal(base[n], same[n]) for n in base)
    moved = _grads(model, tokenizer, _perturbed(groups, untrained_too=True), stale=True)
    assert max((base[n] - moved[n]).abs().max().item() for n in base) > 1e-6
