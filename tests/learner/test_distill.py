"""On-policy distillation in the learner: a teacher that is the student teaches nothing, and the
update is the gradient of the sampled per-token reverse KL (learner/distill.py)."""

import copy
import dataclasses

import pytest
import torch
from rollouts import sample_groups, split_params, train

from cadence.learner import Learner
from cadence.learner.distill import DistillParams, Teachers
from cadence.learner.logprobs import token_logprobs
from cadence.learner.packing import LAYOUTS, group_tokens
from cadence.models.scoring import ANY_TASK, response_logprobs
from tiny_models import perturbed
from updates import capture_grads


def _learner(model, tokenizer, teachers: dict, coef=1.0, reward_coef=0.0, **kw):
    params, algo = split_params(
        lr=1e-2, max_policy_tokens=10, kl_coef=0.0, loss="pg", loss_agg="token-mean", **kw
    )
    frozen = {k: m.requires_grad_(False) for k, m in teachers.items()}
    distill = Teachers(frozen, DistillParams(coef, reward_coef))
    return Learner(model, params, algo, tokenizer.pad_token_id, teachers=distill)


def _other(model, seed: int):
    """A teacher of the student's shape and tokenizer, its weights moved by seeded noise."""
    return perturbed(model, seed, 0.05)


def test_a_teacher_that_is_the_student_gives_zero_reverse_kl_and_no_update(model, tokenizer):
    groups = sample_groups(model, tokenizer)
    learner = _learner(copy.deepcopy(model), tokenizer, {ANY_TASK: copy.deepcopy(model)})
    grads = capture_grads(learner)
    stats = train(learner, groups)
    assert stats["distill_reverse_kl"] == pytest.approx(0.0, abs=1e-6)
    assert max(g.abs().max().item() for g in grads[0].values()) <= 1e-7


@pytest.mark.parametrize("layout", ["prefix", "packed"])
def test_the_gradient_is_that_of_the_sampled_per_token_reverse_kl(model, tokenizer, layout):
    """coef x mean over tokens of sg(log pS - log pT) * log pS, differentiated by autograd on
    the unpacked layout: the score-function gradient of the per-token reverse KL at the
    sampled tokens, KL(pS || pT) = E_pS[log pS - log pT]."""
    groups = sample_groups(model, tokenizer, n=2)
    teacher = _other(model, seed=0)
    student = copy.deepcopy(model)
    learner = _learner(student, tokenizer, {ANY_TASK: teacher}, coef=0.5, shared_prompt_impl=layout)
    grads = capture_grads(learner)
    stats = train(learner, groups)

    want_model = copy.deepcopy(model)
    tokens = [(g.prompt_ids, [c.token_ids for c in g.completions]) for g in groups]
    rows = [c.token_ids for g in groups for c in g.completions]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows])
    layout_in = LAYOUTS["unpacked"](tokens, tokenizer.pad_token_id)
    log_s = token_logprobs(want_model, layout_in, ids, 1.0, False)[0]  # (B, T)
    with torch.no_grad():
        log_t = token_logprobs(teacher, layout_in, ids, 1.0, False)[0]
    surrogate = 0.5 * ((log_s - log_t).detach() * log_s * mask).sum() / mask.sum()
    surrogate.backward()
    want = {n: p.grad for n, p in want_model.named_parameters() if p.grad is not None}
    for name, got in grads[0].items():
        torch.testing.assert_close(got, want[name], rtol=1e-4, atol=1e-6)
    kl = float(((log_s - log_t).detach() * mask).sum() / mask.sum())
    assert stats["distill_reverse_kl"] == pytest.approx(kl, rel=1e-4)
    assert kl > 1e-3  # the teacher differs: the test is not trivially of zeros


def test_each_prompt_is_scored_by_the_teacher_of_its_task(model, tokenizer):
    """Two teachers, one per task: each reports its own tokens' reverse KL, the student itself as
    one teacher gives 0 on its task's rows, and a task with no teacher is refused."""
    groups = sample_groups(model, tokenizer, n=4)
    for i, g in enumerate(groups):
        g.prompt = dataclasses.replace(g.prompt, task="same" if i % 2 else "other")
    teachers = {"same": copy.deepcopy(model), "other": _other(model, seed=1)}
    learner = _learner(copy.deepcopy(model), tokenizer, teachers)
    stats = train(learner, groups)
    assert stats["distill_reverse_kl/same"] == pytest.approx(0.0, abs=1e-6)
    assert stats["distill_reverse_kl/other"] > 1e-3
    assert stats["distill_reverse_kl"] == pytest.approx(
        (stats["distill_reverse_kl/other"] * _tokens(groups, "other")) / _tokens(groups, None),
        rel=1e-5,
    )
    groups[0].prompt = dataclasses.replace(groups[0].prompt, task="unknown")
    with pytest.raises(ValueError, match="no teacher scores task 'unknown'"):
        train(_learner(copy.deepcopy(model), tokenizer, teachers), groups)


def _tokens(groups, task) -> int:
    return sum(
        len(c.token_ids)
        for g in groups
        if task is None or g.prompt.task == task
        for c in g.completions
    )


def test_a_teacher_stage_scores_what_the_learner_s_teacher_pass_does(model, tokenizer):
    # a teacher worker's right-padded passes (backend/teacher_stage.py) against the learner's own
    # teacher pass in its packed layout, with the temperature the learner divides by
    teacher = _other(model, seed=2).requires_grad_(False).eval()
    groups = sample_groups(model, tokenizer, n=3)
    scored = response_logprobs(
        teacher,
        [g.prompt_ids for g in groups for _ in g.completions],
        [c.token_ids for g in groups for c in g.completions],
        temperature=0.7,
        rows_per_pass=5,
    )
    tokens = [group_tokens(g) for g in groups]
    layout = LAYOUTS["packed"](tokens, tokenizer.pad_token_id)
    width = max(len(c.token_ids) for g in groups for c in g.completions)
    resp = torch.full((len(scored), width), tokenizer.pad_token_id)
    for b, c in enumerate(c for g in groups for c in g.completions):
        resp[b, : len(c.token_ids)] = torch.tensor(c.token_ids)
    with torch.no_grad():
        want, _ = token_logprobs(teacher, layout, resp, 0.7, False)
    assert any(scored)
    for b, row in enumerate(scored):
        assert row == pytest.approx(want[b, : len(row)].tolist(), abs=1e-5)
