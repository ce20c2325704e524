"""The producer's order: which prompts it draws, when, and with which version they are generated,
whatever the timing; and checkpoints as boundaries. The workers are in-process threads running
the real worker loop (`backend.fake.ThreadPool`); each sample's first token is the weight value
the worker read, and version k's weights hold the value k; prompts come from the arithmetic
task's stream."""

import dataclasses
import io
import random
import threading
import time

import pytest
import torch

from cadence.backend import SharedWeights
from cadence.backend.fake import ThreadPool
from cadence.data import ArithmeticTask
from cadence.engine import SamplingParams, ScriptedEngine, load_into
from cadence.metrics import Tracer
from cadence.pipeline import WorkerSource
from cadence.pipeline.behaviour import BehaviourPolicies
from cadence.pipeline.producer import ProducerParams
from cadence.pipeline.prompts import PromptStream
from cadence.pipeline.steporder import StepOrder
from cadence.rollout import RolloutWorker
from cadence.types import Group, Prompt

GROUP_SIZE = 3
PER_ITERATION = 4


def _pool(weights, seed):
    """Two worker threads, uneven random delays (another draw of them for every `seed`). A
    prompt whose text length is a multiple of 3 scores 1 on every sample (a constant group);
    the others score each sample by its seed's parity."""
    rng = random.Random(seed)

    def make_worker(wid):
        model = torch.nn.Linear(1, 1, bias=False)

        def script(ids, sample_seed):
            time.sleep(0.004 * rng.random())
            return [int(model.weight.item()), sample_seed % 2]

        def reward(prompt, response, answer):
            return 1.0 if len(prompt) % 3 == 0 else float(response.endswith("1"))

        worker = RolloutWorker(
            ScriptedEngine(script),
            tokenizer=lambda text, add_special_tokens: {"input_ids": [len(text)]},
            reward=reward,
            sampling=SamplingParams(max_new_tokens=4),
            group_size=GROUP_SIZE,
            run_seed=0,
        )
        return worker, lambda version: load_into(model, weights.tensors)

    return ThreadPool(make_worker, 2, weights)


TEMPLATE = "Q: {question}\nA: "


def _stream(**kwargs):
    return PromptStream(ArithmeticTask(difficulty=1, seed=0), TEMPLATE, "a", **kwargs)


def _run(params: ProducerParams, seed: int, stream=None, checkpoint_at=None, **source_kwargs):
    """Off-policy with dynamic sampling from `params.first_iteration` to `params.iterations`;
    returns the prompts drawn (in order), the groups trained [(iteration, group)], and what a
    checkpoint before iteration `checkpoint_at` holds (saved and loaded as state.pt is)."""
    policy = torch.nn.Linear(1, 1, bias=False)
    stream = stream or _stream()
    drawn: list[str] = []

    def next_prompts():
        batch = stream.next_batch(PER_ITERATION)
        drawn.extend(p.uid for p in batch)
        return batch

    def next_extra(index):
        prompt = stream.extra(index)
        drawn.append(prompt.uid)
        return prompt

    source = WorkerSource(
        _pool(SharedWeights(policy), seed),
        policy,
        Tracer(),
        next_prompts,
        params,
        stream=True,
        filter_groups=True,
        max_oversample=64,
        next_extra=next_extra,
        **source_kwargs,
    )
    trained, state = [], None
    rng = random.Random(seed)
    try:
        for k in range(params.first_iteration, params.iterations):
            if k == checkpoint_at:
                cursor, pending = stream.position(k)
                state = {
                    "cursor": cursor,
                    "pending_batches": pending,
                    "behaviour_policies": source.behaviour_policies(k),
                }
                buffer = io.BytesIO()
                torch.save(state, buffer)
                state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
            with torch.no_grad():
                policy.weight.fill_(float(k))  # version k's weights hold the value k
            source.start_iteration(k, version=k)
            for g in source.groups():
                time.sleep(0.003 * rng.random())  # the learner's forward/backward
                trained.append((k, g))
    finally:
        source.close()
    return drawn, trained, state


def _by_iteration(trained):
    return sorted((k, g.prompt.uid, g.policy_version) for k, g in trained)


@pytest.mark.parametrize("n", [1, 2])
def test_offpolicy_dynamic_sampling_draws_the_same_prompts_whatever_the_timing(n):
    params = ProducerParams(prompts_per_task=2, tasks_in_flight=2, max_staleness=n, iterations=6)
    runs = [_run(params, seed) for seed in range(3)]
    drawn, trained, _ = runs[0]
    assert len(drawn) > 6 * PER_ITERATION  # extra prompts were drawn
    for other_drawn, other_trained, _ in runs[1:]:
        assert other_drawn == drawn  # in the same order
        assert _by_iteration(other_trained) == _by_iteration(trained)
    for k, g in trained:
        # a batch is generated by the version that admitted it, an extra prompt by its own
        extra = g.prompt.index >= PER_ITERATION
        assert g.policy_version == (k if extra else max(k - n, 0)), (k, g.prompt.uid)
        assert {c.token_ids[0] for c in g.completions} == {g.policy_version}


