"""MathReward scores final answers with math-verify, in any thread."""

from __future__ import annotations

import threading

import pytest

from cadence.rewards.math import MathReward, extract_prediction

GOLD = "12 + 7 = 19\n#### 19"


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("12 + 7 = 19\n#### 19", 1.0),
        ("#### 19", 1.0),
        ("12 + 7 = 18\n#### 18", 0.0),
        ("12 + 7 = 19", 1.0),  # no "####": math-verify takes the final number
        ("19.0", 1.0),
        ("#### 19.0", 1.0),
        ("#### 19\n#### 20 is wrong but comes last", 0.0),
        ("#### 18\nthen more text\n#### 19", 1.0),
        ("#### 19\nsome trailing text 7", 1.0),  # only the first line after "####" counts
        ("the cat sat on the mat", 0.0),
        ("", 0.0),
        ("   \n", 0.0),
        ("####", 0.0),
    ],
)
def test_scores_final_answer(completion: str, expected: float) -> None:
    assert MathReward()("Question: ...", completion, GOLD) == expected


def test_reference_without_a_marker_is_its_own_answer() -> None:
    # a bare answer column ("19") is the answer; a reference math-verify cannot read is an error
    assert MathReward("hashes")("", "#### 19", "19") == 1.0
    assert MathReward("hashes")("", "#### 18", "19") == 0.0
    for empty in ("", "  \n"):
        with pytest.raises(ValueError, match="could not parse the reference answer"):
            MathReward()("", "#### 19", empty)


def test_unknown_answer_format_is_refused() -> None:
    with pytest.raises(ValueError, match="hashes, boxed, last_number, auto; got 'boxes'"):
        MathReward("boxes")


def test_extract_prediction() -> None:
    assert extract_prediction("a\n#### 5 \nb") == "5"
    assert extract_prediction(" 3 + 4 = 7 ") == "3 + 4 = 7"
    assert extract_prediction("#### \n") == ""


def test_works_outside_the_main_thread() -> None:
    results: list[float] = []
    errors: list[BaseException] = []

    def score() -> None:
        try:
            reward = MathReward()
            # Strings not seen elsewhere, so math-verify really parses in this thread.
            results.append(reward("", "4321 - 1 = 4320\n#### 4320", "#### 4320"))
            results.append(reward("", "#### 4319", "#### 4320"))
        except BaseException as e:  # surfaced to the main thread below
            errors.append(e)

    thread = threading.Thread(target=score)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert errors == []
    assert results == [1.0, 0.0]


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("10 + 5", 0.0),  # restating the question is no answer, though it evaluates to 15
        ("#### 10 + 5", 0.0),
        ("10 + 5 = 15", 1.0),  # the last number is the answer
        ("10 + 5 = 15\n#### 15", 1.0),
        ("#### 1,5", 0.0),
        ("#### 15.", 1.0),
    ],
)
def test_numeric_answers_are_numbers_not_expressions(completion: str, expected: float) -> None:
    assert MathReward()("", completion, "10 + 5 = 15\n#### 15") == expected
