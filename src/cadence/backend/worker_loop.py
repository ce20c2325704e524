"""A rollout worker's life in any process: build it from a `WorkerSpec`, then run its message loop.

The loop obeys three messages, in order: `sync` (load the published weights, acknowledge the
version), `rollout` (generate and score a task of prompts with the loaded version) and `stop`.
Results, acknowledgements and errors go to its outbox, carrying the worker id. A worker stamps
each group with the version it actually has loaded, so a prompt sent before a sync finished is
caught by the learner's version check, not trusted.

A worker streams: tasks join its engine while others decode (continuous batching keeps the slots
full across tasks), and each group is sent the moment it is complete, its result saying whether
it was its task's last. Weights change only between requests: a `sync` that arrives while the
engine is busy waits, with every message behind it, until the engine has drained.

Local worker processes (`backend.local`), Ray actors (`backend.ray_pool`) and the in-thread fake
(`backend.fake`) all run this loop; only what carries its messages and weights differs.
"""

from __future__ import annotations

import collections
import os
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cadence.backend.pool import TaskResult
from cadence.engine import SamplingParams
from cadence.envs import EnvSpec
from cadence.rollout import RolloutWorker
from cadence.types import Group

if TYPE_CHECKING:
    from cadence.engine.vllm import VLLMOptions


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to build itself (plain, picklable values)."""

    model_path: str
    dtype: str
    reward: str  # the reward function's spec; "" when a reward stage scores instead
    sampling: SamplingParams
    group_size: int
    run_seed: int
    threads: int
    max_num_seqs: int
    engine: str = "continuous"
    reward_timeout_s: float = 0.0  # longest one reward call may take (0: no limit)
    answer_format: str = "auto"  # reward.answer_format of the "math" reward
    env: EnvSpec = field(default_factory=EnvSpec)  # single turn unless told otherwise
    vllm: VLLMOptions | None = None  # engine 'vllm': the [rollout.vllm] settings


def build_worker(spec: WorkerSpec):
    """(what new weights load into, RolloutWorker) as `spec` describes: the worker's model, or
    its engine's own copy (`EngineWeights`, vLLM). transformers is imported here, not before."""
    from cadence.backend.weights import EngineWeights
    from cadence.engine import make_engine
    from cadence.envs import make_env
    from cadence.models import DTYPES, load_model, load_skeleton, load_tokenizer
    from cadence.rewards import load_reward

    tokenizer = load_tokenizer(spec.model_path)
    dtype = DTYPES[spec.dtype]
    target: Any
    if spec.engine == "vllm":
        engine = make_engine(
            "vllm",
            None,
            tokenizer,
            spec.max_num_seqs,
            model_path=spec.model_path,
            dtype=spec.dtype,
            vllm=spec.vllm,
        )
        target = EngineWeights(engine, load_skeleton(spec.model_path, dtype))
    else:
        target = load_model(spec.model_path, dtype=dtype)
        engine = make_engine(spec.engine, target, tokenizer, max_num_seqs=spec.max_num_seqs)
    reward = (
        load_reward(spec.reward, spec.answer_format, spec.reward_timeout_s) if spec.reward else None
    )
    env = make_env(spec.env)
    return target, RolloutWorker(
        engine, tokenizer, reward, spec.sampling, spec.group_size, spec.run_seed, env=env
    )


class WorkerLoop:
    """A worker's message loop, whatever carries its messages (`inbox.get`, `outbox.put`) and
    its weights (`load_weights(version)` puts that version into the worker's model)."""

    def __init__(
        self, wid: int, worker, load_weights: Callable[[int], None], inbox, outbox
    ) -> None:
        self.wid, self.worker, self.load_weights = wid, worker, load_weights
        self.inbox, self.outbox = inbox, outbox
        self.version = -1
        self.backlog: collections.deque = collections.deque()  # messages not yet acted on
        self.busy_since = 0.0
        self.occupancy: list[tuple[float, int]] = []
        self.spans: list[tuple[str, float, float]] = []  # tool calls not yet reported

    def run(self) -> None:
        parent = os.getppid()
        self.outbox.put(("ready", self.wid, None))
        while True:
            self._receive(block=not self.worker.busy and not self.backlog)
            if os.getppid() != parent:  # the learner died without stopping us
                return
            if not self._act():
                return
            if self.worker.busy:
                self._step()

    def _receive(self, block: bool) -> None:
        try:
            self.backlog.append(self.inbox.get(timeout=1.0) if block else self.inbox.get_nowait())
            while True:
                self.backlog.append(self.inbox.get_nowait())
        except queue.Empty:
            pass

    def _act(self) -> bool:
        """Act on messages in order; a sync waits (with all behind it) until the engine drains."""
        while self.backlog:
            kind, payload = self.backlog[0]
            if kind == "stop":
                return False
            if kind == "sync":
                if self.worker.busy:
                    return True
                if payload > self.version:  # a version already loaded is acknowledged, not reread
                    self.load_weights(payload)
                    self.version = payload
                self.outbox.put(("ack", self.wid, self.version))
            elif kind == "rollout":
                task_id, prompts, iteration = payload
                if not self.worker.busy:
                    self.busy_since = time.perf_counter()
                self.worker.submit(task_id, prompts, iteration, self.version)
            self.backlog.popleft()
        return True

    def _step(self) -> None:
        by_task: dict[int, list[Group]] = {}
        for task_id, group in self.worker.poll():
            by_task.setdefault(task_id, []).append(group)
        self.occupancy.extend(self.worker.take_occupancy())
        self.spans.extend(self.worker.take_spans())
        for task_id, groups in by_task.items():
            now = time.perf_counter()
            result = TaskResult(
                self.wid,
                task_id,
                groups,
                self.busy_since,
                now,
                task_done=self.worker.task_done(task_id),
                occupancy=self.occupancy,
                spans=self.spans,
            )
            self.outbox.put(("groups", self.wid, result))
            self.busy_since, self.occupancy, self.spans = now, [], []
