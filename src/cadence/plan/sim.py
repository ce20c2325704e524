"""Discrete-event simulation of the cadence pipeline, one mode on one split of the devices.

Read on: docs/planner.md.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from cadence.choices import engine_kind
from cadence.plan.costs import Throughput
from cadence.plan.engines import ContinuousBatching, StaticBatching

MODES = ("sync", "periodic", "offpolicy")
PARTIAL_KV = ("", "keep", "recompute")  # "": no partial rollouts

BATCHING = ("continuous", "static")


@dataclass(frozen=True)
class Shape:
    """One mode on one split: how many devices generate and how many train."""

    mode: str  # "sync" | "periodic" | "offpolicy"
    placement: str  # "colocated" (every device does both, in turn) | "separate"
    num_inference: int
    num_training: int
    staleness: int = 0  # N, offpolicy only
    partial: str = ""  # offpolicy only: "keep" | "recompute" (partial rollouts), "" off

    @property
    def num_devices(self) -> int:
        if self.placement == "colocated":
            return self.num_inference
        return self.num_inference + self.num_training

    @property
    def label(self) -> str:
        if self.placement == "colocated":
            return "sync-colocated"
        if self.partial:
            kv = "-recompute" if self.partial == "recompute" else ""
            return f"partial-{self.staleness}{kv}"
        return f"offpolicy-{self.staleness}" if self.mode == "offpolicy" else self.mode


@dataclass(frozen=True)
class Workload:
    prompts_per_iteration: int
    group_size: int
    prompt_tokens: int
    micro_batch_groups: int
    max_num_seqs: int = 256
    samples_in_flight: int = 0  # separate engines: most samples sent to a worker at once (0: any)
    shared_prompt: bool = True  # the learner computes each group's prompt once
    batching: str = "continuous"
    prompts_per_task: int = 4  # static batching
    engine_devices: int = 1  # devices per inference engine (tensor parallel)
    colocated_engine_devices: int = 0  # when colocated (0: engine_devices)
    learner_strategy: str = "fsdp"  # how the training devices (the learner's ranks) hold it
    layout: str = "packed"  # learner.shared_prompt_impl: the positions a group costs the learner

    def devices_per_engine(self, placement: str) -> int:
        if placement == "colocated" and self.colocated_engine_devices:
            return self.colocated_engine_devices
        return self.engine_devices


@dataclass
class SimResult:
    shape: Shape
    wall_s: float  # per iteration, steady state
    tpspd: float
    tokens_per_iteration: float  # trained: prompt + response of every sample
    response_tokens_mean: float  # per response, in the measured iterations
    inference_busy: float  # fraction of the inference devices' time spent generating/loading
    training_busy: float  # fraction of the training devices' time spent training/publishing
    slot_utilization: float  # mean active sequences / slots, over the inference devices' time
    gen_busy_s: float  # per engine per iteration
    train_busy_s: float  # per iteration
    slots: int
    staleness: dict[int, int]  # staleness -> groups trained with it, measured iterations
    staleness_by_iteration: list[int] = field(default_factory=list)  # every trained iteration
    iteration_ends: list[float] = field(default_factory=list)  # when each version was published
    rank_memory_bytes: float = 0.0  # what one training rank holds (costs.Throughput.rank_memory)
    fits: bool = True  # whether that fits a training device

    @property
    def inference_idle(self) -> float:
        return 1.0 - self.inference_busy

    @property
    def training_idle(self) -> float:
        return 1.0 - self.training_busy

    def to_dict(self) -> dict:
        out = asdict(self)
        out["shape"] = asdict(self.shape) | {"label": self.shape.label}
        out["staleness"] = {str(k): v for k, v in sorted(self.staleness.items())}
        out["inference_idle"], out["training_idle"] = self.inference_idle, self.training_idle
        return out


def simulate(
    shape: Shape,
    work: Workload,
    cost: Throughput,
    lengths: np.ndarray,
    tpspd_devices: int | None = None,
) -> SimResult:
    """Simulate the iterations of `lengths` (iterations, prompts, group_size); see `measured`."""
    _check(shape, work, lengths)
    sim = Simulation(shape, work, cost, lengths)
    sim.run()
    return sim.result(tpspd_devices or shape.num_devices)


def _check(shape: Shape, work: Workload, lengths: np.ndarray) -> None:
    if shape.mode not in MODES:
        raise ValueError(f"unknown mode {shape.mode!r}; allowed: {MODES}")
    if work.batching not in BATCHING:
        raise ValueError(f"unknown batching {work.batching!r}; allowed: {BATCHING}")
    if shape.partial not in PARTIAL_KV:
        raise ValueError(f"unknown partial {shape.partial!r}; allowed: keep, recompute, ''")
    if shape.partial and (shape.mode != "offpolicy" or not engine_kind(work.batching).streams):
        raise ValueError("partial rollouts need offpolicy mode and continuous batching")
    if shape.placement == "colocated" and shape.mode != "sync":
        raise ValueError("colocated placement runs only in sync mode")
    if shape.num_inference < work.devices_per_engine(shape.placement) or shape.num_training < 1:
        raise ValueError(f"{shape}: needs >= 1 engine and >= 1 training device")
    want = (work.prompts_per_iteration, work.group_size)
    least = 2 * _bound(shape) + 2
    if lengths.ndim != 3 or lengths.shape[1:] != want or lengths.shape[0] < least:
        raise ValueError(f"lengths must be (>= {least} iterations, {want[0]}, {want[1]})")


def _bound(shape: Shape) -> int:
    return shape.staleness if shape.mode == "offpolicy" else 0


def measured(shape: Shape, iterations: int) -> range:
    """The iterations whose figures are reported, out of `iterations` simulated.

    The first N + 1 fill the pipeline; the learner stops after iteration `iterations` - N - 1,
    so the producer, N iterations ahead, never runs out of work inside the window.
    """
    n = _bound(shape)
    return range(n + 1, iterations - n)


class Simulation:
    def __init__(self, shape: Shape, work: Workload, cost: Throughput, lengths: np.ndarray):
        self.shape, self.work, self.cost = shape, work, cost
        self.lengths: list[list[list[int]]] = lengths.tolist()
        # a prompt's prefill is shared by its G samples (prefix caching)
        self.prefill_per_sample = cost.prefill_per_token_s * work.prompt_tokens / work.group_size
        self.iterations = len(self.lengths)
        self.staleness_bound = _bound(shape)
        self.window = measured(shape, self.iterations)
        colocated = shape.placement == "colocated"
        mean_seq = work.prompt_tokens + float(lengths.mean())
        self.slots = cost.slots(work.max_num_seqs, mean_seq, shape.num_devices if colocated else 0)
        if not colocated and work.samples_in_flight:  # the producer's bound, not the engine's
            self.slots = min(self.slots, work.samples_in_flight)
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()
        self.queue: deque = deque()  # waiting samples (continuous) or tasks (static)
        self.versions: list[int] = []  # version each started iteration is generated with
        self.published = -1
        self.next_iteration = 0
        G = work.group_size
        self.left = [[G] * work.prompts_per_iteration for _ in range(self.iterations)]
        self.ready: list[list[int]] = [[] for _ in range(self.iterations)]
        num_engines = shape.num_inference // work.devices_per_engine(shape.placement)
        engine = ContinuousBatching if engine_kind(work.batching).streams else StaticBatching
        self.engines = [engine(self) for _ in range(num_engines)]
        self.learner = _Learner(self)

    # -- the event loop --------------------------------------------------------------------
    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def run(self) -> None:
        self.learner.start()
        while self._heap and self.learner.iteration < self.window.stop:
            self.now, _, fn, args = heapq.heappop(self._heap)
            fn(*args)
        if self.learner.iteration < self.window.stop:
            raise RuntimeError("simulation stalled before the last iteration (a bug)")

    # -- producer --------------------------------------------------------------------------
    def publish(self, version: int) -> None:
        self.published = version
        self.produce()
        if self.shape.partial:  # an idle engine loads it now, a busy one at its next step
            for e in self.engines:
                self.at(self.now, e.wake)

    def produce(self) -> None:
        """Start the next iteration if its prompts may go out (see the module docstring)."""
        while self.next_iteration < self.iterations and self.published >= max(
            self.next_iteration - self.staleness_bound, 0
        ):
            k = self.next_iteration
            self.versions.append(self.published)
            self.queue.extend(self._items(k))
            self.next_iteration += 1
            for e in self.engines:
                self.at(self.now, e.wake)

    def _items(self, k: int) -> list:
        n, G = self.work.prompts_per_iteration, self.work.group_size
        if engine_kind(self.work.batching).streams:
            return [(k, i, j) for i in range(n) for j in range(G)]
        per_task = self.work.prompts_per_task
        if self.shape.placement == "colocated":  # the colocated source runs one batch per engine
            per_task = -(-n // len(self.engines))
        return [(k, list(range(i, min(i + per_task, n)))) for i in range(0, n, per_task)]

    def taken(self) -> None:
        """An engine took the last waiting item: the producer may start the next iteration."""
        self.at(self.now, self.produce)

    # -- groups ----------------------------------------------------------------------------
    def sample_done(self, k: int, i: int) -> None:
        self.left[k][i] -= 1
        if self.left[k][i] == 0:  # scoring runs on the engine's host, off the device
            self.at(
                self.now + self.cost.score_per_sample_s * self.work.group_size,
                self.group_ready,
                k,
                i,
            )

    def group_ready(self, k: int, i: int) -> None:
        self.ready[k].append(i)
        self.learner.poke()

    def tokens(self, k: int, i: int) -> tuple[int, int]:
        """(trained, computed) tokens of group i of iteration k: computed are the positions the
        learner's layout runs, padding included (`positions`)."""
        P, G = self.work.prompt_tokens, self.work.group_size
        lengths = self.lengths[k][i]
        layout = self.work.layout if self.work.shared_prompt else "unpacked"
        return G * P + sum(lengths), positions(layout, P, lengths)

    # -- figures ---------------------------------------------------------------------------
    def result(self, tpspd_devices: int) -> SimResult:
        ends, window = self.learner.ends, self.window
        t0, t1 = ends[window.start - 1], ends[window.stop - 1]
        span, steady = t1 - t0, len(window)
        n = self.work.prompts_per_iteration
        trained = sum(self.tokens(k, i)[0] for k in window for i in range(n))
        gen = sum(_clipped(e.busy, t0, t1) for e in self.engines) / len(self.engines)
        slot_time = sum(_clipped(e.busy, t0, t1, weighted=True) for e in self.engines)
        train = _clipped(self.learner.busy, t0, t1)
        by_iteration = [k - self.versions[k] for k in range(window.stop)]
        ranks, strategy = self.learner.devices, self.work.learner_strategy
        return SimResult(
            shape=self.shape,
            wall_s=span / steady,
            tpspd=trained / span / tpspd_devices,
            tokens_per_iteration=trained / steady,
            response_tokens_mean=float(np.mean([self.lengths[k] for k in window])),
            inference_busy=gen / span,
            training_busy=train / span,
            slot_utilization=slot_time / (len(self.engines) * self.slots * span),
            gen_busy_s=gen / steady,
            train_busy_s=train / steady,
            slots=self.slots,
            staleness=dict(Counter(by_iteration[k] for k in window for _ in range(n))),
            staleness_by_iteration=by_iteration,
            iteration_ends=list(ends),
            rank_memory_bytes=self.cost.rank_memory(ranks, strategy),
            fits=self.cost.fits(ranks, strategy),
        )


