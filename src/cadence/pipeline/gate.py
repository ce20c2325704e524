"""The version gate: when the learner's new weights may be written and what an iteration admits.

`WeightGate` stands between the learner and the workers: a version is written only once every
worker has loaded the previous one, and on-policy modes wait until every worker has loaded it
before the iteration's first prompt goes out. It moves nothing itself: the transport
(backend/weights.py) does, and the producer (producer.py) sends the sync notices.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from cadence.backend import WeightSync
from cadence.models.fingerprint import Fingerprints, published


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
        verify: bool = True,
    ) -> None:
        """`verify`: fingerprint what each version publishes (models/fingerprint.py), for the
        workers to check what they load against (`expected`)."""
        self.weights, self.timeout_s, self.check = weights, timeout_s, check
        self.verify = verify
        self._expected: dict[int, Fingerprints] = {}  # the versions a worker may still load
        self._cond = threading.Condition()
        self._acked = [-1] * num_workers  # newest version each worker has loaded
        self._released = -1  # newest version the producer may admit iterations for
        self._held = -1  # the version the transport holds
        self._new: list[int] = []  # published, not yet taken by the producer

    def publish(self, model: torch.nn.Module, version: int, wait: bool = True) -> None:
        """Write `version` once the workers are done with the last one; with `wait`, return only
        once every worker has loaded it. A version already released is not written again."""
        if version < self._released:  # a counter gone backwards would disable the staleness rule
            raise RuntimeError(
                f"the learner publishes version {version} after releasing {self._released}: "
                "policy versions never go back (a trainer restored to an older version?)"
            )
        if version == self._released:
            return
        with self._cond:  # held while writing: a worker replaced meanwhile reads whole weights
            self._wait(lambda: min(self._acked) >= self._released, "load the previous weights")
            if self.verify:  # what a worker that loads it must then hold; older ones go
                write = lambda: self.weights.publish(model, version)  # noqa: E731
                self._expected = {version: published(model, write)}
            else:
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

    def expected(self, version: int) -> Fingerprints | None:
        """The fingerprints of what `version` published (None: not verified)."""
        return self._expected.get(version)

    def take(self) -> tuple[list[int], int]:
        """(versions published since the last take, to sync in this order; newest released)."""
        with self._cond:
            new, self._new = self._new, []
            return new, self._released

    def acked(self, wid: int, version: int) -> None:
        """Worker `wid` loaded `version`: one the transport held, never older than its last."""
        with self._cond:
            if version > self._held or version < self._acked[wid]:
                raise RuntimeError(
                    f"worker {wid} reports weights of version {version}; the learner published "
                    f"up to {self._held} and the worker had loaded {self._acked[wid]}: its "
                    "weights are not the learner's"
                )
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
