"""verifiers episodes in a rollout worker, against the worker's own engine: the tokens a trace
holds are the ones the engine sampled for the sample's seeds, turn by turn; the learner gets the
engine's log-probs back on them; the environment's tokens take no part in the loss.

The environments are built in fixtures_verifiers.py from an in-memory data set: a single-turn
one (on the random tiny model) and a multi-turn one with verifiers' own tool server (on the
calculator warm start, which calls its tool)."""

import copy

import pytest
import torch

from cadence.engine import ContinuousEngine, Request, SamplingParams, derive_seed, derive_turn_seed
from cadence.envs import CALL_END, VerifiersEnv
from cadence.models import load_model, load_tokenizer
from cadence.rollout import RolloutWorker
from cadence.types import Prompt
from recording import recording_learner, train

RUN_SEED, ITERATION, GROUP = 7, 3, 3


def _prompts(factory: str, n: int) -> list[Prompt]:
    """The first `n` training tasks of the env's taskset, as the learner's stream gives them."""
    from cadence.envs.verifiers.env import TasksetTask

    stream = TasksetTask(factory, seed=0, num_heldout=1).train_iter()
    return [
        Prompt(f"t{i}", e.question, "", i, metadata=e.metadata)
        for i, e in zip(range(n), stream, strict=False)
    ]


def _rollout(model_dir, factory: str, max_new_tokens: int):
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,))
    engine = ContinuousEngine(model, tokenizer, max_num_seqs=8)
    worker = RolloutWorker(
        engine, tokenizer, None, params, GROUP, RUN_SEED, env=VerifiersEnv(factory)
    )
    try:
        groups = worker.rollout(_prompts(factory, 2), iteration=ITERATION, version=0)
    finally:
        worker.close()
    return model, tokenizer, params, groups


@pytest.fixture(scope="module")
def single_turn(model_dir):
    return _rollout(model_dir, "fixtures_verifiers:single_turn", 12)


@pytest.fixture(scope="module")
def multi_turn(calculator_model_dir):
    model, tokenizer, params, groups = _rollout(
        calculator_model_dir, "fixtures_verifiers:tool_env", 24
    )
    masks = [c.loss_mask for g in groups for c in g.completions]
    assert any(0 in m for m in masks), "no episode called its tool"
    return model, tokenizer, params, groups


