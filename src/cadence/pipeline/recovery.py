"""Worker recovery for the producer: replace a dead worker, and train what it re-sends once.

A worker that dies is replaced in its slot, up to `max_restarts` times per slot over the run;
one more death stops the run with `WorkerDied`, naming the budget. The replacement is given the
version the transport holds (no version can be published until it acknowledges one) and is sent
again the prompts the dead one had not returned, under their old task ids, so the same seeds
make the same groups. A group that reaches the producer twice in an iteration (one the dead
worker sent just before dying, generated again) is dropped and counted: `fresh` says which.
"""

from __future__ import annotations

import logging
import time

from cadence.backend import Pool, WorkerDied
from cadence.pipeline.gate import WeightGate
from cadence.types import Group

log = logging.getLogger(__name__)


class Recovery:
    def __init__(self, pool: Pool, gate: WeightGate, max_restarts: int) -> None:
        self.pool, self.gate, self.max_restarts = pool, gate, max_restarts
        self.restarts = [0] * pool.num_workers  # replacements so far, per worker slot
        self.duplicates = 0  # groups received twice and dropped
        self._delivered: dict[int, set[str]] = {}  # iteration -> prompt uids passed on

    def replace(self, died: WorkerDied) -> None:
        """Start a new worker in a dead one's slot, give it the newest published weights and
        send it again the prompts the dead one had not returned (same task ids)."""
        wid = died.wid
        if self.restarts[wid] >= self.max_restarts:
            raise WorkerDied(
                f"{died}; restarted {self.restarts[wid]} time(s) already "
                f"(pipeline.max_worker_restarts = {self.max_restarts})",
                wid,
            ) from died
        self.restarts[wid] += 1
        start = time.monotonic()
        version = self.gate.reset(wid)
        lost = self.pool.replace(wid)
        if version >= 0:
            self.pool.send_sync_to(wid, version, self.gate.expected(version))
        for task_id, (prompts, iteration) in sorted(lost.items()):
            self.pool.submit(wid, task_id, prompts, iteration)
        log.warning(
            "%s; replaced in %.1fs (restart %d of %d), %d prompts sent again",
            died,
            time.monotonic() - start,
            self.restarts[wid],
            self.max_restarts,
            sum(len(prompts) for prompts, _ in lost.values()),
        )

    def fresh(self, group: Group) -> bool:
        """True the first time `group`'s prompt arrives in its iteration; False (counted) after."""
        delivered = self._delivered.setdefault(group.iteration, set())
        if group.prompt.uid in delivered:
            self.duplicates += 1
            return False
        delivered.add(group.prompt.uid)
        return True

    def finished(self, iteration: int) -> None:
        """Every task of `iteration` is done: nothing of it can arrive again."""
        self._delivered.pop(iteration, None)