def positions(layout: str, prompt: int, lengths) -> int:
    """The positions a group of `lengths` responses to a `prompt`-token prompt costs `layout`
    (learner/packing.py), its responses padded to the group's longest where the layout pads."""
    longest, total = int(max(lengths)), int(sum(lengths))
    if layout in ("packed", "dense"):
        return prompt + total
    if layout == "prefix":
        return prompt + len(lengths) * longest
    return len(lengths) * (prompt + longest)  # unpacked


def _clipped(spans: list[tuple[float, float, int]], t0: float, t1: float, weighted=False) -> float:
    """Busy time inside [t0, t1]; weighted: times the active sequences of each span."""
    if not spans:
        return 0.0
    a = np.asarray(spans, dtype=np.float64)  # (S, 3): start, end, active
    overlap = np.clip(np.minimum(a[:, 1], t1) - np.maximum(a[:, 0], t0), 0.0, None)  # (S,)
    return float((overlap * a[:, 2]).sum() if weighted else overlap.sum())


class _Learner:
    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        shape = sim.shape
        self.devices = shape.num_inference if shape.placement == "colocated" else shape.num_training
        self.stream = shape.mode != "sync"
        self.iteration = 0  # the iteration being trained; the policy version is the same number
        self.consumed = 0  # groups of it already in a micro-batch
        self.running = False
        self.busy: list[tuple[float, float, int]] = []
        self.ends: list[float] = []  # when each iteration's version was published

    def start(self) -> None:
        self._run(self.sim.cost.publish_s, lambda: self.sim.publish(0))

    def poke(self) -> None:
        if not self.running:
            self._work()

    def _work(self) -> None:
        sim = self.sim
        k, n = self.iteration, sim.work.prompts_per_iteration
        if k >= sim.iterations or (not self.stream and len(sim.ready[k]) < n):
            return
        available, remaining = len(sim.ready[k]) - self.consumed, n - self.consumed
        strategy = sim.work.learner_strategy
        if remaining == 0:
            self._run(sim.cost.optimizer_time(self.devices, strategy), self._stepped)
            return
        m = sim.work.micro_batch_groups
        take = min(m, available) if available >= m or available == remaining else 0
        if take:
            groups = sim.ready[k][self.consumed : self.consumed + take]
            self.consumed += take
            computed = sum(sim.tokens(k, i)[1] for i in groups)
            self._run(sim.cost.train_time(computed, self.devices, strategy))

    def _run(self, duration: float, then: Callable[[], None] | None = None) -> None:
        self.running = True
        self.busy.append((self.sim.now, self.sim.now + duration, 1))
        self.sim.at(self.sim.now + duration, self._done, then)

    def _done(self, then: Callable[[], None] | None) -> None:
        self.running = False
        if then is not None:
            then()
        if not self.running:
            self._work()

    def _stepped(self) -> None:
        self._run(self.sim.cost.publish_s, self._published)

    def _published(self) -> None:
        self.ends.append(self.sim.now)
        self.iteration += 1
        self.consumed = 0
        self.sim.publish(self.iteration)