def _turns(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of policy tokens: the model's turns."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _assert_engine_sampled_them(model, tokenizer, params, groups):
    """Each turn again, alone, from the trajectory before it, seeded as the worker seeds it:
    the engine gives the same tokens, and their log-probs."""
    engine = ContinuousEngine(model, tokenizer, max_num_seqs=1)
    turn_params = SamplingParams(
        max_new_tokens=params.max_new_tokens,
        stop_token_ids=params.stop_token_ids,
        stop=(CALL_END,),
    )
    for group in groups:
        for j, c in enumerate(group.completions):
            seed = derive_seed(RUN_SEED, ITERATION, group.prompt.index, j)
            assert len(c.token_ids) == len(c.logprobs) == len(c.loss_mask)
            for t, (a, b) in enumerate(_turns(c.loss_mask)):
                context = group.prompt_ids + c.token_ids[:a]
                request = Request(context, [derive_turn_seed(seed, t)])
                ((again,),) = engine.generate([request], turn_params)
                assert again.token_ids == c.token_ids[a:b]
                diff = max(abs(x - y) for x, y in zip(again.logprobs, c.logprobs[a:b], strict=True))
                assert diff <= 1e-5
            env_logprobs = [lp for lp, m in zip(c.logprobs, c.loss_mask, strict=True) if not m]
            assert all(lp == 0.0 for lp in env_logprobs)


def test_single_turn_episodes_hold_the_engines_tokens_for_their_seeds(single_turn):
    model, tokenizer, params, groups = single_turn
    assert [g.prompt.index for g in groups] == [0, 1]
    for g in groups:
        assert tokenizer.decode(g.prompt_ids) == g.prompt.text  # the task's prompt, rendered
        assert g.group_size == GROUP
        for c in g.completions:
            assert set(c.loss_mask) == {1} and c.episode.turns == 1
            assert c.reward in (0.0, 0.5, 1.0, 1.5) and c.reward_error is None
    assert len({tuple(c.token_ids) for g in groups for c in g.completions}) > 1
    _assert_engine_sampled_them(model, tokenizer, params, groups)


def test_tool_episodes_interleave_the_engines_turns_with_the_tools_results(multi_turn):
    model, tokenizer, params, groups = multi_turn
    called = [c for g in groups for c in g.completions if c.episode.tool_calls]
    assert called
    for c in called:
        assert 1 <= c.episode.tool_calls <= c.episode.turns <= 3
        assert c.episode.env_tokens == c.loss_mask.count(0) > 0
        assert "<result>" in c.text and "</call>" in c.text
    _assert_engine_sampled_them(model, tokenizer, params, groups)


def _learner(model, tokenizer, layout="prefix", **loss):
    return recording_learner(model, tokenizer, layout, 24, **loss)


@pytest.mark.parametrize("layout", ["unpacked", "prefix"])
@pytest.mark.parametrize("episodes", ["single_turn", "multi_turn"])
def test_the_learner_recomputes_the_behaviour_logprobs(episodes, layout, request):
    model, tokenizer, _, groups = request.getfixturevalue(episodes)
    learner, rec = _learner(copy.deepcopy(model), tokenizer, layout)
    train(learner, groups)
    for batch, group in zip(rec.batches, groups, strict=True):
        mask = batch.loss_mask.bool()
        want = [c.loss_mask + [0] * (mask.shape[1] - len(c.loss_mask)) for c in group.completions]
        assert torch.equal(mask, torch.tensor(want, dtype=torch.bool))
        diff = (batch.logprobs.detach() - batch.behaviour_logprobs)[mask].abs().max().item()
        assert diff <= 1e-5
        lengths = batch.loss_mask.new_tensor([len(c.token_ids) for c in group.completions])
        env = ~mask & (torch.arange(mask.shape[1]) < lengths[:, None])
        if episodes == "multi_turn" and env.any():
            assert batch.logprobs.grad[env].abs().max().item() == 0.0


def _grads(model, tokenizer, groups):
    learner, _ = _learner(copy.deepcopy(model), tokenizer, tis_cap=0.0)
    learner.version = 1  # stale: the recorded behaviour log-probs are the ratio's base
    grads = {}

    def keep(optimizer, args, kwargs):
        for n, p in learner.model.named_parameters():
            grads[n] = p.grad.detach().clone()

    learner.optimizer.register_step_pre_hook(keep)
    train(learner, groups)
    return grads


def _stale(groups):
    out = copy.deepcopy(groups)
    for g in out:
        g.policy_version = 0
    return out


def _perturbed(groups, trained_too=False):
    """Every environment token's recorded log-prob replaced by noise (and, `trained_too`, its
    mask dropped, as if it were the policy's)."""
    out = _stale(groups)
    gen = torch.Generator().manual_seed(0)
    for c in (c for g in out for c in g.completions):
        for t, m in enumerate(c.loss_mask):
            if m == 0:
                c.logprobs[t] = -5.0 * torch.rand((), generator=gen).item()
        if trained_too:
            c.loss_mask = None
    return out


def test_a_token_the_environment_wrote_gets_zero_gradient(multi_turn):
    # Stale groups take their recorded log-probs as the PPO ratio's base token by token, so the
    # loss reads every recorded log-prob it trains on: noise on the tool results' leaves the
    # gradient exactly as it was, and the same noise with the mask dropped moves it.
    model, tokenizer, _, groups = multi_turn
    base = _grads(model, tokenizer, _stale(groups))
    same = _grads(model, tokenizer, _perturbed(groups))
    assert all(torch.equal(base[n], same[n]) for n in base)
    moved = _grads(model, tokenizer, _perturbed(groups, trained_too=True))
    assert max((base[n] - moved[n]).abs().max().item() for n in base) > 1e-6
