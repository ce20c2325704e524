"""The Scorer: one place for shaping, advantages and the `reinforce` baseline; it streams group by
group unless the estimator needs the whole batch, and its state is what exact resume needs."""

import pytest
import torch

from cadence.algo import AlgoParams, grpo_advantages, reinforce_pp_advantages
from cadence.learner import Scorer
from cadence.types import Completion, Group, Prompt


def _group(uid: str, rewards: list[float], lengths: list[int] | None = None) -> Group:
    lengths = lengths or [3] * len(rewards)
    completions = [
        Completion([1] * n, [-1.0] * n, reward=r, finish_reason="eos")
        for r, n in zip(rewards, lengths, strict=True)
    ]
    return Group(Prompt(uid, "", ""), [0], completions, 0, 0)


def _pulled(groups: list[Group], log: list[str]):
    for g in groups:
        log.append(g.prompt.uid)
        yield g


def test_the_baseline_is_the_previous_iterations_mean_shaped_reward():
    scorer = Scorer(AlgoParams(advantage="reinforce"))
    groups = [_group("a", [1.0]), _group("b", [0.0]), _group("c", [0.5])]
    first = [s.advantages.item() for s in scorer.score(groups)]
    assert first == [1.0, 0.0, 0.5]  # baseline 0 in the first iteration
    scorer.end_iteration()
    assert scorer.baseline == pytest.approx(0.5)  # (1 + 0 + 0.5) / 3
    second = [s.advantages.item() for s in scorer.score(groups)]
    assert second == pytest.approx([0.5, -0.5, 0.0])
    assert scorer.state() == {"baseline": pytest.approx(0.5)}


def test_a_restored_scorer_scores_as_the_one_it_was_saved_from():
    algo = AlgoParams(advantage="reinforce", overlong_buffer=2, max_policy_tokens=4)
    scorer = Scorer(algo)
    list(scorer.score([_group("a", [1.0, 0.0], [4, 1])]))
    figures = scorer.end_iteration()
    # shaped: 1 - 1 (4 tokens, at the cap) and 0: baseline (0 + 0) / 2 = 0, penalty mean -0.5
    assert figures["overlong_penalty_mean"] == pytest.approx(-0.5)
    assert figures["reward_shaped_mean"] == pytest.approx(0.0)
    list(scorer.score([_group("b", [3.0], [1])]))
    scorer.end_iteration()  # baseline 3
    restored = Scorer(algo)
    restored.load_state(scorer.state())
    group = [_group("c", [1.0, 2.0], [1, 1])]
    got = [s.advantages for s in restored.score(group)]
    want = [s.advantages for s in scorer.score(group)]
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(got[0], torch.tensor([-2.0, -1.0]), atol=0, rtol=0)


def test_a_group_estimator_streams_and_a_batch_estimator_waits_for_the_batch():
    groups = [_group("a", [1.0, 0.0], [2, 5]), _group("b", [1.0, 1.0])]
    log: list[str] = []
    streaming = Scorer(AlgoParams()).score(_pulled(groups, log))
    first = next(streaming)
    assert log == ["a"]  # handed on before the next group arrived
    torch.testing.assert_close(first.advantages, grpo_advantages(torch.tensor([[1.0, 0.0]]))[0])
    log.clear()
    batch = Scorer(AlgoParams(advantage="reinforce_pp")).score(_pulled(groups, log))
    first = next(batch)
    assert log == ["a", "b"]  # the whole iteration first: its statistics are the batch's
    want = reinforce_pp_advantages(torch.tensor([[1.0, 0.0]]), torch.tensor([[2, 5]]))[0]
    assert (first.advantages - want).abs().max() > 1e-3  # the batch's, not the group's own


def test_mask_truncated_keeps_a_cut_response_in_the_statistics_but_not_in_the_loss():
    group = _group("a", [1.0, 0.0, 0.0])
    group.completions[0].finish_reason = "length"
    scorer = Scorer(AlgoParams(mask_truncated=True))
    (scored,) = scorer.score([group])
    assert scored.trains.tolist() == [False, True, True]
    torch.testing.assert_close(scored.advantages, grpo_advantages(torch.tensor([[1.0, 0, 0]]))[0])
    assert scorer.end_iteration() == {"truncated_frac": pytest.approx(1 / 3)}


def test_an_unknown_estimator_is_refused_when_the_scorer_is_built():
    with pytest.raises(ValueError, match=r"unknown algo\.advantage 'gae'"):
        Scorer(AlgoParams(advantage="gae"))
