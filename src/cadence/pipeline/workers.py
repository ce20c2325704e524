"""Inference worker processes (local backend) and the pool that drives them.

Each worker is a spawned process with its own engine, reward function and torch threads. It
obeys three messages on its own queue: `sync` (load the published weights, acknowledge the
version), `rollout` (generate and score a task of prompts with the loaded version) and `stop`.
Every result, acknowledgement or error goes to one shared result queue, carrying the worker id.
A worker stamps each group with the version it actually has loaded, so a prompt sent before the
sync finished is caught by the learner's version check, not trusted.

A worker streams: tasks join its engine while others decode (continuous batching keeps the slots
full across tasks), and each group is sent the moment it is complete, its result saying whether
it was its task's last. Weights change only between requests: a `sync` that arrives while the
engine is busy waits, with every message behind it, until the engine has drained.

The pool never lets a failure hang: every wait has a timeout and checks that workers are alive; a
worker's exception comes back with its traceback; `close()` stops, then terminates, then kills.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import connection as mp_connection
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.multiprocessing as mp

from cadence.engine import SamplingParams
from cadence.pipeline.weights import EngineWeights, SharedWeights, WeightSync, load_into
from cadence.types import Group, Prompt

if TYPE_CHECKING:
    from cadence.engine.vllm import VLLMOptions


class WorkerError(RuntimeError):
    """A worker raised; the message holds the worker's own traceback."""


class WorkerDied(RuntimeError):
    """A worker exited without being asked to; `wid` is its slot in the pool."""

    def __init__(self, message: str, wid: int = -1) -> None:
        super().__init__(message)
        self.wid = wid


class Pool(Protocol):
    """What `WorkerSource` drives: a fixed number of worker slots on some backend.

    Messages to one worker are acted on in order (see `_WorkerLoop`). `poll` returns the next
    ('groups', wid, TaskResult) or ('ack', wid, version), or None after the timeout; it raises
    `WorkerError` when a worker raised and `WorkerDied` (with `wid`) when one is gone.
    """

    timeout_s: float

    @property
    def weights(self) -> WeightSync: ...

    @property
    def num_workers(self) -> int: ...

    def submit(self, wid: int, task_id: int, prompts: list[Prompt], iteration: int) -> None: ...

    def send_sync_to(self, wid: int, version: int) -> None: ...

    def poll(self, timeout_s: float) -> tuple[str, int, Any] | None: ...

    def has_in_flight(self) -> bool: ...

    def replace(self, wid: int) -> dict[int, tuple[list[Prompt], int]]:
        """Put a fresh worker (no weights loaded yet) in slot `wid`; return the tasks the old one
        had not finished, by id, as (prompts not yet returned, iteration)."""
        ...

    def close(self) -> None: ...


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
    vllm: VLLMOptions | None = None  # engine 'vllm': the [rollout.vllm] settings


@dataclass
class TaskResult:
    """Groups of one task finished in one engine step (`task_done`: the task's last ones)."""

    worker: int
    task_id: int
    groups: list[Group]
    start: float  # time.perf_counter() in the worker (CLOCK_MONOTONIC: comparable across processes)
    end: float  # [start, end): busy time since the worker's previous result, without overlap
    task_done: bool = True
    occupancy: list[tuple[float, int]] = field(default_factory=list)  # (time, active slots)


def _build_worker(spec: WorkerSpec):
    """The worker, and what new weights load into: its model, or its engine's own copy."""
    from cadence.engine import make_engine
    from cadence.models import load_model, load_skeleton, load_tokenizer
    from cadence.pipeline.build import DTYPES
    from cadence.pipeline.worker import RolloutWorker
    from cadence.rewards import load_reward

    tokenizer = load_tokenizer(spec.model_path)
    dtype = DTYPES[spec.dtype]
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
        target: Any = EngineWeights(engine, load_skeleton(spec.model_path, dtype))
    else:
        target = load_model(spec.model_path, dtype=dtype)
        engine = make_engine(spec.engine, target, tokenizer, max_num_seqs=spec.max_num_seqs)
    reward = load_reward(spec.reward) if spec.reward else None
    return target, RolloutWorker(
        engine, tokenizer, reward, spec.sampling, spec.group_size, spec.run_seed
    )


