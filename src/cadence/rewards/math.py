"""Exact-answer math reward, checked by the math-verify library.

The gold answer is the text after "####" in the reference; the prediction is the first line after
the completion's last "####", or, without one, the whole completion. When the gold answer is a
plain number (GSM8K's convention), the prediction is cut down to its last number: math-verify
evaluates expressions, so "10 + 5" would otherwise be judged equal to 15, and a policy learns to
restate the question instead of answering it (seen in training). Parsing costs about 0.7 ms and
answers repeat a lot, so parsed strings are cached.

This module must not hand-write a math checker (math-verify is the verifier) and holds no state
beyond the parse cache.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from typing import Any

from math_verify import parse, verify

from cadence.data.base import reference_answer

_CACHE_SIZE = 1 << 16
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")  # 12, -3, 1,000, 2.5, .5


class _NoDisabledTimeoutWarning(logging.Filter):
    """math-verify warns, once per process, that it runs without a timeout outside the main
    thread; cadence's callers put a deadline of their own on every call (`TimedReward`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.grader", "math_verify.parser"):
    logging.getLogger(_name).addFilter(_NoDisabledTimeoutWarning())


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _parse_cached(text: str) -> tuple[Any, ...]:
    # The result does not depend on the timeout mode, so one cache serves all threads.
    if _in_main_thread():
        return tuple(parse(text))
    return tuple(parse(text, parsing_timeout=None))


def extract_prediction(completion: str) -> str:
    """The part of a completion that is graded (see the module docstring)."""
    _, sep, tail = completion.rpartition("####")
    if not sep:
        return completion.strip()
    lines = tail.strip().splitlines()
    return lines[0].strip() if lines else ""


def last_number(text: str) -> str:
    """The last number written in `text` ("" if none): the answer of a numeric task."""
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else ""


class MathReward:
    """1.0 if the completion's final answer equals the reference's final answer, else 0.0.

    math-verify's timeouts use `signal.alarm`, which works only in the main thread. Elsewhere this
    class calls it with `parsing_timeout=None` and `timeout_seconds=None`: it still works, but has
    no timeout of its own, so a pathological completion could stall the thread; cadence calls
    every reward through `TimedReward` (`reward.timeout_s`), which cuts it in any thread.

    Raises ValueError if the reference has no "####" answer or math-verify cannot parse it: a
    broken reference is a data error, not a wrong completion.
    """

    def __call__(self, prompt: str, completion: str, answer: str) -> float:
        gold_text = reference_answer(answer)
        gold = _parse_cached(gold_text)
        if not gold:
            raise ValueError(f"math-verify could not parse the reference answer {gold_text!r}")
        prediction = extract_prediction(completion)
        if _NUMBER.fullmatch(gold_text.strip()):
            prediction = last_number(prediction)
        if not prediction:
            return 0.0
        predicted = _parse_cached(prediction)
        if not predicted:
            return 0.0
        if _in_main_thread():
            ok = verify(list(gold), list(predicted))
        else:
            ok = verify(list(gold), list(predicted), timeout_seconds=None)
        return 1.0 if ok else 0.0
