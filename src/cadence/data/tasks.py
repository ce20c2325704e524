"""Task families with verifiable answers, and how a task instance becomes a `Prompt`.

`ArithmeticTask` generates short, regular word problems and plain sums for a tiny model trained
from scratch: a handful of names, objects and verbs; operations +, - and (at difficulty 3) a
multiplication by 2..5; worked answers in the GSM8K convention ("12 + 7 = 19\\n#### 19").
Every example is a pure function of (seed, split, index), hashed with SHA-256 rather than
Python's salted `hash()`, so runs and resumes reproduce exactly. The held-out set is the first
`num_heldout` distinct held-out questions; the training stream never yields one of them.

This module must not do I/O, touch the network or import torch: it is data, not a loader
(files live in `gsm8k.py`). The registry of task families (`TASKS`, `load_task`) is here too.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import count, islice
from typing import Any

from cadence.data.base import (
    DEFAULT_TEMPLATE,
    Example,
    Task,
    make_prompt,
    reference_answer,
    stable_seed,
    to_prompt,
)
from cadence.data.dataset import DatasetTask
from cadence.data.gsm8k import JsonlTask
from cadence.data.reasoning_gym import ReasoningGymTask

__all__ = [
    "DEFAULT_TEMPLATE",
    "TASKS",
    "ArithmeticTask",
    "Example",
    "Task",
    "load_task",
    "make_prompt",
    "reference_answer",
    "stable_seed",
    "to_prompt",
]

SPLITS = ("train", "heldout")

# (max steps, largest operand, multiplication allowed) per difficulty.
_DIFFICULTY = {1: (1, 20, False), 2: (2, 50, False), 3: (3, 99, True)}
_NAMES = (("Tom", "he"), ("Ann", "she"), ("Sam", "he"), ("Mia", "she"), ("Ben", "he"))
_OBJECTS = ("apples", "pens", "books", "coins", "cards")
_ADD_VERBS = ("buys", "finds", "gets")
_SUB_VERBS = ("gives away", "loses", "sells")
_MUL_PROBABILITY = 0.25
_MAX_REDRAWS = 1000


@dataclass(frozen=True)
class _Step:
    op: str  # "+", "-" or "*"
    operand: int
    verb: str  # the word-problem verb; "" for a multiplication


class ArithmeticTask:
    """Seeded arithmetic word problems and sums; difficulty 1..3 sets steps and operand range.

    d1: one step, operands up to 20; d2: 1-2 steps, up to 50; d3: 1-3 steps, up to 99, with at
    most one multiplication by 2..5; `max_operand` overrides the level's operand range. The start
    value is drawn from 0..max; each later operand from 1..max, and a subtraction never takes more
    than the running total, so no result is negative.

    `seed` draws the training stream; `heldout_seed` (default: `seed`) draws the held-out split,
    so runs with different seeds can be measured on the same held-out problems.
    """

    num_skipped = 0  # generated, never read from a file: nothing is ever malformed

    def __init__(
        self,
        difficulty: int = 1,
        seed: int = 0,
        num_heldout: int = 200,
        max_operand: int | None = None,
        heldout_seed: int | None = None,
    ) -> None:
        if difficulty not in _DIFFICULTY or isinstance(difficulty, bool):
            raise ValueError(f"difficulty must be 1, 2 or 3, got {difficulty!r}")
        if max_operand is not None and max_operand < 2:
            raise ValueError(f"max_operand must be >= 2 (or None), got {max_operand}")
        self.max_operand = max_operand
        if num_heldout < 0:
            raise ValueError(f"num_heldout must be >= 0, got {num_heldout}")
        self.difficulty = difficulty
        self.seed = seed
        self.heldout_seed = seed if heldout_seed is None else heldout_seed
        self.num_heldout = num_heldout
        self._heldout: list[Example] | None = None
        self._heldout_questions: frozenset[str] = frozenset()

    def example(self, i: int, split: str) -> Example:
        """The raw i-th example of `split`; train examples may collide with held-out ones."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        seed = self.heldout_seed if split == "heldout" else self.seed
        return self._draw(f"{seed}:{split}:{i}")

    def heldout(self) -> list[Example]:
        """The first `num_heldout` distinct held-out questions (computed once)."""
        if self._heldout is None:
            self._heldout = self._first_distinct_heldout(self.num_heldout)
            self._heldout_questions = frozenset(e.question for e in self._heldout)
        return list(self._heldout)

    def train_example(self, i: int) -> Example:
        """The i-th training example: re-drawn (deterministically) while it is a held-out one."""
        self.heldout()
        key = f"{self.seed}:train:{i}"
        example = self._draw(key)
        for attempt in range(1, _MAX_REDRAWS + 1):
            if example.question not in self._heldout_questions:
                return example
            example = self._draw(f"{key}:{attempt}")
        raise RuntimeError(
            f"train example {i} collided with the held-out set {_MAX_REDRAWS} times; "
            f"num_heldout={self.num_heldout} is too large for difficulty {self.difficulty}"
        )

    def train_iter(self, start: int = 0) -> Iterator[Example]:
        """Infinite training stream; `train_iter(k)` resumes after k examples were consumed."""
        return (self.train_example(i) for i in count(start))

    def train_examples(self, n: int, start: int = 0) -> list[Example]:
        return list(islice(self.train_iter(start), n))

    def corpus(self, n: int) -> list[str]:
        """`n` prompt + answer texts from the training stream, for training a tokenizer."""
        return [make_prompt(e.question) + e.answer for e in self.train_examples(n)]

    def _first_distinct_heldout(self, n: int) -> list[Example]:
        found: dict[str, Example] = {}
        for i in range(100 * n + 1000):
            if len(found) >= n:
                break
            example = self.example(i, "heldout")
            found.setdefault(example.question, example)
        if len(found) < n:
            raise RuntimeError(f"found only {len(found)} distinct held-out questions, need {n}")
        return list(found.values())

    def _draw(self, key: str) -> Example:
        rng = random.Random(stable_seed(key))
        max_steps, hi, allow_mul = _DIFFICULTY[self.difficulty]
        hi = self.max_operand or hi
        start = rng.randint(0, hi)
        steps = _draw_steps(rng, start, rng.randint(1, max_steps), hi, allow_mul)
        lines, total = _worked_lines(start, steps)
        if rng.random() < 0.5:
            question = _plain_question(start, steps)
        else:
            question = _word_question(rng, start, steps)
        return Example(question=question, answer="\n".join([*lines, f"#### {total}"]))