def worker_main(wid: int, spec: WorkerSpec, tensors: dict, inbox, results) -> None:
    """The worker process's main loop (its main thread, so math-verify keeps its timeouts);
    `results` is the write end of its own result pipe."""
    from cadence.models import ModelLoadError

    outbox = _Sender(results)
    try:
        torch.set_num_threads(spec.threads)
        target, worker = _build_worker(spec)
    except ModelLoadError as e:  # the model, not the worker, is at fault: the run exits 2
        outbox.put(("refused", wid, str(e)))
        return
    except BaseException:
        outbox.put(("error", wid, traceback.format_exc()))
        return
    try:
        load = functools.partial(load_into, target, tensors)  # load(version)
        _WorkerLoop(wid, worker, load, inbox, outbox).run()
    except BaseException:
        outbox.put(("error", wid, traceback.format_exc()))


class _WorkerLoop:
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
            )
            self.outbox.put(("groups", self.wid, result))
            self.busy_since, self.occupancy = now, []


class InFlight:
    """The prompts a worker has been sent and not yet returned, by task: what a replacement for
    it must be sent again. A group returned is struck off at once, so none is generated twice."""

    def __init__(self) -> None:
        self.tasks: dict[int, tuple[list[Prompt], int]] = {}  # task id -> (prompts, iteration)

    def add(self, task_id: int, prompts: list[Prompt], iteration: int) -> None:
        self.tasks[task_id] = (list(prompts), iteration)

    def returned(self, result: TaskResult) -> None:
        prompts, iteration = self.tasks.get(result.task_id, ([], 0))
        done = {g.prompt.uid for g in result.groups}
        left = [p for p in prompts if p.uid not in done]
        if result.task_done or not left:
            self.tasks.pop(result.task_id, None)
        else:
            self.tasks[result.task_id] = (left, iteration)

    def uids(self) -> list[str]:
        return [p.uid for prompts, _ in self.tasks.values() for p in prompts]

    def __bool__(self) -> bool:
        return bool(self.tasks)


