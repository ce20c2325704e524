"""Mini-batches by prompt index, whatever order the workers finish in (periodic, mini_batches > 1).

With several optimizer steps per iteration, which groups share a step changes the update. Sync
cuts its steps from the iteration's groups in prompt order; a source that streams groups as they
finish would cut them in finishing order, which the workers' timing sets. `StepOrder` holds each
arriving group until every group of the earlier steps is in, then releases a step's groups (in
the order they came: within a step the order changes only the summation), so periodic trains
each step on the prompts sync would. A group that never comes (dropped) holds the later steps
until the iteration ends; `flush` then releases the rest in step order. Never reorders across
steps otherwise, and knows nothing of workers or the store.
"""

from __future__ import annotations

from collections import defaultdict

from cadence.types import Group


class StepOrder:
    """One iteration of `size` prompts, in steps of `per_step` consecutive prompt indices."""

    def __init__(self, size: int, per_step: int) -> None:
        if per_step < 1:
            raise ValueError(f"per_step must be >= 1; got {per_step}")
        self.size, self.per_step = size, per_step
        self.next_step = 0  # the first step not yet released
        self.held: dict[int, list[Group]] = defaultdict(list)

    def _expected(self, step: int) -> int:
        return min(self.per_step, self.size - step * self.per_step)

    def offer(self, group: Group) -> list[Group]:
        """`group` arrived; the groups now released (its step's and any later complete ones)."""
        self.held[group.prompt.index // self.per_step].append(group)
        out: list[Group] = []
        while self._expected(self.next_step) > 0 and len(self.held[self.next_step]) >= (
            self._expected(self.next_step)
        ):
            out += self.held.pop(self.next_step)
            self.next_step += 1
        return out

    def flush(self) -> list[Group]:
        """What is still held, step after step (the iteration's groups are all in)."""
        out = [g for step in sorted(self.held) for g in self.held[step]]
        self.held.clear()
        return out
