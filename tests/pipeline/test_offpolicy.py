"""Off-policy asynchrony: admission by version, exact staleness, atomic weight updates.

The producer and the worker loop are the real ones; the worker processes are threads running
`WorkerLoop` (`backend.fake.ThreadPool`) with a scripted engine whose every token is the value of
the weights it reads at that moment (`weight = version`), with random per-sample delays and one
slow worker.
"""

import random
import time

import pytest
import torch

from cadence.backend import SharedWeights, WorkerDied
from cadence.backend.fake import ThreadPool, WorkerKilled
from cadence.engine import SamplingParams, ScriptedEngine, load_into
from cadence.metrics import Tracer
from cadence.pipeline import WorkerSource
from cadence.pipeline.loop import within_staleness
from cadence.pipeline.producer import ProducerParams
from cadence.rollout import RolloutWorker
from cadence.types import Prompt

GROUP_SIZE = 3


def _pool(weights, slowness, seed=0, die_after=None):
    """In-process worker threads (the real loop) whose scripted engine emits, per sample, the
    weight value it reads at two moments; uneven delays, one worker slower.

    `die_after[wid] = n`: the first worker in slot `wid` dies after generating n samples."""
    die_after = dict(die_after or {})
    started = [0]

    def make_worker(wid):
        model = torch.nn.Linear(1, 1, bias=False)
        rng = random.Random(seed * 100 + wid + 10 * started[0])
        started[0] += 1
        slow, left = slowness[wid], [die_after.pop(wid, -1)]

        def script(ids, seed):
            left[0] -= 1
            if left[0] == 0:
                raise WorkerKilled
            time.sleep(slow * rng.random())  # uneven lengths, one worker slower
            first = model.weight.item()
            time.sleep(slow * rng.random())
            return [int(first), int(model.weight.item())]  # weights read twice per sample

        worker = RolloutWorker(
            ScriptedEngine(script),
            tokenizer=lambda text, add_special_tokens: {"input_ids": [len(text)]},
            reward=lambda prompt, response, answer: 1.0,
            sampling=SamplingParams(max_new_tokens=4),
            group_size=GROUP_SIZE,
            run_seed=0,
        )
        return worker, lambda version: load_into(model, weights.tensors)

    return ThreadPool(make_worker, len(slowness), weights)


def _run(max_staleness: int, iterations: int, prompts_per_iteration: int = 6, seed: int = 0):
    """A learner at version k trains iteration k; returns [(iteration, group)] as consumed."""
    return _run_source(max_staleness, iterations, prompts_per_iteration, seed)[0]


def _run_source(
    max_staleness: int,
    iterations: int,
    prompts_per_iteration: int = 6,
    seed: int = 0,
    die_after: dict[int, int] | None = None,
    max_worker_restarts: int = 0,
    queue_size: int = 0,
):
    """`_run`, also returning the source (for its restart and duplicate counts)."""
    policy = torch.nn.Linear(1, 1, bias=False)
    weights = SharedWeights(policy)
    pool = _pool(weights, slowness=[0.002, 0.006], seed=seed, die_after=die_after)
    counter = iter(range(10**6))

    def next_prompts():
        return [
            Prompt(f"p{n}", "x" * (n % 5 + 1), "1", index=i)
            for i, n in zip(range(prompts_per_iteration), counter, strict=False)
        ]

    source = WorkerSource(
        pool,
        policy,
        Tracer(),
        next_prompts,
        ProducerParams(
            prompts_per_task=2,
            tasks_in_flight=2,
            max_staleness=max_staleness,
            iterations=iterations,
            max_worker_restarts=max_worker_restarts,
            queue_size=queue_size,
        ),
        stream=True,
    )
    consumed = []
    rng = random.Random(seed)
    try:
        for k in range(iterations):
            with torch.no_grad():
                policy.weight.fill_(float(k))  # version k's weights hold the value k
            source.start_iteration(k, version=k)
            seen, dropped = [], []
            for g in within_staleness(source.groups(), k, max_staleness, seen, dropped):
                time.sleep(0.004 * rng.random())  # the learner's forward/backward
                consumed.append((k, g))
            assert not dropped and len(seen) == prompts_per_iteration
    finally:
        source.close()
    return consumed, source


@pytest.mark.parametrize("n", [1, 2, 4])
def test_staleness_never_exceeds_n_under_uneven_workers(n):
    for seed in range(2):
        consumed = _run(n, iterations=10, seed=seed)
        staleness = [k - g.policy_version for k, g in consumed]
        assert max(staleness) <= n and min(staleness) >= 0
        assert max(staleness) >= 1  # the producer really ran ahead
        assert len({g.prompt.uid for _, g in consumed}) == len(consumed)  # none twice