class _Sender:
    """A worker's end of its result pipe, as the outbox `_WorkerLoop` puts into."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def put(self, item) -> None:
        self.conn.send(item)


@dataclass
class _Proc:
    process: Any
    inbox: Any
    results: Any  # the read end of this worker's own result pipe
    in_flight: InFlight = field(default_factory=InFlight)
    closed: bool = False  # its pipe reached end of file: the worker is gone


class WorkerPool:
    """`num_workers` spawned worker processes in fixed slots; a dead one can be `replace`d."""

    def __init__(
        self, spec: WorkerSpec, weights: SharedWeights, num_workers: int, timeout_s: float = 300.0
    ) -> None:
        self.spec = spec
        self.weights = weights
        self.timeout_s = timeout_s
        self._ctx = mp.get_context("spawn")
        self._pending: collections.deque = collections.deque()  # received, not yet handed out
        self.procs: list[_Proc] = []
        try:
            for wid in range(num_workers):
                self.procs.append(self._spawn(wid))
            self._await_ready(set(range(num_workers)))
        except BaseException:
            self.close()
            raise

    def _spawn(self, wid: int) -> _Proc:
        """One worker process with its own inbox and result pipe. Its own pipe, not one shared
        by all: a worker killed while writing would leave a shared queue locked, or half a
        message in it, for every other worker. The pool keeps only the read end, so a dead
        worker's pipe ends in end-of-file, never in a read that waits forever."""
        inbox = self._ctx.Queue()
        reader, writer = self._ctx.Pipe(duplex=False)
        p = self._ctx.Process(
            target=worker_main,
            name=f"cadence-worker-{wid}",
            daemon=True,
            args=(wid, self.spec, self.weights.tensors, inbox, writer),
        )
        p.start()
        writer.close()
        return _Proc(p, inbox, reader)

    @property
    def num_workers(self) -> int:
        return len(self.procs)

    def submit(self, wid: int, task_id: int, prompts: list[Prompt], iteration: int) -> None:
        self.procs[wid].in_flight.add(task_id, prompts, iteration)
        self.procs[wid].inbox.put(("rollout", (task_id, prompts, iteration)))

    def send_sync_to(self, wid: int, version: int) -> None:
        self.procs[wid].inbox.put(("sync", version))

    def has_in_flight(self) -> bool:
        return any(proc.in_flight for proc in self.procs)

    def poll(self, timeout_s: float) -> tuple[str, int, Any] | None:
        """The next ('groups', wid, TaskResult) or ('ack', wid, version), or None after
        `timeout_s`; raises if a worker failed or died."""
        try:
            kind, wid, payload = self._get(timeout_s)
        except TimeoutError:
            return None
        if kind not in ("groups", "ack"):
            raise WorkerError(f"worker {wid} sent '{kind}' while tasks were running")
        return kind, wid, payload

    def replace(self, wid: int) -> dict[int, tuple[list[Prompt], int]]:
        """Start a fresh worker in slot `wid` (it loads no version until sent a sync); return
        the tasks the old one still held, by id, with only the prompts it had not returned."""
        old = self.procs[wid]
        stop_process(old.process)
        self._drain()  # whatever the old worker sent before it died is in the pipe now
        self._pending = collections.deque(  # a dead worker's acknowledgements mean nothing
            m for m in self._pending if not (m[0] == "ack" and m[1] == wid)
        )
        close_queue(old.inbox)
        old.results.close()
        self.procs[wid] = self._spawn(wid)
        self._await_ready({wid})
        return old.in_flight.tasks

    def _await_ready(self, pending: set[int]) -> None:
        """Wait for 'ready' from the workers in `pending`; other messages are kept for `poll`."""
        deadline = time.monotonic() + self.timeout_s
        while pending:
            started = ("ready", "error", "refused")
            ready = [m for m in self._pending if m[1] in pending and m[0] in started]
            if not ready:
                if not self._receive(0.5):
                    self._check_alive(pending)
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"workers {sorted(pending)} did not start within {self.timeout_s:.0f}s"
                        )
                continue
            for message in ready:
                self._pending.remove(message)
                kind, wid, payload = message
                if kind == "error":
                    raise WorkerError(f"worker {wid} failed:\n{payload}")
                if kind == "refused":
                    from cadence.models import ModelLoadError

                    raise ModelLoadError(f"worker {wid}: {payload}")
                pending.discard(wid)

    def _receive(self, timeout_s: float) -> bool:
        """Move every message that arrives within `timeout_s` to `_pending`; False if none."""
        by_conn: dict[Any, int] = {
            proc.results: wid for wid, proc in enumerate(self.procs) if not proc.closed
        }
        got = False
        for conn in mp_connection.wait(list(by_conn), timeout_s):
            wid = by_conn[conn]
            try:
                message: tuple[str, int, Any] = cast(mp_connection.Connection, conn).recv()
            except (EOFError, OSError):  # the worker is gone; _check_alive reports it
                self.procs[wid].closed = True
                continue
            kind, _, payload = message
            if kind == "groups":
                self.procs[wid].in_flight.returned(payload)
            self._pending.append(message)
            got = True
        return got

    def _drain(self) -> None:
        while self._receive(0.0):
            pass

    def _get(self, timeout_s: float) -> tuple[str, int, Any]:
        """One message, polling worker liveness every half second."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self._pending and not self._receive(min(0.5, timeout_s)):
                self._check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no word from the workers for {timeout_s:.0f}s")
                continue
            kind, wid, payload = self._pending.popleft()
            if kind == "error":
                raise WorkerError(f"worker {wid} failed:\n{payload}")
            return kind, wid, payload

    def _check_alive(self, wids: set[int] | None = None) -> None:
        for wid, proc in enumerate(self.procs):
            if (wids is None or wid in wids) and (proc.closed or not proc.process.is_alive()):
                self._drain()  # its last results are in flight no more
                proc.process.join(timeout=5)  # its pipe closed as it exited: wait for its code
                uids = proc.in_flight.uids()
                shown = ", ".join(uids[:8]) + (f", ... ({len(uids)} in all)" if uids[8:] else "")
                raise WorkerDied(
                    f"worker {wid} (pid {proc.process.pid}) exited with code "
                    f"{proc.process.exitcode}; prompts in flight: {shown or 'none'}",
                    wid,
                )

    def close(self) -> None:
        """Stop every worker; terminate, then kill, any that does not exit in time."""
        stop_workers(self.procs)
        self.procs = []


def stop_workers(procs) -> None:
    """Ask each process (`.process`, `.inbox`, `.results`) to stop; terminate, then kill, any
    that does not exit in time; close its channels."""
    for proc in procs:
        if proc.process.is_alive():
            with contextlib.suppress(OSError, ValueError):  # its queue may be broken
                proc.inbox.put(("stop", None))
    for proc in procs:
        stop_process(proc.process)
    for proc in procs:
        close_queue(proc.inbox)
        proc.results.close()


def stop_process(process, grace_s: float = 5.0) -> None:
    """Join a process that was asked to stop; terminate, then kill, one that does not exit."""
    process.join(timeout=grace_s)
    if process.is_alive():
        process.terminate()
        process.join(timeout=grace_s)
    if process.is_alive():
        process.kill()
        process.join()


def close_queue(q) -> None:
    """Close a multiprocessing queue without waiting for its feeder thread to flush."""
    q.close()
    q.cancel_join_thread()
