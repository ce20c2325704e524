"""Off-policy asynchrony: admission by version, exact staleness, atomic weight updates.

The producer and the worker loop are the real ones; the worker processes are threads running
`_WorkerLoop` with a scripted engine whose every token is the value of the weights it reads at
that moment (`weight = version`), with random per-sample delays and one slow worker.
"""

import queue
import random
import threading
import time

import pytest
import torch

from cadence.engine import SamplingParams, ScriptedEngine
from cadence.metrics import Tracer
from cadence.pipeline.loop import StaleGroupError, within_staleness
from cadence.pipeline.source import WorkerSource
from cadence.pipeline.weights import SharedWeights, load_into
from cadence.pipeline.worker import RolloutWorker
from cadence.pipeline.workers import WorkerError, _WorkerLoop
from cadence.types import Prompt

GROUP_SIZE = 3


class _Proc:
    def __init__(self) -> None:
        self.inbox: queue.Queue = queue.Queue()
        self.in_flight: dict = {}


class ThreadPool:
    """The WorkerPool interface over in-process worker threads (same loop, same messages)."""

    def __init__(self, weights: SharedWeights, slowness: list[float], seed: int = 0) -> None:
        self.weights, self.timeout_s = weights, 30.0
        self.results: queue.Queue = queue.Queue()
        self.procs = [_Proc() for _ in slowness]
        self.threads = []
        for wid, slow in enumerate(slowness):
            model = torch.nn.Linear(1, 1, bias=False)
            rng = random.Random(seed * 100 + wid)

            def script(ids, seed, model=model, slow=slow, rng=rng):
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
            loop = _WorkerLoop(
                wid,
                worker,
                lambda version, model=model: load_into(model, weights.tensors),
                self.procs[wid].inbox,
                self.results,
            )
            thread = threading.Thread(target=loop.run, daemon=True)
            thread.start()
            self.threads.append(thread)
        for _ in slowness:
            assert self.results.get(timeout=10)[0] == "ready"

    @property
    def num_workers(self) -> int:
        return len(self.procs)

    def submit(self, wid, task_id, prompts, iteration):
        self.procs[wid].in_flight[task_id] = prompts
        self.procs[wid].inbox.put(("rollout", (task_id, prompts, iteration)))

    def send_sync_to(self, wid, version):
        self.procs[wid].inbox.put(("sync", version))

    def has_in_flight(self):
        return any(p.in_flight for p in self.procs)

    def poll(self, timeout_s):
        try:
            kind, wid, payload = self.results.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if kind == "error":
            raise WorkerError(payload)
        if kind == "groups" and payload.task_done:
            self.procs[wid].in_flight.pop(payload.task_id, None)
        return kind, wid, payload

    def close(self):
        for p in self.procs:
            p.inbox.put(("stop", None))
        for t in self.threads:
            t.join(timeout=10)


def _run(max_staleness: int, iterations: int, prompts_per_iteration: int = 6, seed: int = 0):
    """A learner at version k trains iteration k; returns [(iteration, group)] as consumed."""
    policy = torch.nn.Linear(1, 1, bias=False)
    weights = SharedWeights(policy)
    pool = ThreadPool(weights, slowness=[0.002, 0.006], seed=seed)
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
        stream=True,
        prompts_per_task=2,
        tasks_in_flight=2,
        max_staleness=max_staleness,
        iterations=iterations,
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
    return consumed


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
        return type("G", (), {"policy_version": version, "prompt": Prompt("u", "", "")})()

    seen, dropped = [], []
    kept = list(within_staleness(iter([group(5), group(4), group(2)]), 5, 2, seen, dropped))
    assert [g.policy_version for g in kept] == [5, 4] and len(dropped) == 1
    with pytest.raises(StaleGroupError, match="policy_version 6"):
        list(within_staleness(iter([group(6)]), 5, 2, [], []))
    with pytest.raises(StaleGroupError, match="policy_version 4"):  # on-policy: never dropped
        list(within_staleness(iter([group(4)]), 5, 0, [], []))
