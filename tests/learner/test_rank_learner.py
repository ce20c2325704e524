"""Learner ranks without the pipeline: two FSDP2 ranks (spawned processes, gloo) driven by
`RankedLearner` on fixed scored groups make the single-process `Learner`'s update, with online
DPO's pair normaliser, a rank that has no group for a whole optimizer step, and two teachers
whose tasks fall on different ranks."""

import copy
import dataclasses
import math
from dataclasses import replace

import pytest
import torch

from cadence.algo import CORRECTION_FIGURES, AlgoParams
from cadence.engine import HFEngine, SamplingParams
from cadence.learner import Learner, LearnerParams, score
from cadence.learner.distill import DistillParams, Teachers
from cadence.learner.driver import start_local_ranks
from cadence.learner.rank import RankSpec
from cadence.metrics import Tracer
from cadence.models import load_model, load_tokenizer, save_pretrained
from cadence.rollout import RolloutWorker
from cadence.types import Prompt
from tiny_models import perturbed
from updates import assert_same_params, capture_grads

pytestmark = pytest.mark.slow


def test_two_ranks_make_the_one_process_update_with_a_rank_idle_for_a_whole_step(
    model_dir, tokenizer
):
    model = load_model(model_dir)
    groups = _groups(model, tokenizer, n=5)  # five groups in three steps: 2, 2 and 1
    assert any(len(set(g.rewards)) > 1 for g in groups)  # preference pairs to learn from
    params = LearnerParams(lr=1e-3, micro_batch_groups=1, mini_batches=3)
    algo = AlgoParams(max_policy_tokens=10, loss="online_dpo", kl_coef=0.0)
    one = Learner(copy.deepcopy(model), params, algo, tokenizer.pad_token_id, frozen(model))
    grads = capture_grads(one)
    spec = RankSpec(str(model_dir), params, algo, tokenizer.pad_token_id, 2)
    ranked = start_local_ranks(spec, copy.deepcopy(model), Tracer())
    try:
        for _ in range(2):
            fresh = score([replace(g, policy_version=one.version) for g in groups], algo)
            want = one.train_iteration(iter(fresh), len(fresh))
            got = ranked.train_iteration(iter(fresh), len(fresh))
            # the pairs of every rank are counted, and the loss is their mean over all of them
            assert got["num_pairs"] == want["num_pairs"] > 0
            assert got["dpo_ties"] == want["dpo_ties"]
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
            assert got["optimizer_steps"] == want["optimizer_steps"] == 3
            # step 1's two groups, one per rank: the max over ranks (a sum would be larger),
            # the mean over both ranks' tokens; float noise in iteration 1 (sampled by these
            # weights), not in iteration 2 (the policy has moved, the samples have not)
            for name in ("behaviour_logprob_abs_diff_max", "behaviour_logprob_abs_diff_mean"):
                assert got[name] == pytest.approx(want[name], rel=1e-4, abs=1e-6)
            assert (want["behaviour_logprob_abs_diff_max"] < 1e-4) == (one.version == 1)
    finally:
        ranked.close()
    _assert_same_model(ranked, one, grads)
    want_params = dict(one.model.named_parameters())
    moved = max((want_params[k] - p).abs().max().item() for k, p in model.named_parameters())
    assert moved > 1e-4


def test_two_ranks_make_the_one_process_update_with_a_batch_wide_advantage(model_dir, tokenizer):
    # REINFORCE++ normalises over the whole batch: the scorer scores every group before the
    # ranks get their shares, so each rank trains the advantages a single process would
    model = load_model(model_dir)
    algo = AlgoParams(max_policy_tokens=10, advantage="reinforce_pp", kl_coef=0.0)
    groups = score(_groups(model, tokenizer, n=4), algo)
    params = LearnerParams(lr=1e-3, micro_batch_groups=1)
    one = Learner(copy.deepcopy(model), params, algo, tokenizer.pad_token_id)
    grads = capture_grads(one)
    spec = RankSpec(str(model_dir), params, algo, tokenizer.pad_token_id, 2)
    ranked = start_local_ranks(spec, copy.deepcopy(model), Tracer())
    try:
        want = one.train_iteration(iter(groups), len(groups))
        got = ranked.train_iteration(iter(groups), len(groups))
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    finally:
        ranked.close()
    _assert_same_model(ranked, one, grads)


