"""What every task is made of: an `Example` (question, worked answer), the `Task` Protocol, how
an example becomes a `Prompt`, and the answer and seed conventions the tasks share.

This module must not do I/O, touch the network or import torch.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import count, islice
from typing import Any, Protocol, runtime_checkable

from cadence.types import Prompt

DEFAULT_TEMPLATE = "Question: {question}\nAnswer: "


class DataError(ValueError):
    """A dataset file is missing, empty or malformed; the message names the file (and line)."""


@dataclass(frozen=True)
class Example:
    """One task instance: a question and its reference answer (the procedural tasks' and GSM8K's
    worked answers end in "#### <final answer>").

    A conversational prompt keeps its `messages` as (role, content) pairs, ending with the
    user's turn, whose text is `question`; a chat template renders them (data/chat.py). A task
    that mixes several labels each example with `task` and may keep the row's own `metadata` for
    its reward (both carried onto the `Prompt`).
    """

    question: str
    answer: str
    messages: tuple[tuple[str, str], ...] = ()
    task: str = ""
    # the row's own data (a reasoning-gym row's metadata, a data set row's columns): what the row
    # carries for its reward and environment, not what makes two examples the same
    metadata: dict[str, Any] | None = field(default=None, hash=False, compare=False)


class Task(Protocol):
    """What the pipeline needs from a task family."""

    num_skipped: int  # malformed source lines left out (`data.on_bad_line = "skip"`)

    def heldout(self) -> list[Example]: ...

    def train_iter(self, start: int = 0) -> Iterator[Example]: ...

    def corpus(self, n: int) -> list[str]: ...


def make_prompt(question: str, template: str = DEFAULT_TEMPLATE) -> str:
    """The text the model sees for `question`; `template` must contain "{question}"."""
    if "{question}" not in template:
        raise ValueError(f"prompt template {template!r} has no '{{question}}' placeholder")
    return template.replace("{question}", question)


def render_plain(example: Example, template: str = DEFAULT_TEMPLATE) -> str:
    """`template` with the question; a conversation cannot be rendered without a chat template."""
    if example.messages:
        raise DataError(
            "the prompts are conversations (lists of messages): render them with the "
            "tokenizer's chat template, data.chat_template = true"
        )
    return make_prompt(example.question, template)


@runtime_checkable
class Conversational(Protocol):
    """A renderer that also says which conversation it renders (data/chat.py's `ChatRender`)."""

    def __call__(self, example: Example) -> str: ...

    def messages(self, example: Example) -> list[dict[str, str]]: ...


def to_prompt(
    example: Example,
    uid: str,
    index: int,
    template: str | Callable[[Example], str] = DEFAULT_TEMPLATE,
) -> Prompt:
    """Wrap an example as the `Prompt` record that crosses into the workers; `template` is a
    plain template or a renderer (data/chat.py). A chat prompt keeps its conversation too."""
    text = render_plain(example, template) if isinstance(template, str) else template(example)
    messages: tuple[tuple[str, str], ...] = ()
    if isinstance(template, Conversational):
        messages = tuple((m["role"], m["content"]) for m in template.messages(example))
    return Prompt(
        uid=uid,
        text=text,
        answer=example.answer,
        index=index,
        task=example.task,
        metadata=example.metadata,
        messages=messages,
    )


def reference_answer(answer: str) -> str:
    """The final answer: the text after the last "####", stripped."""
    _, sep, tail = answer.rpartition("####")
    final = tail.strip()
    if not sep or not final:
        raise ValueError(f"answer has no '#### <final answer>' line: {answer!r}")
    return final


def stable_seed(key: str) -> int:
    """A 64-bit seed from a string, identical across processes and Python versions."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")


def shuffled_epochs(rows: Sequence[Example], seed: int, start: int = 0) -> Iterator[Example]:
    """`rows` forever, each epoch in its own seeded order; starting at `start` resumes a stream
    after `start` rows were consumed, identically in any process (what every task's
    `train_iter` is)."""
    n = len(rows)
    epoch, pos = divmod(start, n)
    for e in count(epoch):
        order = list(range(n))
        random.Random(stable_seed(f"{seed}:epoch:{e}")).shuffle(order)
        for i in order[pos:]:
            yield rows[i]
        pos = 0


class ListedTask:
    """What a task whose examples are lists in memory (a data set's rows, a reasoning-gym mix)
    answers from `_train`, `_heldout` and `seed`: the held-out set, an endless training stream
    shuffled per epoch, and texts for a tokenizer. Its subclasses only fill the lists."""

    _train: list[Example]
    _heldout: list[Example]
    seed: int

    def heldout(self) -> list[Example]:
        return list(self._heldout)

    def train_iter(self, start: int = 0) -> Iterator[Example]:
        """Infinite training stream; `train_iter(k)` resumes after k examples were consumed."""
        return shuffled_epochs(self._train, self.seed, start)

    def corpus(self, n: int) -> list[str]:
        """`n` prompt + answer texts from the training stream, for training a tokenizer."""
        return [make_prompt(e.question) + e.answer for e in islice(self.train_iter(), n)]
