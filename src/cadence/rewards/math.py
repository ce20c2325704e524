"""Exact-answer math reward, checked by the math-verify library.

This module must not hand-write a math checker (math-verify is the verifier) and holds no state
beyond the parse cache.

Read on: docs/data.md#rewards.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from cadence.rewards.answers import check_format, is_number, last_number, prediction, reference

_CACHE_SIZE = 1 << 16


class _NoDisabledTimeoutWarning(logging.Filter):
    """math-verify warns, once per process, that it runs without a timeout outside the main
    thread; cadence's callers put a deadline of their own on every call (`RewardRunner`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.grader", "math_verify.parser"):
    logging.getLogger(_name).addFilter(_NoDisabledTimeoutWarning())


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _parse_cached(text: str) -> tuple[Any, ...]:
    # The result does not depend on the timeout mode, so one cache serves all threads.
    from math_verify import parse  # here: sympy costs every process ~0.6 s to import

    if _in_main_thread():
        return tuple(parse(text))
    return tuple(parse(text, parsing_timeout=None))


def _parse_answer(text: str) -> tuple[Any, ...]:
    """An extracted answer, read as inline LaTeX first (bare `\\sqrt{2}` parses only so)."""
    return _parse_cached(f"${text}$") or _parse_cached(text)


def extract_prediction(completion: str, answer_format: str = "hashes") -> str:
    """The part of a completion that is graded (see rewards/answers.py)."""
    return prediction(completion, answer_format)


class MathReward:
    """1.0 if the completion's final answer equals the reference's final answer, else 0.0.

    math-verify's timeouts use `signal.alarm`, which works only in the main thread. Elsewhere this
    class calls it with `parsing_timeout=None` and `timeout_seconds=None`: it still works, but has
    no timeout of its own, so a pathological completion could stall the thread (and, holding the
    GIL, the process); cadence scores through `RewardRunner` (`reward.timeout_s` on every call),
    and by default one call at a time in the caller's thread (`concurrency` below), so that in a
    main thread math-verify keeps its own timeouts.

    Raises ValueError if the reference is empty or math-verify cannot parse its answer: a
    broken reference is a data error, not a wrong completion.
    """

    # Its default reward.concurrency (rewards/concurrent.py): it computes, so threads gain
    # nothing under the GIL, and one call at a time in a main thread keeps math-verify's own
    # timeouts, which stop a pathological answer a thread could not.
    concurrency = 1

    def __init__(self, answer_format: str = "auto") -> None:
        check_format(answer_format)
        self.answer_format = answer_format

    def __call__(self, prompt: str, completion: str, answer: str) -> float:
        gold_text = reference(answer, self.answer_format)
        gold = _parse_answer(gold_text) if gold_text else ()
        if not gold:
            raise ValueError(f"math-verify could not parse the reference answer {gold_text!r}")
        graded = prediction(completion, self.answer_format)
        if is_number(gold_text):
            graded = last_number(graded)
        if not graded:
            return 0.0
        whole = graded == completion.strip()  # no marker: math-verify searches the text
        predicted = _parse_cached(graded) if whole else _parse_answer(graded)
        if not predicted:
            return 0.0
        from math_verify import verify

        if _in_main_thread():
            ok = verify(list(gold), list(predicted))
        else:
            ok = verify(list(gold), list(predicted), timeout_seconds=None)
        return 1.0 if ok else 0.0
