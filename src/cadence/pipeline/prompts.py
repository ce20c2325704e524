"""The data cursor: hands out each iteration's prompts from a task's training stream.

The cursor is a plain integer so a run can be resumed exactly; prompt `index` is the position in
the iteration's batch, which (with the run seed and iteration) fixes the sampling seeds.
"""

from __future__ import annotations

from cadence.data import to_prompt
from cadence.types import Prompt


class PromptStream:
    def __init__(self, task, template: str, name: str, start: int = 0) -> None:
        self.template = template
        self.name = name
        self.cursor = start
        self.batch_starts: list[int] = []  # the cursor at each batch's first example
        self._it = task.train_iter(start)

    def next_batch(self, n: int) -> list[Prompt]:
        self.batch_starts.append(self.cursor)
        batch = []
        for index in range(n):
            example = next(self._it)
            batch.append(to_prompt(example, f"{self.name}:{self.cursor}", index, self.template))
            self.cursor += 1
        return batch


def heldout_prompts(task, template: str, name: str) -> list[Prompt]:
    return [
        to_prompt(ex, f"{name}:heldout:{i}", i, template) for i, ex in enumerate(task.heldout())
    ]
