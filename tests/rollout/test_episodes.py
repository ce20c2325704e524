"""Multi-turn episodes in the rollout worker: token-exact trajectories, budgets, tools that fail
without failing anything else, and an engine that keeps decoding while episodes wait."""

import queue
import threading
import time

import pytest
import torch

import fixtures_tools
from cadence.backend import WorkerLoop
from cadence.engine import (
    ContinuousEngine,
    SamplingParams,
    ScriptedEngine,
    derive_seed,
    derive_turn_seed,
    load_into,
)
from cadence.envs import Budget, EnvReply, ScriptedEnv, SingleTurnEnv, ToolEnv, load_tools, replies
from cadence.metrics import sample_figures
from cadence.rollout import RolloutWorker
from cadence.types import Prompt

PROMPTS = [Prompt(f"p{i}", f"Question: What is {i} + 2?\nAnswer: ", "#### 0", i) for i in range(2)]


def _encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _seeds(prompt_index=0, group_size=2, turns=4):
    """Turn seed -> (sample, turn) of the samples of one prompt (run seed 5, iteration 0)."""
    return {
        derive_turn_seed(derive_seed(5, 0, prompt_index, j), t): (j, t)
        for j in range(group_size)
        for t in range(turns)
    }


def _worker(tokenizer, script, env, group_size=2, max_new_tokens=8, reward=None):
    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    engine = ScriptedEngine(script, logprob=-0.5, decode=decode)
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,))
    reward = reward or (lambda prompt, completion, answer: float("#### 7" in completion))
    return RolloutWorker(engine, tokenizer, reward, params, group_size, run_seed=5, env=env)


def test_a_trajectory_is_the_token_sequence_the_engine_saw(tokenizer):
    turn_ids = [[40, 41, 42], [43, 44], [45, 46, 47, 48]]
    table, seen = _seeds(), []

    def script(ids, seed):
        seen.append((list(ids), *table[seed]))
        return turn_ids[table[seed][1]]

    env = ScriptedEnv(replies(" R1", " R22"), Budget(max_turns=3, max_total_tokens=100))
    (group,) = _worker(tokenizer, script, env).rollout(PROMPTS[:1], iteration=0, version=0)
    prompt = _encode(tokenizer, PROMPTS[0].text)
    r1, r2 = _encode(tokenizer, " R1"), _encode(tokenizer, " R22")
    want = [*turn_ids[0], *r1, *turn_ids[1], *r2, *turn_ids[2]]
    ends = [0, 3 + len(r1), 3 + len(r1) + 2 + len(r2)]  # where each turn's prompt stops
    for j, c in enumerate(group.completions):
        assert c.token_ids == want  # tokens as sampled and replies as tokenised, never re-encoded
        assert c.loss_mask == [1] * 3 + [0] * len(r1) + [1] * 2 + [0] * len(r2) + [1] * 4
        assert c.logprobs == [-0.5 if m else 0.0 for m in c.loss_mask]
        texts = [tokenizer.decode(turn_ids[0]), " R1", tokenizer.decode(turn_ids[1]), " R22"]
        assert c.text == "".join([*texts, tokenizer.decode(turn_ids[2])])
        assert (c.episode.turns, c.episode.env_tokens, c.episode.tool_calls) == (
            3,
            len(r1) + len(r2),
            0,
        )
        # turn t of sample j: seeded by derive_turn_seed(sample seed, t), prompted with all so far
        mine = sorted((t, ids) for ids, jj, t in seen if jj == j)
        assert [t for t, _ in mine] == [0, 1, 2]
        assert [ids for _, ids in mine] == [prompt + want[:end] for end in ends]
    # the environment read every turn, the last that max_turns allows too; not done after it,
    # the episode was cut off
    assert env.episodes[0].turns == [tokenizer.decode(t) for t in turn_ids]
    assert {c.finish_reason for c in group.completions} == {"length"}


def test_single_turn_env_through_episodes_equals_the_single_turn_path(model, tokenizer):
    params = SamplingParams(max_new_tokens=12, stop_token_ids=(tokenizer.eos_token_id,))
    reward = lambda prompt, completion, answer: float(len(completion))  # noqa: E731
    got = []
    for env in (None, SingleTurnEnv()):
        engine = ContinuousEngine(model, tokenizer, max_num_seqs=5)
        worker = RolloutWorker(engine, tokenizer, reward, params, 3, run_seed=11, env=env)
        got.append(worker.rollout(PROMPTS, iteration=2, version=0))
    for plain, episodic in zip(*got, strict=True):
        for a, b in zip(plain.completions, episodic.completions, strict=True):
            assert a.token_ids == b.token_ids and a.text == b.text and a.reward == b.reward
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-5
            assert b.loss_mask == [1] * len(b.token_ids) and b.episode.turns == 1


def test_budgets_end_episodes(tokenizer):
    chatty = ScriptedEnv(lambda prompt, turn, text: EnvReply(" more"), Budget(2, 100))
    (group,) = _worker(tokenizer, lambda ids, seed: [40, 41], chatty).rollout(PROMPTS[:1], 0, 0)
    assert all(c.episode.turns == 2 and len(c.token_ids) == 4 + 1 for c in group.completions)
    # 12 tokens after the prompt at most: turns are cut to the room left, a reply that leaves no
    # room for the policy is not appended
    tight = ScriptedEnv(lambda prompt, turn, text: EnvReply(" more"), Budget(10, 12))
    worker = _worker(tokenizer, lambda ids, seed: [40, 41, 42, 43, 44], tight)
    (group,) = worker.rollout(PROMPTS[:1], 0, 0)
    for c in group.completions:  # 5 + 1 + 5 = 11, then the reply would leave no room
        assert len(c.token_ids) == 11 and c.finish_reason == "length"
        assert c.loss_mask == [1] * 5 + [0] + [1] * 5
    # EOS ends an episode whatever its environment would say
    eos = tokenizer.eos_token_id
    (group,) = _worker(tokenizer, lambda ids, seed: [40, eos], chatty).rollout(PROMPTS[:1], 0, 0)
    assert all(c.episode.turns == 1 and c.finish_reason == "eos" for c in group.completions)