def test_two_ranks_report_the_rollout_correction_figures_of_one_process(model_dir, tokenizer):
    # each rank sums its tokens' ratios and keeps its largest; the ranks add and compare them,
    # so the figures are those of the whole batch, not a mean of the ranks' own
    model = load_model(model_dir)
    groups = _groups(model, tokenizer, n=4)
    for g, delta in zip(groups, (0.5, 1.0, 0.2, 0.8), strict=True):
        for c in g.completions:  # as if older weights had sampled: rho = e^delta
            c.logprobs = [lp - delta for lp in c.logprobs]
    algo = AlgoParams(
        max_policy_tokens=10, kl_coef=0.0, rollout_correction="token_mask", correction_clip_max=2.0
    )
    scored = score(groups, algo)
    params = LearnerParams(lr=1e-3, micro_batch_groups=1)
    one = Learner(copy.deepcopy(model), params, algo, tokenizer.pad_token_id)
    spec = RankSpec(str(model_dir), params, algo, tokenizer.pad_token_id, 2)
    ranked = start_local_ranks(spec, copy.deepcopy(model), Tracer())
    try:
        want = one.train_iteration(iter(scored), len(scored))
        got = ranked.train_iteration(iter(scored), len(scored))
    finally:
        ranked.close()
    assert want["rollout_is_min"] == pytest.approx(math.exp(0.2), rel=1e-5)
    assert want["rollout_is_max"] == pytest.approx(math.e, rel=1e-5)
    assert 0 < want["rollout_rs_masked_fraction"] < 1  # e^1 is outside [0, 2], e^0.8 inside
    for name in CORRECTION_FIGURES:
        assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-7), name


def frozen(model):
    return copy.deepcopy(model).requires_grad_(False)


def _groups(model, tokenizer, n):
    """`n` groups of four responses sampled by `model`, rewarded for being short."""
    params = SamplingParams(max_new_tokens=10, stop_token_ids=(tokenizer.eos_token_id,))
    worker = RolloutWorker(
        HFEngine(model, tokenizer),
        tokenizer,
        lambda prompt, completion, answer: float(len(completion) < 20),
        params,
        4,
        run_seed=3,
    )
    prompts = [
        Prompt(f"p{i}", f"Question: What is {i} + {i}?\nAnswer: ", "#### 0", i) for i in range(n)
    ]
    return worker.rollout(prompts, iteration=0, version=0)


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_two_mixed_precision_ranks_make_the_one_process_mixed_update(
    model_dir, tokenizer, strategy
):
    # bf16 compute, float32 masters: FSDP2's MixedPrecisionPolicy (float32 shards, bf16 passes,
    # gradients reduced in float32) and DDP's float32 all-reduce into float32 masters against
    # one process's masters. Each micro-batch is one group on both sides, so every bf16 gradient
    # is the same; only the order of the float32 sums differs.

    from cadence.learner.precision import Masters

    model = load_model(model_dir)
    groups = _groups(model, tokenizer, n=4)
    algo = AlgoParams(max_policy_tokens=10, kl_coef=0.0)
    params = LearnerParams(lr=1e-3, micro_batch_groups=1)
    policy = copy.deepcopy(model)
    one = Learner(
        policy, params, algo, tokenizer.pad_token_id, masters=Masters.split(policy, torch.bfloat16)
    )
    spec = RankSpec(
        str(model_dir), params, algo, tokenizer.pad_token_id, 2, strategy, dtype="bfloat16"
    )
    driver = copy.deepcopy(model).to(torch.bfloat16)
    ranked = start_local_ranks(spec, driver, Tracer())
    try:
        for _ in range(2):
            fresh = score([replace(g, policy_version=one.version) for g in groups], algo)
            want = one.train_iteration(iter(fresh), len(fresh))
            got = ranked.train_iteration(iter(fresh), len(fresh))
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    finally:
        ranked.close()
    want_params = dict(one.model.named_parameters())
    got_params = dict(ranked.model.named_parameters())
    equal = sum(int(torch.eq(got_params[k], w).sum()) for k, w in want_params.items())
    total = sum(w.numel() for w in want_params.values())
    assert equal / total > 0.999  # a float32 sum in another order rounds to bf16 alike
    ulp = max(  # and where it does not, by one bf16 ulp at most
        ((got_params[k].float() - w.float()).abs() / w.float().abs().clamp(min=1e-30)).max().item()
        for k, w in want_params.items()
    )
    assert ulp <= 2**-7
    moved = max(
        (want_params[k].float() - p).abs().max().item() for k, p in model.named_parameters()
    )
    assert moved > 1e-4


