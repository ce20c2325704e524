import copy

import pytest
import torch

from cadence.algo import LossParams
from cadence.engine import HFEngine, SamplingParams
from cadence.learner import Learner, LearnerParams
from cadence.pipeline import RolloutWorker
from cadence.rewards import TableReward
from cadence.types import Prompt


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


def _train(model, tokenizer, groups, **kw):
    ref = copy.deepcopy(model).requires_grad_(False)
    params = LearnerParams(lr=1e-2, max_new_tokens=10, **kw)
    learner = Learner(model, params, LossParams(kl_coef=0.1), tokenizer.pad_token_id, ref)
    return learner.train_iteration(iter(groups), len(groups)), learner


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean", "seq-sum-norm"])
def test_update_does_not_depend_on_micro_batch_size(model, tokenizer, agg):
    groups = _groups(model, tokenizer)
    assert any(len(set(g.rewards)) > 1 for g in groups)  # some signal to learn from
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    _train(a, tokenizer, groups, micro_batch_groups=1, loss_agg=agg)
    _train(b, tokenizer, list(reversed(groups)), micro_batch_groups=4, loss_agg=agg)
    changed = 0.0
    for (name, pa), pb, p0 in zip(
        a.named_parameters(), b.parameters(), model.parameters(), strict=True
    ):
        assert (pa - pb).abs().max().item() < 1e-6, name
        changed = max(changed, (pa - p0).abs().max().item())
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


def test_reference_model_stays_frozen(model, tokenizer):
    groups = _groups(model, tokenizer)
    ref = copy.deepcopy(model).requires_grad_(False)
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    learner = Learner(
        model, LearnerParams(lr=1e-2), LossParams(kl_coef=0.1), tokenizer.pad_token_id, ref
    )
    learner.train_iteration(iter(groups), len(groups))
    learner.train_iteration(iter(groups), len(groups))
    for k, v in ref.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in ref.parameters())


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
