"""The simulated inference engines: continuous batching (vLLM-like) and static batching (the
local worker backend). Both take work from the simulation's queue, switch weights only when
empty (the continuous engine with partial rollouts: at its next decode step), and report
finished samples or groups back; `sim.py` owns the clock and the rules.
Must not: decide when an iteration starts (the producer in sim.py does).
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, Protocol

from cadence.plan.costs import Throughput

PARTIAL_CHUNK = 16  # decode steps between version checks with partial rollouts


class Simulation(Protocol):
    """What an engine reads and calls of the simulation that hosts it (`sim.Simulation`)."""

    work: Any  # the workload: prompt_tokens, group_size, ...
    shape: Any  # the mode: partial ("", "keep", "recompute")
    published: int  # the newest policy version
    cost: Throughput
    slots: int  # sequences an engine decodes at once
    now: float
    queue: deque  # waiting samples (continuous) or tasks (static)
    versions: list[int]  # version each started iteration is generated with
    lengths: list[list[list[int]]]  # response length of sample j of prompt i of iteration k
    left: list[list[int]]  # samples not yet finished, per iteration and prompt
    prefill_per_sample: float

    def at(self, t: float, fn: Callable, *args: Any) -> None: ...

    def taken(self) -> None: ...

    def sample_done(self, k: int, i: int) -> None: ...

    def group_ready(self, k: int, i: int) -> None: ...


class ContinuousBatching:
    """Up to `sim.slots` sequences; a finished sequence's slot is refilled at once."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.active: list = []  # heap of (finish step, admit step, iteration, prompt)
        self.steps = 0  # decode steps this engine has run
        self.admitted_at = 0  # sum of the admit steps of the active sequences
        self.version = -1
        self.running = False  # a run of decode steps or a weight load is under way
        self.stall = 0.0  # prefill owed by newly admitted samples
        self.busy: list[tuple[float, float, int]] = []  # (start, end, active sequences)

    def wake(self) -> None:
        if self.running:
            return
        sim, active, steps = self.sim, self.active, self.steps
        queue, lengths = sim.queue, sim.lengths
        if sim.shape.partial and sim.published > self.version:
            self._load(sim.published)  # any in flight go on under the new weights
            return
        while len(active) < sim.slots and queue:
            k, i, j = queue[0]
            if sim.shape.partial and sim.versions[k] < self.version:
                pass  # an older iteration's sample starts on the newer weights
            elif sim.versions[k] != self.version:
                if not active:
                    self._load(sim.versions[k])
                    return
                break  # finish the older version's sequences first
            queue.popleft()
            heapq.heappush(active, (steps + lengths[k][i][j], steps, k, i))
            self.admitted_at += steps
            self.stall += sim.prefill_per_sample
            if not queue:
                sim.taken()
        if active:
            self._decode()

    def _load(self, version: int) -> None:
        self.running = True
        end = self.sim.now + self.sim.cost.load_s
        if self.sim.shape.partial == "recompute":  # the prefixes in flight, prefilled again
            self.stall += self.sim.cost.prefill_per_token_s * self._context()
        self.busy.append((self.sim.now, end, 0))
        self.sim.at(end, self._loaded, version)

    def _loaded(self, version: int) -> None:
        self.version, self.running = version, False
        self.wake()

    def _decode(self) -> None:
        sim, b = self.sim, len(self.active)
        steps = self.active[0][0] - self.steps  # until the next sequence finishes
        if sim.shape.partial:  # look for a newer version every PARTIAL_CHUNK steps
            steps = min(steps, PARTIAL_CHUNK)
        context = self._context()
        duration = self.stall + sim.cost.decode_time(b, context, steps)
        self.stall, self.running = 0.0, True
        self.busy.append((sim.now, sim.now + duration, b))
        sim.at(sim.now + duration, self._decoded, steps)

    def _context(self) -> int:
        """Tokens the active sequences attend to: their prompts and their tokens so far."""
        return len(self.active) * (self.sim.work.prompt_tokens + self.steps) - self.admitted_at

    def _decoded(self, steps: int) -> None:
        self.steps += steps
        self.running = False
        while self.active and self.active[0][0] == self.steps:
            _, admitted, k, i = heapq.heappop(self.active)
            self.admitted_at -= admitted
            self.sim.sample_done(k, i)
        self.wake()


class StaticBatching:
    """One task at a time, as a local worker process runs them (engine/hf.py, worker.py)."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.version = -1
        self.running = False
        self.busy: list[tuple[float, float, int]] = []

    def wake(self) -> None:
        sim = self.sim
        if self.running or not sim.queue:
            return
        k, prompts = sim.queue[0]
        if sim.versions[k] != self.version:
            self.running = True
            end = sim.now + sim.cost.load_s
            self.busy.append((sim.now, end, 0))
            sim.at(end, self._loaded, sim.versions[k])
            return
        sim.queue.popleft()
        if not sim.queue:
            sim.taken()
        self.running = True
        end = self._run_task(k, prompts)
        sim.at(end, self._finished, k, prompts)

    def _loaded(self, version: int) -> None:
        self.version, self.running = version, False
        self.wake()

    def _run_task(self, k: int, prompts: list[int]) -> float:
        """Record the task's busy spans from now; return when it ends (scoring included)."""
        sim, t = self.sim, self.sim.now
        per_chunk = max(1, sim.slots // sim.work.group_size)
        for c in range(0, len(prompts), per_chunk):
            chunk = prompts[c : c + per_chunk]
            t = self._run_chunk(t, [r for i in chunk for r in sim.lengths[k][i]], len(chunk))
        score = sim.cost.score_per_sample_s * sim.work.group_size * len(prompts)
        self.busy.append((t, t + score, 0))
        return t + score

    def _run_chunk(self, t: float, lengths: list[int], num_prompts: int) -> float:
        cost, P = self.sim.cost, self.sim.work.prompt_tokens
        prefill = cost.prefill_per_token_s * P * num_prompts
        self.busy.append((t, t + prefill, len(lengths)))
        t += prefill
        active, context, done = len(lengths), len(lengths) * P, 0
        for length, count in sorted(Counter(lengths).items()):
            steps = length - done
            duration = cost.decode_time(active, context, steps)
            self.busy.append((t, t + duration, active))
            t += duration
            context += active * steps - count * (P + length)
            active, done = active - count, length
        return t

    def _finished(self, k: int, prompts: list[int]) -> None:
        self.running = False
        for i in prompts:
            self.sim.left[k][i] = 0
            self.sim.group_ready(k, i)
        self.wake()