def test_two_ranks_with_a_token_budget_make_the_one_process_update(model_dir, tokenizer):
    # groups split across micro-batches by a token budget, one packed micro-batch a rank a round,
    # in the padding-free layout against one process's prefix layout
    model = load_model(model_dir)
    groups = score(_groups(model, tokenizer, n=4), AlgoParams(max_policy_tokens=10))
    algo = AlgoParams(max_policy_tokens=10, kl_coef=0.0)
    one = Learner(
        copy.deepcopy(model),
        LearnerParams(lr=1e-3, micro_batch_groups=4),
        algo,
        tokenizer.pad_token_id,
    )
    grads = capture_grads(one)
    params = LearnerParams(lr=1e-3, micro_batch_tokens=20, shared_prompt_impl="packed")
    spec = RankSpec(str(model_dir), params, algo, tokenizer.pad_token_id, 2)
    ranked = start_local_ranks(spec, copy.deepcopy(model), Tracer())
    try:
        want = one.train_iteration(iter(groups), len(groups))
        got = ranked.train_iteration(iter(groups), len(groups))
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
        assert got["tokens_computed"] > want["tokens_computed"]  # groups were split
    finally:
        ranked.close()
    _assert_same_model(ranked, one, grads)


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_two_ranks_distil_from_a_teacher_per_task_as_one_process_does(
    model_dir, tokenizer, tmp_path, strategy
):
    # task a's teacher is another model, task b's the student itself; the two tasks' groups
    # fall on different ranks in a round and one rank idles a whole step, so sharded teachers
    # must make the same passes on every rank whatever their rows' tasks
    model = load_model(model_dir)
    other = perturbed(model, 3, 0.05)
    save_pretrained(other, load_tokenizer(model_dir), tmp_path / "a")
    groups = _groups(model, tokenizer, n=3)
    for g, task in zip(groups, "aba", strict=True):
        g.prompt = dataclasses.replace(g.prompt, task=task)
    algo = AlgoParams(max_policy_tokens=10, loss="pg", loss_agg="token-mean", kl_coef=0.0)
    groups = score(groups, algo)
    params = LearnerParams(lr=1e-2, micro_batch_groups=1, mini_batches=2)
    distill = DistillParams(coef=1.0, reward_coef=0.5)
    frozen = {"a": other.requires_grad_(False), "b": copy.deepcopy(model).requires_grad_(False)}
    one = Learner(
        copy.deepcopy(model), params, algo, tokenizer.pad_token_id,
        teachers=Teachers(frozen, distill),
    )  # fmt: skip
    grads = capture_grads(one)
    teachers = (("a", str(tmp_path / "a")), ("b", str(model_dir)))
    spec = RankSpec(
        str(model_dir), params, algo, tokenizer.pad_token_id, 2, strategy=strategy,
        teachers=teachers, distill=distill,
    )  # fmt: skip
    ranked = start_local_ranks(spec, copy.deepcopy(model), Tracer())
    try:
        want = one.train_iteration(iter(groups), len(groups))
        got = ranked.train_iteration(iter(groups), len(groups))
    finally:
        ranked.close()
    assert want["distill_reverse_kl/a"] > 1e-3
    for name in ("loss", "distill_reverse_kl", "distill_reverse_kl/a", "distill_reverse_kl/b"):
        assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-7), name
    _assert_same_model(ranked, one, grads)


def _assert_same_model(ranked, one, grads) -> None:
    """The ranks' gathered parameters are the one process's, where its steps were
    well-conditioned (tests/updates.py)."""
    want_params = {k: v.detach() for k, v in one.model.named_parameters()}
    got_params = {k: v.detach() for k, v in ranked.model.named_parameters()}
    assert_same_params(got_params, want_params, grads)