@pytest.mark.parametrize(("n", "every"), [(1, 3), (2, 3), (3, 2)])
def test_a_source_resumed_from_a_checkpoint_generates_what_the_uninterrupted_one_did(n, every):
    at = 2 * every  # the second checkpoint: versions kept for the first were dropped since
    params = ProducerParams(2, 2, max_staleness=n, iterations=at + 3)
    _, full, state = _run(params, seed=0, checkpoint_at=at, checkpoint_every=every)
    assert len(state["pending_batches"]) >= 1  # the producer had run ahead of the checkpoint
    assert [b["version"] for b in state["behaviour_policies"]] == list(range(at - n, at))
    resumed_stream = _stream(start=state["cursor"], replay=state["pending_batches"])
    _, resumed, _ = _run(
        dataclasses.replace(params, first_iteration=at),
        seed=1,  # other timings
        stream=resumed_stream,
        checkpoint_every=every,
        behaviour=state["behaviour_policies"],
    )
    assert _by_iteration(resumed) == _by_iteration([(k, g) for k, g in full if k >= at])
    assert max(k - g.policy_version for k, g in resumed) == n  # stale, as they were
    for _, g in resumed:  # generated by the very weights of the version they claim
        assert {c.token_ids[0] for c in g.completions} == {g.policy_version}


def test_only_the_versions_a_later_checkpoint_needs_are_kept():
    kept = BehaviourPolicies(max_staleness=1, checkpoint_every=3, iterations=None)
    for v in range(7):  # checkpoint 3 needs version 2, checkpoint 6 version 5
        kept.published(v, torch.nn.Linear(1, 1, bias=False))
        assert sorted(kept.kept) == {2: [2], 5: [5]}.get(v, []), v
    assert kept.needed(3) == [2] and kept.needed(6) == [5]
    assert BehaviourPolicies(2, 3, iterations=7).needed(6) == [4]  # there is no iteration 7
    assert BehaviourPolicies(4, 3, iterations=None).needed(3) == [0, 1, 2]
    with pytest.raises(RuntimeError, match=r"checkpoint 9 needs the weights of versions \[8\]"):
        kept.state(9)


def test_producer_params_admission_and_checks():
    params = ProducerParams(prompts_per_task=1, tasks_in_flight=1, max_staleness=2)
    assert [params.admitting_version(k) for k in range(5)] == [0, 0, 0, 1, 2]
    assert not params.ends_before(10) and ProducerParams(1, 1, iterations=3).ends_before(3)
    with pytest.raises(ValueError, match="producer tasks_in_flight = 0: must be at least 1"):
        ProducerParams(prompts_per_task=1, tasks_in_flight=0)
    with pytest.raises(ValueError, match="producer max_staleness = -1: must be at least 0"):
        ProducerParams(prompts_per_task=1, tasks_in_flight=1, max_staleness=-1)


def _ordered_source(seed: int, **source_kwargs) -> WorkerSource:
    """Two workers with uneven delays (`_pool`), a task per prompt, two tasks in flight each:
    groups finish out of prompt order."""
    policy = torch.nn.Linear(1, 1, bias=False)
    stream = _stream()
    params = ProducerParams(
        prompts_per_task=1, tasks_in_flight=2, iterations=3, group_size=GROUP_SIZE
    )
    return WorkerSource(
        _pool(SharedWeights(policy), seed),
        policy,
        Tracer(),
        lambda: stream.next_batch(PER_ITERATION),
        params,
        **source_kwargs,
    )


@pytest.mark.parametrize("seed", range(3))
def test_a_sync_iteration_reaches_the_learner_in_prompt_order_whatever_the_finish_order(seed):
    # sync mode hands the learner the whole batch: cut into mini-batches in the order the
    # workers happened to finish, the update depended on their timing
    source = _ordered_source(seed, stream=False)
    try:
        for k in range(3):
            source.start_iteration(k, version=k)
            assert [g.prompt.index for g in source.groups()] == list(range(PER_ITERATION))
    finally:
        source.close()


@pytest.mark.parametrize("seed", range(3))
def test_periodic_steps_reach_the_learner_by_prompt_index_whatever_the_finish_order(seed):
    # periodic with 2 optimizer steps an iteration: step 1 must train prompts 0-1 and step 2
    # prompts 2-3, as sync's cut does, however the workers' timing orders their finishing
    source = _ordered_source(seed, stream=True, step_groups=2)
    try:
        for k in range(3):
            source.start_iteration(k, version=k)
            indices = [g.prompt.index for g in source.groups()]
            assert sorted(indices[:2]) == [0, 1] and sorted(indices[2:]) == [2, 3], indices
    finally:
        source.close()


def _arrived(index):
    return dataclasses.replace(_GROUP, prompt=dataclasses.replace(_GROUP.prompt, index=index))


_GROUP = Group(Prompt("u", "q", "a"), [1], [], 0, 0)


def test_step_order_releases_a_step_once_all_its_prompts_are_in():
    order = StepOrder(size=5, per_step=2)  # steps {0, 1}, {2, 3}, {4}
    released = [[g.prompt.index for g in order.offer(_arrived(i))] for i in (3, 1, 4, 0, 2)]
    assert released == [[], [], [], [1, 0], [3, 2, 4]]  # step 2 waited for step 1
    assert order.flush() == []
    # a group that never comes (dropped) holds the later steps until the iteration ends
    order = StepOrder(size=4, per_step=2)
    assert [order.offer(_arrived(i)) for i in (1, 2, 3)] == [[], [], []]
    assert [g.prompt.index for g in order.flush()] == [1, 2, 3]
    with pytest.raises(ValueError, match="per_step"):
        StepOrder(size=4, per_step=0)


def test_a_ctrl_c_while_the_producer_starts_leaves_a_source_that_closes(monkeypatch):
    """Ctrl-C can land inside `Thread.start()`, before the thread runs: closing the source then
    must not join a thread that never started ("cannot join thread before it is started")."""
    source = _ordered_source(0, stream=False)
    real_start = threading.Thread.start

    def interrupted(thread):
        raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", interrupted)
    with pytest.raises(KeyboardInterrupt):
        source.start_iteration(0, version=0)
    monkeypatch.setattr(threading.Thread, "start", real_start)
    source.close()  # raised RuntimeError before
