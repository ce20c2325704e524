"""A reward gets the row's metadata exactly when it asks for it (a `metadata` keyword or
`**kwargs`); every reward written for `(prompt, completion, answer)` is called as before."""

from __future__ import annotations

import threading

import pytest

from cadence.rewards import TimedReward, safe_reward
from cadence.rewards.calls import call_reward, takes_metadata

ROW = {"source_dataset": "chain_sum", "n": 3}


def three_texts(prompt: str, completion: str, answer: str) -> float:
    return 1.0


def with_metadata(prompt: str, completion: str, answer: str, *, metadata=None) -> float:
    return float(metadata["n"]) if metadata is not None else -1.0


def trl_style(prompt, completion, answer, **kwargs) -> float:
    return float(kwargs["metadata"]["n"]) if "metadata" in kwargs else -1.0


def positional_only(prompt, completion, answer, metadata=None, /) -> float:
    return -1.0


class Scorer:
    def __call__(self, prompt: str, completion: str, answer: str, metadata=None) -> float:
        return float(metadata["n"]) if metadata is not None else -1.0


def test_which_rewards_take_metadata() -> None:
    assert not takes_metadata(three_texts)
    assert takes_metadata(with_metadata) and takes_metadata(trl_style)
    assert takes_metadata(Scorer())
    assert not takes_metadata(positional_only)  # cannot be passed by name
    assert not takes_metadata(max)  # a builtin without a signature


@pytest.mark.parametrize(
    ("fn", "expected"),
    [(three_texts, 1.0), (with_metadata, 3.0), (trl_style, 3.0), (Scorer(), 3.0)],
)
def test_the_row_reaches_only_rewards_that_ask(fn, expected) -> None:
    assert call_reward(fn, "p", "c", "a", ROW) == expected
    assert safe_reward(fn, "p", "c", "a", ROW).value == expected
    without = safe_reward(fn, "p", "c", "a")  # a row with no metadata: the three texts
    assert without.error is None and without.value == (1.0 if fn is three_texts else -1.0)


@pytest.mark.parametrize("thread", ["main", "other"])
def test_a_deadline_keeps_the_metadata(thread) -> None:
    timed = TimedReward(with_metadata, 5.0, "tests:with_metadata")
    plain = TimedReward(three_texts, 5.0, "tests:three_texts")
    out: list = []

    def score() -> None:
        out.append(safe_reward(timed, "p", "c", "a", ROW).value)
        out.append(safe_reward(plain, "p", "c", "a", ROW).value)

    if thread == "main":
        score()
    else:
        t = threading.Thread(target=score)
        t.start()
        t.join(timeout=30)
    assert out == [3.0, 1.0]
