"""Where the learner's groups come from: the seam between generation and training.

A `GroupSource` is told to start an iteration (with the learner's policy version) and then yields
that iteration's groups; it takes each iteration's prompts from `next_prompts` itself, since with
off-policy asynchrony it begins iterations before the learner reaches them. The colocated source
generates everything in the learner's thread first, so `sync` is the only mode it can offer;
`WorkerSource` takes the groups that worker processes made (the producer thread, producer.py,
puts them in the sample store) as they finish. The learner consumes any of them the same way,
and the run loop reads what each measured from `stats()`. With dynamic sampling both keep only
groups whose rewards differ (oversample.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, Protocol

from cadence.backend import Pool, RewardStage, TaskResult
from cadence.backend.store_stage import StoreStage
from cadence.dataplane import (
    LEARNER,
    TEACHER_LOGPROBS,
    TRAIN,
    SampleStore,
    Store,
    StoreClosed,
    batch_groups,
    record_depths,
)
from cadence.metrics.trace import Span, Tracer
from cadence.pipeline.behaviour import BehaviourPolicies
from cadence.pipeline.gate import WeightGate
from cadence.pipeline.oversample import Oversampler
from cadence.pipeline.producer import Producer, ProducerParams
from cadence.pipeline.steporder import StepOrder
from cadence.rollout import RolloutWorker
from cadence.types import Group, Prompt, SampleBatch, SourceStats


class GroupSource(Protocol):
    def start_iteration(self, iteration: int, version: int) -> None: ...

    def groups(self) -> Iterator[Group]:
        """The started iteration's groups, each complete, in the order they are ready."""
        ...

    def stats(self) -> SourceStats:
        """What the current iteration measured so far, and the run's counts."""
        ...

    def behaviour_policies(self, iteration: int) -> list[dict[str, Any]]:
        """What a checkpoint after `iteration - 1` must hold of the versions in flight for a run
        resumed from it to generate what this one will (plain containers and tensors)."""
        ...

    def close(self) -> None: ...


class ColocatedSource:
    """Generation in the learner's thread, with the learner's own (current) weights."""

    def __init__(
        self,
        worker: RolloutWorker,
        tracer: Tracer,
        next_prompts: Callable[[], list[Prompt]],
        *,
        filter_groups: bool = False,
        max_oversample: int = 0,
        next_extra: Callable[[int], Prompt] | None = None,
        sync: Callable[[int], None] | None = None,
    ) -> None:
        """`sync(version)`: loads the learner's weights into an engine that keeps its own copy
        (vLLM) before each iteration's generation; None when the engine uses the learner's."""
        if filter_groups and next_extra is None:
            raise ValueError("filter_groups needs next_extra, the source of extra prompts")
        self.worker = worker
        self.tracer = tracer
        self.next_prompts = next_prompts
        self.filter_groups, self.max_oversample = filter_groups, max_oversample
        self.next_extra = next_extra
        self.sync = sync
        self.times = SourceStats()
        self._pending: list[Group] = []
        self._rows = 0

    def stats(self) -> SourceStats:
        return replace(self.times, stages={"gen": (1, self._rows)})

    def behaviour_policies(self, iteration: int) -> list[dict[str, Any]]:
        return []  # each iteration is generated when the learner reaches it

    def start_iteration(self, iteration: int, version: int) -> None:
        """Generate the iteration's groups; with dynamic sampling, in rounds: each round draws
        one more prompt per group filtered in the last (pipeline/oversample.py)."""
        self.times = SourceStats(start=self.tracer.now())
        prompts = self.next_prompts()
        if self.sync is not None:
            with self.tracer.span("weight_sync", "worker-0"):
                self.sync(version)
            self.times.weight_sync_s = self.tracer.now() - self.times.start
            self.times.weight_sync_bytes = getattr(self.sync, "num_bytes", 0)
        size = len(prompts)
        sampler = Oversampler(size, self.max_oversample, self.filter_groups)
        self._pending = []
        while prompts:
            with self.tracer.span("generate", "worker-0"):
                groups = self.worker.rollout(prompts, iteration, version)
            self._rows += sum(g.group_size for g in groups)
            self.tracer.add_samples("slots", "worker-0", self.worker.take_occupancy())
            origin = self.tracer.origin
            for name, t0, t1 in self.worker.take_spans():  # tool calls
                self.tracer.add(Span(name, "worker-0 tools", t0 - origin, t1 - origin))
            prompts = []
            for group in groups:
                train, more = sampler.offer(group)
                if train:
                    self._pending.append(group)
                if more and self.next_extra is not None:
                    prompts.append(self.next_extra(size + sampler.extra - 1))
        self._pending += sampler.top_up()
        self.times.filtered_groups = sampler.filtered
        self.times.oversampled_prompts = sampler.extra
        self.times.first_group = self.times.last_group = self.tracer.now() - self.times.start
        with self.tracer.span("engine_sleep", "worker-0"):
            self.worker.rest()  # the learner trains next: the GPU's memory is its own

    def groups(self) -> Iterator[Group]:
        pending, self._pending = self._pending, []
        yield from pending

    def close(self) -> None:
        self._pending = []
        self.worker.close()


