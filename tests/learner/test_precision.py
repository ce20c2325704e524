"""Mixed precision: bf16 compute with float32 master weights and optimizer state.

At a small learning rate a pure-bf16 step rounds most updates away (an Adam step of about lr is
under half a bf16 ulp of most weights); float32 masters keep every one, and a checkpoint keeps
the masters, so a resumed learner continues bit for bit."""

import copy

import pytest
import torch
from rollouts import sample_groups

from cadence.algo import AlgoParams
from cadence.config import ConfigError, load_config
from cadence.learner import Learner, LearnerParams, score
from cadence.learner.precision import Masters
from cadence.models import load_model

ALGO = AlgoParams(max_policy_tokens=10, kl_coef=0.0)


def _learner(model_dir, tokenizer, kind: str, lr: float = 1e-6) -> Learner:
    """kind: float32, mixed (bf16 model, float32 masters) or bfloat16 (pure bf16)."""
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    model = load_model(model_dir, dtype=dtype)
    masters = Masters.split(model, torch.bfloat16) if kind == "mixed" else None
    return Learner(model, LearnerParams(lr=lr), ALGO, tokenizer.pad_token_id, masters=masters)


def _fraction_moved(learner: Learner, groups) -> float:
    before = [p.detach().clone() for p in learner.trained]
    learner.train_iteration(iter(score(groups, ALGO)), len(groups))
    moved = sum(int((p != b).sum()) for p, b in zip(learner.trained, before, strict=True))
    return moved / sum(b.numel() for b in before)


@pytest.fixture(scope="module")
def groups(model_dir):
    from cadence.models import load_tokenizer

    return sample_groups(load_model(model_dir), load_tokenizer(model_dir))


def test_at_lr_1e6_a_mixed_step_moves_what_a_float32_step_moves(model_dir, tokenizer, groups):
    full = _fraction_moved(_learner(model_dir, tokenizer, "float32"), groups)
    mixed = _fraction_moved(_learner(model_dir, tokenizer, "mixed"), groups)
    pure = _fraction_moved(_learner(model_dir, tokenizer, "bfloat16"), groups)
    assert full > 0.99
    assert mixed >= 0.9 * full
    assert pure < 0.5 * full  # the bf16 parameters this replaces: most updates rounded away


def test_the_model_computes_in_bf16_and_the_optimizer_steps_float32_masters(
    model_dir, tokenizer, groups
):
    learner = _learner(model_dir, tokenizer, "mixed", lr=1e-3)
    assert {p.dtype for p in learner.model.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in learner.model.buffers()} <= {torch.float32}  # never cast
    learner.train_iteration(iter(score(groups, ALGO)), len(groups))
    state = [t for s in learner.optimizer.state.values() for t in s.values() if t.dim()]
    assert state and {t.dtype for t in state} == {torch.float32}
    for p, m in learner.masters.pairs:  # the model is its masters, rounded
        assert torch.equal(p, m.detach().to(torch.bfloat16))
        assert p.grad is None  # gradients live on the masters


def test_a_checkpointed_learner_resumes_its_float32_masters_exactly(
    model_dir, tokenizer, groups, tmp_path
):
    straight = _learner(model_dir, tokenizer, "mixed", lr=1e-3)
    for _ in range(2):
        straight.train_iteration(iter(score(groups, ALGO)), len(groups))
    first = _learner(model_dir, tokenizer, "mixed", lr=1e-3)
    first.train_iteration(iter(score(groups, ALGO)), len(groups))
    state = first.state(tmp_path)
    saved = {k: v.clone() for k, v in first.model.state_dict().items()}  # policy/, in bf16
    resumed = _learner(model_dir, tokenizer, "mixed", lr=1e-3)
    resumed.model.load_state_dict(saved)
    resumed.load_state(tmp_path, copy.deepcopy(state))
    resumed.train_iteration(iter(score(groups, ALGO)), len(groups))
    for got, want in zip(resumed.masters.params, straight.masters.params, strict=True):
        assert got.dtype == torch.float32 and torch.equal(got, want)
    # the bf16 weights alone (what policy/ holds) would not have been enough
    assert any(not torch.equal(m, p.float()) for p, m in first.masters.pairs)


def test_pure_bf16_is_asked_for_and_warns_with_the_learning_rate_floor(model_dir):
    from cadence.builder import load_policy

    sets = [f"model.path='{model_dir}'", "model.dtype='bfloat16'", "train.lr=1e-6"]
    model, masters = load_policy(load_config(None, sets))
    assert masters is not None and {m.dtype for m in masters.params} == {torch.float32}
    with pytest.warns(UserWarning, match=r"cannot move any weight larger than 0.000512"):
        model, masters = load_policy(load_config(None, [*sets, "learner.master_dtype='bfloat16'"]))
    assert masters is None and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(ConfigError, match=r"needs model\.dtype = 'bfloat16'"):
        load_config(None, [f"model.path='{model_dir}'", "learner.master_dtype='bfloat16'"])
