"""Weight sync: how the learner's parameters reach the workers, and when.

A transport (`WeightSync`) moves one version's parameters: `SharedWeights` (local backend) holds
one shared-memory copy of every parameter, written by `publish` and loaded from by each worker
(`EngineWeights.load`); the tensors are handed to each worker process once, at spawn, and nothing is
pickled per iteration. The Ray transports are in `ray_weights`. `InMemoryWeights` is the
deterministic fake: plain tensors, and a record of every version published.

`WeightGate` decides when: it is the version barrier between the learner and the workers (see
its docstring). Publishing and loading never overlap because of it. `LearnerWeights` brings an
engine with its own copy in the learner's process to the learner's weights.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from cadence.engine import EngineWeights
from cadence.models.lora import plain_weights


class WeightSync(Protocol):
    def publish(self, model: torch.nn.Module, version: int) -> None: ...


class SharedWeights:
    def __init__(self, model: torch.nn.Module) -> None:
        self.tensors: dict[str, torch.Tensor] = {
            name: p.detach().clone().share_memory_() for name, p in model.named_parameters()
        }
        self.version = -1

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        for name, p in model.named_parameters():
            self.tensors[name].copy_(p)
        # On a GPU the copies are only queued, and the workers read these tensors through CUDA
        # IPC, outside this process's stream order: they must be done before a worker is told.
        devices = {t.device for t in self.tensors.values() if t.is_cuda}
        for device in devices:
            torch.cuda.synchronize(device)
        self.version = version


class InMemoryWeights:
    """The fake transport: `tensors` as `SharedWeights` has them (for workers in this process),
    and `versions`, every version published, in order."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.tensors = {name: p.detach().clone() for name, p in model.named_parameters()}
        self.versions: list[int] = []

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        for name, p in model.named_parameters():
            self.tensors[name].copy_(p)
        self.versions.append(version)


class LearnerWeights:
    """The learner's weights for an engine with its own copy (`owns_weights`, vLLM) in the
    learner's process: colocated rollouts and held-out evaluation. `sync` loads the learner's
    current weights into the engine (names checked against the engine's model) as a plain model
    names them: a LoRA policy's adapter merged in (`plain_weights`). Every path that feeds the
    learner's weights to an engine in its own process comes through here, so none can forget
    the merge."""

    def __init__(self, weights: EngineWeights, model: torch.nn.Module) -> None:
        self.weights, self.model = weights, plain_weights(model)

    def sync(self, version: int | None = None) -> None:
        self.weights.load({n: p.detach() for n, p in self.model.named_parameters()}, version)


def learner_sync(
    weights: EngineWeights, model: torch.nn.Module
) -> Callable[[int | None], None] | None:
    """How the learner's current weights reach the engine of `weights` in the learner's process:
    None where the engine decodes with the learner's own model (nothing to bring over), else
    `LearnerWeights.sync`."""
    return LearnerWeights(weights, model).sync if weights.engine.owns_weights else None


class WeightGate:
    """The version barrier over a transport and `num_workers` workers.

    The learner `publish`es version v: once every worker has acknowledged the previously
    published version (so none is reading the transport while it is written), it writes v and
    queues a sync notice for the producer, who sends it to every worker behind the work already
    queued (`take`). With `wait`, it then blocks until every worker has loaded v (on-policy: no
    prompt of v's iteration may reach a worker before). `release(v)` tells the producer it may
    begin the iterations v admits. The producer reports each worker's acknowledgements (`acked`);
    a worker replaced in a slot acknowledges nothing until it loads a version (`reset`).

    Every wait polls `check` (which raises whatever stopped the pipeline meanwhile) and gives up
    after `timeout_s` with a `TimeoutError` that says what the workers did not do.
    """

    def __init__(
        self,
        weights: WeightSync,
        num_workers: int,
        timeout_s: float = 300.0,
        check: Callable[[], None] = lambda: None,
    ) -> None:
        self.weights, self.timeout_s, self.check = weights, timeout_s, check
        self._cond = threading.Condition()
        self._acked = [-1] * num_workers  # newest version each worker has loaded
        self._released = -1  # newest version the producer may admit iterations for
        self._held = -1  # the version the transport holds
        self._new: list[int] = []  # published, not yet taken by the producer

    def publish(self, model: torch.nn.Module, version: int, wait: bool = True) -> None:
        """Write `version` once the workers are done with the last one; with `wait`, return only
        once every worker has loaded it. A version already released is not written again."""
        if version <= self._released:
            return
        with self._cond:  # held while writing: a worker replaced meanwhile reads whole weights
            self._wait(lambda: min(self._acked) >= self._released, "load the previous weights")
            self.weights.publish(model, version)
            self._held = version
            self._new.append(version)
            self._cond.notify_all()
        if wait:
            with self._cond:
                self._wait(lambda: min(self._acked) >= version, f"load version {version}")

    def release(self, version: int) -> None:
        with self._cond:
            self._released = max(self._released, version)
            self._cond.notify_all()

    def take(self) -> tuple[list[int], int]:
        """(versions published since the last take, to sync in this order; newest released)."""
        with self._cond:
            new, self._new = self._new, []
            return new, self._released

    def acked(self, wid: int, version: int) -> None:
        with self._cond:
            self._acked[wid] = version
            self._cond.notify_all()

    def reset(self, wid: int) -> int:
        """Slot `wid` now holds a fresh worker with no weights: no version is published until
        it acknowledges one. Returns the version the transport holds, for its first sync."""
        with self._cond:
            self._acked[wid] = -1
            return self._held

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        """Wait (holding the condition) until `ready()`; raise a failure or a timeout."""
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers did not {what} within {self.timeout_s:.0f}s")
            self._cond.wait(timeout=0.5)

    def wake(self) -> None:
        """Wake every wait (to see a failure `check` now raises)."""
        with self._cond:
            self._cond.notify_all()
