"""The step skeleton both trainers share: how an iteration's scored groups become micro-batches
(or rounds of ranks) that never straddle an optimizer step, and the count of skipped steps.

The one-process learner and the sharded driver differ only in what they do with a chunk (one
micro-batch, or one round split among the ranks); when a step ends, and what happens when fewer
groups come than announced, is decided here once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class BadStepsError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


def step_chunks(
    scored: Iterable[T], num_groups: int, mini_batches: int, size: int
) -> Iterator[tuple[list[T], bool]]:
    """(chunk, ends a step) for `num_groups` groups as they come: chunks of at most `size` groups
    in arrival order, a step ending after each mini-batch's last group. Fewer may come (the
    pipeline dropped a group): the last chunk then ends its step, or an empty chunk closes a step
    left open. Nothing is yielded for an iterable without groups."""
    per_step = math.ceil(num_groups / mini_batches)
    buffer: list[T] = []
    open_step = False  # chunks yielded since the last step ended
    for i, group in enumerate(scored, start=1):
        buffer.append(group)
        end = i % per_step == 0 or i == num_groups
        if len(buffer) == size or end:
            yield buffer, end
            buffer, open_step = [], not end
    if buffer or open_step:
        yield buffer, True


class BadSteps:
    """A step whose loss or gradient is NaN or inf is skipped (weights and optimizer state
    untouched); more than `limit` of them in a row stop training (`BadStepsError`)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_a_row = 0

    def count(self, bad: bool) -> None:
        self.in_a_row = self.in_a_row + 1 if bad else 0
        if self.in_a_row > self.limit:
            raise BadStepsError(
                f"{self.in_a_row} optimizer steps in a row had a non-finite loss or gradient and "
                f"were skipped (train.max_bad_steps = {self.limit}); the weights are those of the "
                "last good step"
            )
        if bad:
            log.warning(
                "optimizer step skipped: non-finite loss or gradient (%d in a row, at most %d)",
                self.in_a_row,
                self.limit,
            )
