"""The data cursor: hands out each iteration's prompts from a task's training stream.

The cursor is a plain integer so a run can be resumed exactly; prompt `index` is the position in
the iteration's batch, which (with the run seed and iteration) fixes the sampling seeds. Dynamic
sampling draws more prompts for an iteration (`extra`), positioned after its batch.

A prompt longer than `max_tokens` is skipped (the next example takes its place) or truncated to
its last `max_tokens` tokens (the end, where the question's template hands over to the answer, is
what the model continues from); either is counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

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
    def __init__(
        self,
        task,
        template: str | Render,
        name: str,
        start: int = 0,
        fit: PromptFilter | None = None,
    ) -> None:
        self.task = task
        self.template = template
        self.name = name
        self.cursor = start
        self.fit = fit or PromptFilter(None)
        self.batch_starts: list[int] = []  # the cursor at each batch's first example
        self._it = task.train_iter(start)

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
        self.batch_starts.append(self.cursor)
        return [self._next(index) for index in range(n)]

    def extra(self, index: int) -> Prompt:
        """One more prompt for the current iteration (dynamic sampling), at position `index`."""
        return self._next(index)

    def _next(self, index: int) -> Prompt:
        skipped_in_a_row = 0
        while True:
            example = next(self._it)
            uid = f"{self.name}:{self.cursor}"
            self.cursor += 1
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