class WorkerSource:
    """The learner's side of worker processes fed by the producer thread: publishes each version
    through the weight gate, then takes the iteration's groups from the sample store as they
    become ready (`stream`) or all at once (sync). `stream` and the producer's `max_staleness`
    are the sync / periodic / offpolicy knobs (producer.py says how versions, admission and the
    store work)."""

    def __init__(
        self,
        pool: Pool,
        model,
        tracer: Tracer,
        next_prompts: Callable[[], list[Prompt]],
        params: ProducerParams,
        *,
        stream: bool,
        store: Store | None = None,
        reward_stage: RewardStage | None = None,
        teacher_stage: StoreStage | None = None,
        filter_groups: bool = False,
        max_oversample: int = 0,
        next_extra: Callable[[int], Prompt] | None = None,
        checkpoint_every: int = 0,
        behaviour: Sequence[dict[str, Any]] = (),
        step_groups: int = 0,
        verify: bool = True,
    ) -> None:
        """`params`: the producer's settings (the builder makes them). `behaviour`: the
        behaviour policies of the checkpoint a run resumes from (`behaviour_policies`), published
        again before its first iteration (pipeline/behaviour.py). `step_groups` > 0 (streaming,
        several optimizer steps an iteration): groups released a step of that many prompts at a
        time, in prompt order of steps (steporder.py)."""
        if params.queue_size and (params.max_staleness > 0 or not stream):
            raise ValueError("pipeline.queue_size must be 0 (unbounded) unless mode is periodic")
        if filter_groups and next_extra is None:
            raise ValueError("filter_groups needs next_extra, the source of extra prompts")
        if step_groups and (filter_groups or not stream):
            raise ValueError("step_groups orders a stream of groups without dynamic sampling")
        self.step_groups = step_groups
        self.pool, self.model, self.tracer = pool, model, tracer
        self.stream, self.max_staleness = stream, params.max_staleness
        self.store: Store = store if store is not None else SampleStore()
        self.reward_stage = reward_stage  # scores the rows when the workers do not
        self.teacher_stage = teacher_stage  # a distillation teacher's log-probs of them
        self.stages = [s for s in (reward_stage, teacher_stage) if s is not None]
        self.fields = TRAIN + ((TEACHER_LOGPROBS,) if teacher_stage is not None else ())
        self.filter_groups, self.max_oversample = filter_groups, max_oversample
        self.gate = WeightGate(
            pool.weights, pool.num_workers, pool.timeout_s, self._raise_failure, verify
        )
        self.producer = Producer(
            pool,
            self.store,
            tracer,
            self.gate,
            params,
            next_prompts,
            next_extra,
            scored=reward_stage is None,
            on_result=self._arrived,
        )
        self.behaviour = BehaviourPolicies(
            params.max_staleness, checkpoint_every, params.iterations
        )
        self._republish = self.behaviour.restore(behaviour)
        self.times = SourceStats()
        self._current, self._version = -1, -1  # the learner's iteration and version

    @property
    def restarts(self) -> list[int]:
        return self.producer.recovery.restarts

    @property
    def duplicates(self) -> int:
        return self.producer.recovery.duplicates

    def stats(self) -> SourceStats:
        stages = {"gen": (self.pool.num_workers, self.producer.rows_generated)}
        if self.reward_stage is not None:
            stages["reward"] = (self.reward_stage.num_workers, self.reward_stage.rows_scored)
        if self.teacher_stage is not None:
            stages["teacher"] = (self.teacher_stage.num_workers, self.teacher_stage.rows_done)
        return replace(
            self.times,
            queue_depths=list(self.times.queue_depths),
            worker_restarts=sum(self.restarts),
            stages=stages,
        )

    def start_iteration(self, iteration: int, version: int) -> None:
        for stage in self.stages:
            stage.start()
        self.producer.start()
        self.times = SourceStats(start=self.tracer.now())
        with self.tracer.span("weight_sync", "learner"):
            for old, weights in self._republish:  # a resumed run's begun iterations, as begun
                self.gate.publish(weights, old, wait=False)
                self.gate.release(old)
            self._republish = []
            self.barrier(version)
        self.behaviour.published(version, self.model)
        self.times.weight_sync_s = self.tracer.now() - self.times.start
        self.times.weight_sync_bytes = getattr(self.gate.weights, "num_bytes", 0)
        self._current, self._version = iteration, version
        self.gate.release(version)

    def behaviour_policies(self, iteration: int) -> list[dict[str, Any]]:
        return self.behaviour.state(iteration)

    def barrier(self, version: int) -> None:
        """Make `version` reach the workers; with max_staleness = 0, wait until all have it."""
        self.gate.publish(self.model, version, wait=self.max_staleness == 0)

    def _raise_failure(self) -> None:
        if self.producer.failure is not None:
            raise self.producer.failure
        for stage in self.stages:
            if stage.failure is not None:
                raise stage.failure

    def _arrived(self, result: TaskResult) -> None:
        """A worker's result reached the producer: the iteration's first and last arrivals."""
        now = self.tracer.now()
        if result.groups and all(g.iteration == self._current for g in result.groups):
            if math.isnan(self.times.first_group):
                self.times.first_group = now - self.times.start
            self.times.last_group = now - self.times.start

    def groups(self) -> Iterator[Group]:
        """The current iteration's groups: as they become ready (stream) or once all are; with
        dynamic sampling, only those whose rewards differ (oversample.py)."""
        k, version = self._current, self._version
        size = self.producer.wait_begun(k, self._raise_failure)
        sampler = Oversampler(size, self.max_oversample, self.filter_groups)
        order = StepOrder(size, self.step_groups) if self.step_groups else None
        while sampler.outstanding > 0:
            batch = self._take(k, version, sampler.outstanding)
            self.times.dropped_groups += batch.num_dropped_units
            for _ in range(batch.num_dropped_units):
                sampler.forget()
            groups = batch_groups(batch)
            if not self.stream:  # the whole batch at once: in prompt order, as it was drawn,
                # whatever order the workers finished it in (mini-batches are cut from it)
                groups.sort(key=lambda g: g.prompt.index)
            for group in groups:
                train, more = sampler.offer(group)
                if more:
                    self.producer.want(k, size + sampler.extra - 1)
                if train:
                    yield from order.offer(group) if order else [group]
        yield from sampler.top_up()
        yield from order.flush() if order else []
        self.times.filtered_groups = sampler.filtered
        self.times.oversampled_prompts = sampler.extra
        self.store.clear(k)
        self.producer.iteration_done(k)

    def _take(self, iteration: int, version: int, left: int) -> SampleBatch:
        """The next group (stream) or all `left` (sync) of `iteration` from the store, waiting
        as long as they are generated and scored; raises whatever stopped a stage meanwhile."""
        n = 1 if self.stream else left
        start = self.tracer.now()
        ready = self.store.depth(TRAIN, LEARNER, groups=True, iteration=iteration, units=True)
        self.times.queue_depths.append(ready)
        try:
            while True:
                self._raise_failure()
                batch = self.store.get(
                    self.fields,
                    n,
                    LEARNER,
                    timeout=0.5,
                    min_size=n,
                    iteration=iteration,
                    version=version,
                    max_staleness=self.max_staleness,
                )
                if batch.rows or batch.num_dropped:
                    self._raise_failure()  # a store closed by a failure hands out what it has
                    record_depths(self.store, self.tracer, self.reward_stage is not None)
                    return batch
                if not self.producer.alive:
                    raise RuntimeError("producer thread ended without finishing")
        except StoreClosed:
            self._raise_failure()
            raise
        finally:
            self.times.learner_wait_s += self.tracer.now() - start

    def close(self) -> None:
        self.gate.wake()
        self.store.close()  # wakes the reward stage's driver and any waiting get
        self.producer.stop()
        try:
            for stage in self.stages:
                stage.close()
        finally:
            self.pool.close()
