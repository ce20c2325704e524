"""Whole runs with partial rollouts whose weight updates land at chosen points.

Where a version reaches a worker decides every token after it, so a run with partial rollouts is
reproducible only if that point is. Two ways to fix it:

- `publish_when_idle(source, prompts)`: the learner publishes version v >= 1 only once iteration
  v (generated ahead with version v - 1) is all in, so no update arrives mid-sequence (any
  backend: it waits on the producer's results);
- `thread_workers(publish_at_step)`, set as `cadence.builder.run.make_pool`: `build_run`
  puts its rollout workers in threads of this process (`backend.fake.ThreadPool`, the real
  `WorkerLoop`, workers built from the run's `WorkerSpec`), and a worker whose task belongs to
  an iteration ahead of its weights stops after decode step `publish_at_step` of that task until
  the learner has sent it the iteration's version: the update lands between the same two steps
  every run, with sequences in flight.
  Published weights are kept by version (`PUBLISHED`), to recompute log-probs under each.

`python -m partial_runs ARGS` is `cadence ARGS` with thread workers, publishing at the step
$CADENCE_TEST_PUBLISH_AT_STEP: a run a test can kill with SIGKILL and resume.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections import Counter

import torch

from cadence.backend import InMemoryWeights
from cadence.backend.fake import ThreadPool
from cadence.dataplane import SampleStore
from cadence.rollout import build_worker

PUBLISHED: dict[int, dict[str, torch.Tensor]] = {}  # version -> the weights published as it
WAIT_S = 120.0  # longest a worker waits for its version: past it, the run has hung


def publish_when_idle(source, prompts: int) -> None:
    """Make `source` (a `WorkerSource`) publish version v >= 1 only once iteration v's `prompts`
    groups have all arrived (see the module docstring)."""
    cond, arrived = threading.Condition(), Counter()
    inner, barrier = source.producer.on_result, source.barrier

    def on_result(result):
        inner(result)
        with cond:
            arrived.update(g.iteration for g in result.groups)
            cond.notify_all()

    def barrier_when_idle(version: int) -> None:
        with cond:
            if not cond.wait_for(lambda: version == 0 or arrived[version] >= prompts, WAIT_S):
                raise TimeoutError(f"iteration {version} was not generated in {WAIT_S:.0f}s")
        barrier(version)

    source.producer.on_result = on_result
    source.barrier = barrier_when_idle


class _KeptWeights(InMemoryWeights):
    def publish(self, model, version: int) -> None:
        super().publish(model, version)
        PUBLISHED[version] = {n: t.clone() for n, t in self.tensors.items()}


class _SyncsSent(ThreadPool):
    """A `ThreadPool` that says which versions it has sent to each worker."""

    def __init__(self, sent: dict[int, set[int]], cond: threading.Condition, *args) -> None:
        self.sent, self.cond = sent, cond
        super().__init__(*args)

    def send_sync_to(self, wid: int, version: int, expected=None) -> None:
        super().send_sync_to(wid, version, expected)
        with self.cond:
            self.sent.setdefault(wid, set()).add(version)
            self.cond.notify_all()


def _hooked_worker(spec, wid, weights, publish_at_step, sent, cond):
    """A worker built from `spec` whose engine, after decode step `publish_at_step` of a task of
    iteration k, waits until version k was sent to it, if it does not decode with k already, and
    which takes version k in no earlier step of that task."""
    target, worker = build_worker(spec)
    engine, submit, step = worker.engine, worker.submit, worker.engine.step
    may_load = worker.may_load
    task = {"iteration": 0, "steps": 0}

    def ahead() -> bool:
        """Whether the task in hand belongs to an iteration ahead of the loaded weights."""
        return task["iteration"] > (-1 if worker.version is None else worker.version)

    def submit_noting(task_id, prompts, iteration, version):
        task.update(iteration=iteration, steps=0)
        submit(task_id, prompts, iteration, version)

    def step_then_wait():
        done = step()
        task["steps"] += 1
        k = task["iteration"]
        if task["steps"] == publish_at_step and ahead():
            with cond:
                if not cond.wait_for(lambda: k in sent.get(wid, ()), WAIT_S):
                    raise TimeoutError(f"version {k} did not reach worker {wid}")
        return done

    def may_load_at_step(version: int) -> bool:
        """Not before step `publish_at_step` of a task generated ahead: a version the learner
        sends early (a slow worker, a loaded machine) lands at the same step all the same."""
        early = task["steps"] < publish_at_step and version >= task["iteration"]
        if worker.busy and early and ahead():
            return False
        return may_load(version)

    worker.submit, engine.step = submit_noting, step_then_wait
    worker.may_load = may_load_at_step
    return worker, functools.partial(target.load, weights.tensors)


def thread_workers(publish_at_step: int):
    """A `make_pool` for `build_run` that starts thread workers taking new weights after decode
    step `publish_at_step` of a task generated ahead (see the module docstring)."""

    def make_pool(backend, spec, model, num_workers, *, timeout_s=300.0, placement=None, **ray):
        if backend != "local" or ray:
            raise ValueError("thread workers stand in for the local backend only")
        PUBLISHED.clear()
        sent: dict[int, set[int]] = {}
        cond = threading.Condition()
        weights = _KeptWeights(model)

        def make_worker(wid):
            return _hooked_worker(spec, wid, weights, publish_at_step, sent, cond)

        pool = _SyncsSent(sent, cond, make_worker, num_workers, weights, timeout_s)
        return pool, SampleStore()

    return make_pool


if __name__ == "__main__":
    import cadence.builder.run as build
    from cadence.cli import main

    build.make_pool = thread_workers(int(os.environ["CADENCE_TEST_PUBLISH_AT_STEP"]))
    sys.exit(main(sys.argv[1:]))
