import copy

import pytest
import torch

from cadence.algo import LossParams
from cadence.engine import HFEngine, SamplingParams
from cadence.learner import Learner, LearnerParams
from cadence.pipeline import RolloutWorker
from cadence.rewards import TableReward
from cadence.types import Prompt
from updates import assert_same_update, capture_grads


class LengthReward:
    """Rewards short answers: gives the groups a spread of rewards without a trained model."""

    def __call__(self, prompt: str, completion: str, answer: str) -> float:
        return 1.0 if len(completion) < 20 else 0.0


def _groups(model, tokenizer, n=4, group_size=4):
    params = SamplingParams(max_new_tokens=10, stop_token_ids=(tokenizer.eos_token_id,))
    worker = RolloutWorker(
        HFEngine(model, tokenizer), tokenizer, LengthReward(), params, group_size, run_seed=3
    )
    prompts = [
        Prompt(f"p{i}", f"Question: What is {i} + {i}?\nAnswer: ", "#### 0", i) for i in range(n)
    ]
    return worker.rollout(prompts, iteration=0, version=0)


def _learner(model, tokenizer, kl_coef=0.1, **kw):
    ref = copy.deepcopy(model).requires_grad_(False) if kl_coef > 0 else None
    params = LearnerParams(lr=1e-2, max_new_tokens=10, **kw)
    return ref, Learner(model, params, LossParams(kl_coef=kl_coef), tokenizer.pad_token_id, ref)


def _train(model, tokenizer, groups, **kw):
    _, learner = _learner(model, tokenizer, **kw)
    return learner.train_iteration(iter(groups), len(groups)), learner


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean", "seq-sum-norm"])
def test_update_does_not_depend_on_micro_batch_size(model, tokenizer, agg):
    groups = _groups(model, tokenizer)
    assert any(len(set(g.rewards)) > 1 for g in groups)  # some signal to learn from
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    _, la = _learner(a, tokenizer, micro_batch_groups=1, loss_agg=agg)
    _, lb = _learner(b, tokenizer, micro_batch_groups=4, loss_agg=agg)
    ga, gb = capture_grads(la), capture_grads(lb)
    la.train_iteration(iter(list(reversed(groups))), len(groups))
    lb.train_iteration(iter(groups), len(groups))
    assert_same_update(a, b, ga[0], gb[0])
    changed = max(
        (pa - p0).abs().max().item()
        for pa, p0 in zip(a.parameters(), model.parameters(), strict=True)
    )
    assert changed > 1e-4  # the update itself is not trivially zero


def test_one_optimizer_step_per_iteration_and_version_advances(model, tokenizer):
    groups = _groups(model, tokenizer)
    stats, learner = _train(model, tokenizer, groups)
    assert stats["optimizer_steps"] == 1 and learner.version == 1
    stats, learner = _train(copy.deepcopy(model), tokenizer, groups, mini_batches=2)
    assert stats["optimizer_steps"] == 2
    expected_tokens = sum(g.num_tokens for g in groups)
    assert stats["num_tokens"] == expected_tokens
    for key in ("loss", "kl", "entropy", "grad_norm", "clip_frac"):
        assert torch.isfinite(torch.tensor(stats[key])), key


def _checksum(model):
    return sum(float(v.double().sum()) * (i + 1) for i, v in enumerate(model.state_dict().values()))


def test_reference_is_a_frozen_copy_whose_checksum_never_changes(model, tokenizer):
    groups = _groups(model, tokenizer)
    ref, learner = _learner(model, tokenizer)
    before = _checksum(ref)
    optimized = {id(p) for g in learner.optimizer.param_groups for p in g["params"]}
    for _ in range(3):
        learner.train_iteration(iter(groups), len(groups))
        assert _checksum(ref) == before
        assert all(p.grad is None and not p.requires_grad for p in ref.parameters())
        assert not optimized & {id(p) for p in ref.parameters()}
    assert _checksum(model) != before  # the policy did move
    assert not learner.optimizer.state.keys() & set(ref.parameters())


class _Recorder:
    """Wraps the learner's loss to keep every micro-batch's PolicyBatch."""

    def __init__(self, learner):
        self.inner, self.batches = learner.loss_fn, []
        learner.loss_fn = self

    def __call__(self, batch, params):
        self.batches.append(batch)
        return self.inner(batch, params)


@pytest.mark.parametrize("reuse", [True, False])
def test_ratio_is_one_on_the_first_micro_batch(model, tokenizer, reuse):
    groups = _groups(model, tokenizer)
    _, learner = _learner(model, tokenizer, micro_batch_groups=2, reuse_old_logprobs=reuse)
    rec = _Recorder(learner)
    stats = learner.train_iteration(iter(groups), len(groups))
    first = rec.batches[0]
    mask = first.loss_mask.bool()
    ratio = torch.exp(first.logprobs.detach() - first.old_logprobs)[mask]
    assert (ratio - 1).abs().max().item() <= 1e-6
    # reusing costs no pass (policy + reference); the frozen old copy costs one more
    assert stats["forward_passes_per_microbatch"] == (2.0 if reuse else 3.0)
    assert (first.old_logprobs is not None) and not first.old_logprobs.requires_grad


def test_mini_batches_take_old_logprobs_from_the_iteration_start_policy(model, tokenizer):
    groups = _groups(model, tokenizer)
    start = copy.deepcopy(model)
    _, learner = _learner(model, tokenizer, kl_coef=0.0, micro_batch_groups=2, mini_batches=2)
    rec = _Recorder(learner)
    stats = learner.train_iteration(iter(groups), len(groups))
    assert stats["optimizer_steps"] == 2 and len(rec.batches) == 2
    # micro-batch 0 precedes any step (old = policy, no pass); micro-batch 1 follows one step
    assert stats["forward_passes_per_microbatch"] == 1.5
    second = rec.batches[1]
    _, check = _learner(start, tokenizer, kl_coef=0.0, micro_batch_groups=2)
    want = _Recorder(check)
    check.train_iteration(iter(groups), len(groups))  # computes the start policy's log-probs
    mask = second.loss_mask.bool()
    old, at_start = second.old_logprobs[mask], want.batches[1].logprobs.detach()[mask]
    assert (old - at_start).abs().max().item() <= 1e-5
    assert (second.logprobs.detach()[mask] - old).abs().max().item() > 1e-4  # the policy moved


def test_frozen_copies_memory_is_reported(model, tokenizer):
    groups = _groups(model, tokenizer)
    size = sum(p.numel() * 4 for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )
    stats, _ = _train(copy.deepcopy(model), tokenizer, groups)
    assert stats["frozen_copies_mb"] == pytest.approx(size / 2**20)  # the reference
    stats, _ = _train(copy.deepcopy(model), tokenizer, groups, mini_batches=2)
    assert stats["frozen_copies_mb"] == pytest.approx(2 * size / 2**20)  # reference + old copy


def test_kl_coef_without_reference_is_refused(model, tokenizer):
    with pytest.raises(ValueError, match="reference"):
        Learner(model, LearnerParams(), LossParams(kl_coef=0.1), tokenizer.pad_token_id)


def test_table_reward_drives_constant_groups_to_zero_advantage(model, tokenizer):
    # every completion scores 0.5: GRPO advantages are all 0, so the policy loss is 0
    groups = _groups(model, tokenizer)
    for g in groups:
        for c in g.completions:
            c.reward = TableReward({}, default=0.5)("", c.text, "")
    stats, _ = _train(copy.deepcopy(model), tokenizer, groups)
    assert stats["pg_loss"] == pytest.approx(0.0, abs=1e-7)