def _draw_steps(
    rng: random.Random, start: int, num_steps: int, hi: int, allow_mul: bool
) -> list[_Step]:
    steps: list[_Step] = []
    total = start
    for _ in range(num_steps):
        used_mul = any(s.op == "*" for s in steps)
        if allow_mul and not used_mul and rng.random() < _MUL_PROBABILITY:
            step = _Step("*", rng.randint(2, 5), "")
        elif total == 0 or rng.random() < 0.5:
            step = _Step("+", rng.randint(1, hi), rng.choice(_ADD_VERBS))
        else:
            step = _Step("-", rng.randint(1, min(hi, total)), rng.choice(_SUB_VERBS))
        total = _apply(total, step)
        steps.append(step)
    return steps


def _apply(total: int, step: _Step) -> int:
    if step.op == "+":
        return total + step.operand
    if step.op == "-":
        return total - step.operand
    return total * step.operand


def _worked_lines(start: int, steps: list[_Step]) -> tuple[list[str], int]:
    lines = []
    total = start
    for step in steps:
        new_total = _apply(total, step)
        lines.append(f"{total} {step.op} {step.operand} = {new_total}")
        total = new_total
    return lines, total


def _plain_question(start: int, steps: list[_Step]) -> str:
    # Parenthesise before a multiplication so left-to-right order is also the precedence order.
    expr = str(start)
    for step in steps:
        if step.op == "*" and ("+" in expr or "-" in expr):
            expr = f"({expr})"
        expr = f"{expr} {step.op} {step.operand}"
    return f"What is {expr}?"


def _word_question(rng: random.Random, start: int, steps: list[_Step]) -> str:
    name, pronoun = rng.choice(_NAMES)
    obj = rng.choice(_OBJECTS)
    clauses = [_clause(step) for step in steps]
    last = clauses.pop()
    actions = f"{', '.join(clauses)} and {last}" if clauses else last
    return (
        f"{name} has {start} {obj}. {pronoun.capitalize()} {actions}. "
        f"How many {obj} does {pronoun} have now?"
    )


def _clause(step: _Step) -> str:
    if step.op == "+":
        return f"{step.verb} {step.operand} more"
    if step.op == "-":
        return f"{step.verb} {step.operand}"
    return f"then has {step.operand} times as many"


TASKS: dict[str, Callable[..., Task]] = {
    "arithmetic": ArithmeticTask,
    "gsm8k": JsonlTask,
    "dataset": DatasetTask,
    "reasoning_gym": ReasoningGymTask,  # imports reasoning-gym when built, never before
}


def load_task(name: str, **kwargs: Any) -> Task:
    """Build the task registered as `name` with its keyword arguments."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name](**kwargs)
