"""The learner on multi-turn trajectories: policy tokens get the engine's log-probs back, and
environment tokens take no part in the loss."""

import copy

import pytest
import torch

from cadence.algo import AlgoParams, reinforce_pp_advantages
from cadence.builder import algo_params
from cadence.config import ConfigError, load_config
from cadence.engine import ContinuousEngine, SamplingParams
from cadence.envs import Budget, ScriptedEnv, replies
from cadence.learner import Scorer
from cadence.models import load_model, load_tokenizer
from cadence.rollout import RolloutWorker
from cadence.types import Completion, Group, Prompt
from recording import recording_learner, train


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


def _learner(model, tokenizer, layout="prefix", **loss):
    return recording_learner(model, tokenizer, layout, 6, **loss)


@pytest.mark.parametrize("layout", ["unpacked", "dense", "prefix", "packed"])
def test_policy_token_logprobs_from_the_learner_equal_the_engines(episodes, layout):
    model, tokenizer, groups = episodes
    learner, rec = _learner(copy.deepcopy(model), tokenizer, layout)
    train(learner, groups)
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
    train(learner, groups)
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


# --- shaping measures the tokens the policy wrote, against the episode's cap -------------------


def _correct_episodes(reward_b=1.0):
    """Two correct answers of 30 policy tokens: one written straight, one split around a
    40-token tool reply (15 policy tokens, the reply, 15 more)."""
    plain = Completion([5] * 30, [-1.0] * 30, reward=1.0, finish_reason="eos", loss_mask=[1] * 30)
    mask = [1] * 15 + [0] * 40 + [1] * 15
    tool = Completion([5] * 70, [-1.0] * 70, reward=reward_b, finish_reason="eos", loss_mask=mask)
    return Group(Prompt("p", "", "", 0), [1, 2, 3], [plain, tool], 0, 0)


def test_a_tool_reply_does_not_count_against_the_policy_in_the_overlong_penalty():
    # Before: the penalty measured the whole trajectory (70 tokens) against the per-turn
    # rollout.max_new_tokens (32 here): the tool user got -1, advantages -0.707 / +0.707.
    cfg = load_config(
        None,
        [
            "env.kind='tool'",
            "env.max_turns=4",
            "rollout.max_new_tokens=32",
            "reward.overlong_buffer=16",
        ],
    )
    algo = algo_params(cfg)
    (scored,) = Scorer(algo).score([_correct_episodes()])
    torch.testing.assert_close(scored.advantages, torch.zeros(2), atol=0, rtol=0)
    torch.testing.assert_close(scored.rewards, torch.tensor([1.0, 1.0]), atol=0, rtol=0)
    assert algo.max_policy_tokens == 4 * 32  # the episode's cap: 4 turns of 32 within 256


def test_reinforce_pp_weighs_each_response_by_the_tokens_the_policy_wrote():
    scorer = Scorer(AlgoParams(max_policy_tokens=128, advantage="reinforce_pp"))
    groups = [_correct_episodes(reward_b=0.0), _correct_episodes(reward_b=1.0)]
    got = torch.stack([s.advantages for s in scorer.score(groups)])  # (2, 2)
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    want = reinforce_pp_advantages(rewards, torch.full((2, 2), 30))  # 30 policy tokens each
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    trajectory = reinforce_pp_advantages(rewards, torch.tensor([[30, 70], [30, 70]]))
    assert (got - trajectory).abs().max() > 1e-2  # counting tool tokens would differ


def test_the_episode_cap_is_the_turns_budget_or_the_token_budget_whichever_is_smaller():
    single = load_config(None, ["rollout.max_new_tokens=24"])
    assert single.max_policy_tokens == 24 == algo_params(single).max_policy_tokens
    tool = ["env.kind='tool'", "rollout.max_new_tokens=32", "env.max_turns=3"]
    assert load_config(None, tool).max_policy_tokens == 96
    capped = load_config(None, [*tool, "env.max_total_tokens=64"])
    assert capped.max_policy_tokens == 64 == algo_params(capped).max_policy_tokens
    with pytest.raises(ConfigError, match=r"set reward.overlong_buffer <= 64"):
        load_config(None, [*tool, "env.max_total_tokens=64", "reward.overlong_buffer=65"])
