"""verifiers episodes that go wrong: a truncated trace stays truncated whatever its last token, an
episode that raised is one failed sample (reward 0, its error counted) and not a stopped run, a
non-finite reward never reaches the advantages. Traces are stand-ins with verifiers' fields."""

import concurrent.futures as cf
import math
from types import SimpleNamespace

import pytest

from cadence.engine import SamplingParams, ScriptedEngine
from cadence.envs import Budget, ScriptedEnv, replies
from cadence.rollout import RolloutWorker
from cadence.rollout.episodes import Finished
from cadence.rollout.verifiers import _outcome
from cadence.serve.engine_loop import EngineBroken
from cadence.types import Completion, Prompt

PROMPT = [5, 6, 7]


@pytest.fixture(autouse=True, scope="module")
def _verifiers():
    """verifiers (an extra) is imported when these tests run, not when they are collected."""
    pytest.importorskip("verifiers")


def _trace(tokenizer, sampled: list[int], truncated=False, reward=1.0):
    ids = PROMPT + sampled
    branch = SimpleNamespace(
        token_ids=ids,
        sampled_mask=[False] * len(PROMPT) + [True] * len(sampled),
        logprobs=[0.0] * len(PROMPT) + [-0.5] * len(sampled),
    )
    return SimpleNamespace(
        branches=[branch],
        is_truncated=truncated,
        ok=True,
        reward=reward,
        last_error=None,
        tool_messages=[],
        num_turns=1,
    )


def test_a_truncated_trace_is_length_though_its_last_token_is_eos(tokenizer):
    from cadence.envs.verifiers.env import group_completions

    eos = tokenizer.eos_token_id
    traces = [_trace(tokenizer, [40, 41, eos], truncated=True), _trace(tokenizer, [40, eos])]
    prompt, (cut, whole), _ = group_completions(traces, tokenizer)
    assert prompt == PROMPT
    assert cut.finish_reason == "length"  # algo.mask_truncated masks it, truncated_frac counts it
    assert whole.finish_reason == "eos"


def test_an_episode_that_raised_is_a_failed_sample_of_its_group(tokenizer):
    from cadence.envs.verifiers.env import group_completions

    eos = tokenizer.eos_token_id
    raised: cf.Future = cf.Future()
    raised.set_exception(ValueError("the sandbox died"))
    why = _outcome(raised)
    assert why == "verifiers: the episode raised ValueError: the sandbox died"
    traces = [_trace(tokenizer, [40, eos]), why]
    prompt, (ok, failed), rewards = group_completions(traces, tokenizer)
    assert prompt == PROMPT and rewards == [1.0, 0.0]
    assert ok.reward_error is None
    assert failed.reward_error == why and failed.loss_mask == [0]  # nothing of it is trained
    # no episode left a trace: the group still comes back, every sample failed
    prompt, completions, rewards = group_completions([why, why], tokenizer)
    assert prompt is None and rewards == [0.0, 0.0]
    assert [c.reward_error for c in completions] == [why, why]
    # the endpoint stopping under an episode is the run's failure, not the environment's
    broken: cf.Future = cf.Future()
    broken.set_exception(EngineBroken("the rollout worker stopped"))
    with pytest.raises(EngineBroken):
        _outcome(broken)


class _Episodes:
    """Hands back one finished group whose environment rewards are given."""

    def __init__(self, engine, rewards, tokenizer) -> None:
        self.engine, self.spans, self.rewards = engine, [], rewards
        self.eos, self.pending = tokenizer.eos_token_id, []

    busy = property(lambda self: bool(self.pending))

    def add(self, key, prompt, prompt_ids, seeds):
        self.pending.append(key)
        return prompt_ids

    def step(self):
        out = []
        for key in self.pending:
            completions = [
                Completion([40, self.eos], [-0.5, -0.5], "a", "eos") for _ in self.rewards
            ]
            out.append(Finished(key, completions, list(self.rewards)))
        self.pending = []
        return out

    def close(self) -> None:
        pass


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_environment_reward_is_a_counted_error(tokenizer, bad):
    engine = ScriptedEngine(lambda ids, seed: [40])
    params = SamplingParams(max_new_tokens=4)
    env = ScriptedEnv(replies(), Budget(1, 16))
    worker = RolloutWorker(engine, tokenizer, None, params, 2, run_seed=5, env=env)
    worker.episodes = _Episodes(worker.engine, [1.0, bad], tokenizer)
    (group,) = worker.rollout([Prompt("rows:0", "q", "#### 1", 0)], 0, 0)
    assert group.rewards == [1.0, 0.0]
    assert group.completions[0].reward_error is None
    assert group.completions[1].reward_error == f"environment: non-finite reward {bad}"
