"""The data cursor: hands out each iteration's prompts from a task's training stream.

The cursor is a plain integer so a run can be resumed exactly; prompt `index` is the position in
the iteration's batch, which (with the run seed and iteration) fixes the sampling seeds. Dynamic
sampling draws more prompts for an iteration (`extra`), positioned after its batch. A prompt's uid
is the stream's name and its example's position, so a batch drawn again has the same uids.

A prompt longer than `max_tokens` is skipped (the next example takes its place) or truncated to
its last `max_tokens` tokens (the end, where the question's template hands over to the answer, is
what the model continues from); either is counted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from cadence.data import DataError, Render, to_prompt
from cadence.types import Prompt

log = logging.getLogger(__name__)
MAX_SKIPS_IN_A_ROW = 1000  # examples skipped back to back before the stream gives up


class PromptFilter:
    """Applies `rollout.max_prompt_tokens`: skip or truncate, and count."""

    def __init__(
        self, encode: Callable[[str], list[int]] | None, max_tokens: int = 0, on_long: str = "skip"
    ) -> None:
        if on_long not in ("skip", "truncate"):
            raise ValueError(f"on_long must be 'skip' or 'truncate'; got {on_long!r}")
        self.encode, self.max_tokens, self.on_long = encode, max_tokens, on_long
        self.skipped = 0
        self.truncated = 0

    def __call__(self, prompt: Prompt) -> Prompt | None:
        """The prompt to use (perhaps truncated), or None to skip it."""
        if not self.max_tokens or self.encode is None:
            return prompt
        ids = self.encode(prompt.text)
        if len(ids) <= self.max_tokens:
            return prompt
        if self.on_long == "skip":
            self.skipped += 1
            return None
        self.truncated += 1
        return replace(prompt, token_ids=tuple(ids[-self.max_tokens :]))


class PromptStream:
    """A task's training examples as prompts, from position `start` of its stream.

    The producer draws from it in its own thread while the learner's thread reads its state for
    a checkpoint, hence the lock. A checkpoint records `position`: where the next example
    comes from, and where each batch drawn for an iteration not yet trained began (off-policy,
    the producer runs ahead); a stream resumed with those (`replay`) draws those batches again
    first, then goes on where the first one stopped, so it hands out what the uninterrupted
    stream would have.
    """

    def __init__(
        self,
        task,
        template: str | Render,
        name: str,
        start: int = 0,
        fit: PromptFilter | None = None,
        replay: Sequence[int] = (),
    ) -> None:
        self.task = task
        self.template = template
        self.name = name
        self.fit = fit or PromptFilter(None)
        self.batch_starts: list[int] = []  # where each batch of this process began, in order
        self._reader = _Reader(task, start)
        self._replay = list(replay)  # starts of batches to draw again, first
        self._lock = threading.Lock()

    @property
    def cursor(self) -> int:
        """The position of the next example drawn (after any batches to draw again)."""
        return self._reader.cursor

    @property
    def prompts_skipped(self) -> int:
        """Prompts left out as longer than the limit, so far."""
        return self.fit.skipped

    @property
    def bad_lines_skipped(self) -> int:
        """Malformed lines of the task's files left out (`data.on_bad_line = "skip"`)."""
        return self.task.num_skipped

    @property
    def prompts_truncated(self) -> int:
        """Prompts cut to the limit, so far."""
        return self.fit.truncated

    def next_batch(self, n: int) -> list[Prompt]:
        """The next iteration's `n` prompts, indexed 0..n-1."""
        with self._lock:
            reader = _Reader(self.task, self._replay.pop(0)) if self._replay else self._reader
            self.batch_starts.append(reader.cursor)
            return [self._next(reader, index) for index in range(n)]

    def extra(self, index: int) -> Prompt:
        """One more prompt for the current iteration (dynamic sampling), at position `index`."""
        with self._lock:
            return self._next(self._reader, index)

    def position(self, batches_trained: int) -> tuple[int, list[int]]:
        """For a checkpoint taken once this process has trained `batches_trained` batches: the
        next example's position, and the starts of the batches drawn but not yet trained."""
        with self._lock:
            return self._reader.cursor, self.batch_starts[batches_trained:] + self._replay

    def _next(self, reader: _Reader, index: int) -> Prompt:
        skipped_in_a_row = 0
        while True:
            example, position = reader.next()
            uid = f"{self.name}:{position}"
            prompt = self.fit(to_prompt(example, uid, index, self.template))
            if prompt is not None:
                return prompt
            skipped_in_a_row += 1
            if skipped_in_a_row >= MAX_SKIPS_IN_A_ROW:
                raise DataError(
                    f"{skipped_in_a_row} prompts in a row are longer than "
                    f"rollout.max_prompt_tokens = {self.fit.max_tokens}: raise it, or set "
                    "rollout.on_long_prompt = 'truncate'"
                )


class _Reader:
    """A task's training stream from `start`, and the position of its next example."""

    def __init__(self, task, start: int) -> None:
        self.cursor = start
        self._it = task.train_iter(start)

    def next(self) -> tuple[Any, int]:
        example, position = next(self._it), self.cursor
        self.cursor += 1
        return example, position


def heldout_prompts(
    task, template: str | Render, name: str, fit: PromptFilter | None = None
) -> list[Prompt]:
    """The task's held-out prompts; any that `fit` skips is left out (with a warning)."""
    fit = fit or PromptFilter(None)
    fitted = [
        fit(to_prompt(ex, f"{name}:heldout:{i}", i, template))
        for i, ex in enumerate(task.heldout())
    ]
    kept = [p for p in fitted if p is not None]
    if fit.skipped:
        log.warning(
            "%d held-out prompts are longer than rollout.max_prompt_tokens = %d and are left out",
            fit.skipped,
            fit.max_tokens,
        )
    return [replace(p, index=i) for i, p in enumerate(kept)]