def _tool_worker(tokenizer, calls, timeout_s=0.3, group_size=3):
    """Sample j of prompt i calls calls[i][j] first, then answers "#### 7"."""
    tables = [_seeds(i, group_size) for i in range(len(calls))]

    def script(ids, seed):
        i = next(i for i, t in enumerate(tables) if seed in t)
        j, turn = tables[i][seed]
        text = calls[i][j] if turn == 0 else "\n#### 7"
        return _encode(tokenizer, text) + ([tokenizer.eos_token_id] if turn else [])

    tools = load_tools(
        ["calculator", *(f"fixtures_tools:{n}" for n in ("boom", "garbage", "hang"))]
    )
    env = ToolEnv(tools, Budget(3, 100), timeout_s=timeout_s)
    return _worker(tokenizer, script, env, group_size=group_size, max_new_tokens=32)


def test_a_tool_that_raises_returns_garbage_or_hangs_costs_its_episode_a_turn(tokenizer):
    fixtures_tools.RELEASE.clear()
    calls = ["<call>boom: 1</call>", "<call>garbage: 1</call>", "<call>hang: 1</call>"]
    worker = _tool_worker(tokenizer, [calls])
    (group,) = worker.rollout(PROMPTS[:1], 0, 0)
    replies_seen = [
        "<result>error: RuntimeError: boom on '1'</result>",
        "<result>error: garbage returned dict, not str</result>",
        "<result>error: hang timed out after 0.3s</result>",
    ]
    for c, call, reply in zip(group.completions, calls, replies_seen, strict=True):
        assert c.text == f"{call}{reply}\n#### 7"  # the policy read the error and answered
        assert (c.episode.turns, c.episode.tool_calls, c.episode.tool_errors) == (2, 1, 1)
        assert c.reward == 1.0 and c.finish_reason == "eos"
    assert [c.episode.tool_timeouts for c in group.completions] == [0, 0, 1]
    figures = sample_figures([group], version=0, max_staleness=0)
    assert (figures["tool_calls"], figures["tool_errors"], figures["tool_timeouts"]) == (3, 3, 1)
    assert figures["turns_mean"] == 2.0 and figures["env_s"] >= 0.3
    assert 0 < figures["env_token_frac"] < 1
    assert figures["trained_token_frac"] == pytest.approx(1 - figures["env_token_frac"])
    assert [name for name, _, _ in worker.take_spans()] == ["tool"] * 3
    # the worker goes on: the next rollout works as ever
    (again,) = worker.rollout(PROMPTS[:1], 0, 0)
    assert [c.text for c in again.completions] == [c.text for c in group.completions]
    fixtures_tools.RELEASE.set()


def test_other_episodes_decode_while_one_waits_on_a_tool(tokenizer):
    fixtures_tools.RELEASE.clear()
    worker = _tool_worker(
        tokenizer,
        [["<call>hang: 1</call>"] * 2, ["<call>calculator: 3 + 4</call>"] * 2],
        timeout_s=1.0,
        group_size=2,
    )
    start = time.perf_counter()
    worker.submit("t", PROMPTS, iteration=0, version=0)
    arrived = {}
    while worker.busy:
        for _, group in worker.poll():
            arrived[group.prompt.index] = time.perf_counter() - start
        if arrived.get(1) is not None and 0 not in arrived:
            assert worker.busy  # an episode waiting on its tool keeps the worker busy
    fixtures_tools.RELEASE.set()
    # prompt 1's episodes called the calculator and answered (two turns) while prompt 0's
    # waited on a hung tool: its group came out long before the hung calls were cut off
    assert arrived[1] < 0.5 <= 1.0 <= arrived[0]


def test_a_worker_loads_no_weights_while_an_episode_waits_on_a_tool(tokenizer):
    fixtures_tools.RELEASE.clear()
    worker = _tool_worker(tokenizer, [["<call>hang: 1</call>"] * 2], timeout_s=0.5, group_size=2)
    model = torch.nn.Linear(2, 2)
    tensors = {n: torch.full_like(p, 7.0) for n, p in model.named_parameters()}
    inbox, outbox = queue.Queue(), queue.Queue()
    loop = WorkerLoop(0, worker, lambda version: load_into(model, tensors), inbox, outbox)
    for message in [("sync", (0, None)), ("rollout", (0, PROMPTS[:1], 0)), ("sync", (1, None))]:
        inbox.put(message)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    got = [outbox.get(timeout=30) for _ in range(4)]
    inbox.put(("stop", None))
    thread.join(timeout=30)
    fixtures_tools.RELEASE.set()
    kinds = [(kind, payload if kind == "ack" else payload.task_id) for kind, _, payload in got[1:]]
    assert kinds == [("ack", 0), ("groups", 0), ("ack", 1)]  # the sync waited for the episode
    (result,) = [p for kind, _, p in got if kind == "groups"]
    assert [g.policy_version for g in result.groups] == [0]
    assert [name for name, _, _ in result.spans] == ["tool", "tool"]  # for the timeline