def test_one_step_off_policy_trains_every_group_exactly_one_version_stale():
    consumed = _run(1, iterations=6)
    assert [k - g.policy_version for k, g in consumed if k >= 1] == [1] * 5 * 6
    assert all(g.policy_version == 0 for k, g in consumed if k == 0)


def test_zero_staleness_is_on_policy():
    consumed = _run(0, iterations=4)
    assert all(g.policy_version == k for k, g in consumed)


def test_every_request_sees_one_version_only():
    # each token is the weight value read during generation: a switch mid-request would show
    for n in (0, 1, 2):
        for k, g in _run(n, iterations=6):
            assert {t for c in g.completions for t in c.token_ids} == {g.policy_version}, (n, k)


def test_a_group_staler_than_allowed_is_dropped_and_one_from_the_future_refused():
    def group(version):
        fields = {
            "policy_version": version,
            "oldest_version": version,
            "prompt": Prompt("u", "", ""),
        }
        return type("G", (), fields)()

    seen, dropped = [], []
    kept = list(within_staleness(iter([group(5), group(4), group(2)]), 5, 2, seen, dropped))
    assert [g.policy_version for g in kept] == [5, 4] and len(dropped) == 1
    with pytest.raises(match="policy_version 6"):
        list(within_staleness(iter([group(6)]), 5, 2, [], []))
    with pytest.raises(match="policy_version 4"):  # on-policy: never dropped
        list(within_staleness(iter([group(4)]), 5, 0, [], []))


@pytest.mark.parametrize("n", [0, 1])
def test_a_worker_dying_mid_iteration_is_replaced_and_no_group_is_lost_or_trained_twice(n):
    iterations, per_iteration = 5, 6
    # worker 0 dies at its 40th sample, mid-iteration, holding prompts
    consumed, source = _run_source(
        n, iterations, per_iteration, die_after={0: 40}, max_worker_restarts=2
    )
    assert source.restarts == [1, 0] and source.duplicates == 0
    assert source.pool.resent  # it died holding prompts, and they were sent again
    by_iteration = [[g.prompt.uid for k, g in consumed if k == i] for i in range(iterations)]
    expected = [[f"p{i * per_iteration + j}" for j in range(per_iteration)] for i in range(5)]
    assert [sorted(u) for u in by_iteration] == [sorted(u) for u in expected]  # each exactly once
    staleness = [k - g.policy_version for k, g in consumed]
    assert max(staleness) <= n and min(staleness) >= 0  # on-policy stays on-policy (n = 0)
    for _, g in consumed:  # the replacement generated with the version it claims
        assert {t for c in g.completions for t in c.token_ids} == {g.policy_version}


def test_a_worker_that_keeps_dying_stops_the_run_with_the_budget_named():
    with pytest.raises(
        WorkerDied,
        match=r"worker 0 died; restarted 0 time\(s\) already "
        r"\(pipeline.max_worker_restarts = 0\)",
    ):
        _run_source(0, 3, die_after={0: 5}, max_worker_restarts=0)


def test_queue_size_holds_back_tasks_while_that_many_groups_wait_for_the_learner():
    # with a bound of one waiting group the producer pauses often; every group still arrives,
    # on-policy, and no wait turns into a deadlock
    consumed, _ = _run_source(0, iterations=3, queue_size=1)
    assert [k for k, _ in consumed] == [0] * 6 + [1] * 6 + [2] * 6
    assert all(g.policy_version == k for k, g in consumed)


def test_the_loop_bounds_a_group_by_its_oldest_token():
    from cadence.types import Completion, Group

    def group(uid, policy_version, *stamps):
        completions = [Completion([1] * len(s), [0.0] * len(s), token_versions=s) for s in stamps]
        return Group(Prompt(uid, "", ""), [0], completions, policy_version, iteration=4)

    seen, dropped = [], []
    fresh_tail = group("a", 2, [3, 3], [3, 4])  # begun under 2, every token of 3 or 4
    old_head = group("b", 2, [3, 4], [2, 4])  # one trajectory's first token is of version 2
    kept = list(within_staleness(iter([fresh_tail, old_head]), 4, 1, seen, dropped))
    assert kept == [fresh_tail] and dropped == [old_head]
    assert fresh_tail.oldest_version == 3 and old_head.oldest_version == 2
    with pytest.raises(match="oldest token of version 5"):
        list(within_staleness(iter([group("c", 2, [5])]), 4, 1, [], []))
