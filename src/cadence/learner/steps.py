"""The step skeleton both trainers share: how an iteration's scored groups become micro-batches
(or rounds of ranks) that never straddle an optimizer step, and the count of skipped steps.

Micro-batches are `micro_batch_groups` whole groups, or packed up to `micro_batch_tokens`
positions of the learner's layout (what it computes, padding included), a group over the budget
split by its responses unless its loss reads the whole group. The
one-process learner and the sharded driver differ only in what they do with a chunk; when a
step ends, and what happens when fewer groups come than announced, is decided here once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import TypeVar

from cadence.learner.packing import group_tokens, positions
from cadence.learner.scorer import Scored

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


def micro_batches(
    scored: Iterable[Scored],
    num_groups: int,
    mini_batches: int,
    groups: int,
    tokens: int = 0,
    whole: bool = False,
    layout: str = "packed",
) -> Iterator[tuple[list[Scored], bool]]:
    """(micro-batch, ends a step): `groups` whole groups (`step_chunks`), or with `tokens` > 0
    packed up to that many positions of `layout` (`token_chunks`)."""
    if tokens:
        return token_chunks(scored, num_groups, mini_batches, tokens, whole, layout)
    return step_chunks(scored, num_groups, mini_batches, groups)


def token_chunks(
    scored: Iterable[Scored],
    num_groups: int,
    mini_batches: int,
    budget: int,
    whole: bool,
    layout: str = "packed",
) -> Iterator[tuple[list[Scored], bool]]:
    """(micro-batch, ends a step) as `step_chunks`, each micro-batch at most `budget` positions
    of `layout` (what it allocates, padding included: `positions`); a group over the budget goes
    in parts (`split`) unless `whole` (a loss that reads its group), and a part over it alone
    goes alone."""
    per_step = math.ceil(num_groups / mini_batches)
    buffer: list[Scored] = []
    open_step = False
    for i, group in enumerate(scored, start=1):
        for part in [group] if whole else split(group, budget, layout):
            if buffer and cost([*buffer, part], layout) > budget:
                yield buffer, False
                buffer, open_step = [], True
            buffer.append(part)
        if i % per_step == 0 or i == num_groups:
            yield buffer, True
            buffer, open_step = [], False
    if buffer or open_step:
        yield buffer, True


def cost(parts: Scored | list[Scored], layout: str = "packed") -> int:
    """Positions `layout` computes for `parts` in one pass (a group's prompt once, its
    responses, and the padding the layout adds)."""
    parts = parts if isinstance(parts, list) else [parts]
    return positions(layout, [group_tokens(s.group) for s in parts])


def split(s: Scored, budget: int, layout: str = "packed") -> list[Scored]:
    """`s` in parts of consecutive responses, each with the prompt and within `budget`
    positions of `layout` (a response that does not fit with the prompt is a part alone); `[s]`
    when it fits whole."""
    if cost(s, layout) <= budget:
        return [s]
    parts, start = [], 0
    for j in range(1, len(s.group.completions) + 1):
        if j - 1 > start and cost(_part(s, start, j), layout) > budget:
            parts.append(_part(s, start, j - 1))
            start = j - 1
    parts.append(_part(s, start, len(s.group.completions)))
    return parts


def _part(s: Scored, start: int, end: int) -> Scored:
    group = replace(s.group, completions=s.group.completions[start:end])
    cut = slice(start, end)
    return Scored(group, s.rewards[cut], s.advantages[cut], s.trains[cut])


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
