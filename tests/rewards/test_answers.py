"""reward.answer_format: which part of a completion (and of the reference) is graded, on
hand-written MATH-style cases as well as GSM8K's."""

from __future__ import annotations

import pytest

from cadence.rewards.answers import after_hashes, extract, last_boxed, prediction, reference
from cadence.rewards.math import MathReward

# MATH's `solution` column: a worked solution ending in a \boxed{} answer
HALF = r"We have $\frac{2}{4} = \frac{1}{2}$, so the answer is $\boxed{\frac{1}{2}}$."
ROOT = r"Since $x^2 = 2$ and $x > 0$, $x = \boxed{\sqrt{2}}$."


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"\boxed{5}", "5"),
        (r"so $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        (r"\boxed{\left\{ 1, 2 \right\}}", r"\left\{ 1, 2 \right\}"),  # escaped braces nest too
        (r"\boxed{a^{2^{3}}}", "a^{2^{3}}"),  # nested braces
        (r"first \boxed{1} then \boxed{2}", "2"),  # the last one
        (r"\boxed {7}", "7"),
        (r"\fbox{8}", "8"),
        (r"\boxed{unclosed", None),
        ("no box at all", None),
    ],
)
def test_last_boxed_handles_nesting(text: str, expected: str | None) -> None:
    assert last_boxed(text) == expected


def test_each_format_picks_its_part() -> None:
    text = r"3 + 4 = 7, then $\boxed{7}$" + "\n#### 8\nthe end 9"
    assert extract(text, "hashes") == "8"
    assert extract(text, "boxed") == "7"
    assert extract(text, "last_number") == "9"
    assert extract(text, "auto") == "8"  # "####" comes after the box
    assert extract(r"#### 8 and then \boxed{7}", "auto") == "7"  # the box comes last
    assert extract("nothing marked 5", "auto") is None
    assert after_hashes("####") == ""


def test_a_missing_marker_means_no_answer_except_under_hashes_and_auto() -> None:
    assert prediction("the answer is 5", "boxed") == ""
    assert prediction("the answer is five", "last_number") == ""
    assert prediction("the answer is 5", "hashes") == "the answer is 5"  # graded whole
    assert prediction("the answer is 5", "auto") == "the answer is 5"


def test_reference_is_extracted_like_a_completion_or_taken_whole() -> None:
    assert reference(HALF, "boxed") == r"\frac{1}{2}"
    assert reference(HALF, "auto") == r"\frac{1}{2}"
    assert reference("12 + 7 = 19\n#### 19", "hashes") == "19"
    assert reference(r"\frac{3}{4}", "boxed") == r"\frac{3}{4}"  # a bare answer column
    assert reference(" 42 ", "last_number") == "42"


@pytest.mark.parametrize("answer_format", ["boxed", "auto"])
@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        (r"The answer is $\boxed{0.5}$.", HALF, 1.0),  # \frac{1}{2} = 0.5
        (r"The answer is $\boxed{\frac{1}{2}}$.", HALF, 1.0),
        (r"The answer is $\boxed{\dfrac{2}{4}}$.", HALF, 1.0),
        (r"The answer is $\boxed{\frac{1}{3}}$.", HALF, 0.0),  # a wrong boxed answer
        (r"$x = \boxed{\sqrt{2}}$", ROOT, 1.0),
        (r"$x = \boxed{2^{1/2}}$", ROOT, 1.0),
        (r"$x = \boxed{\sqrt{3}}$", ROOT, 0.0),
        (r"\boxed{\frac{1}{2}} is wrong, \boxed{\frac{1}{4}}", HALF, 0.0),  # the last box counts
        (r"\boxed{\frac{1}{2}", HALF, 0.0),  # a box that never closes
        (r"$\boxed{0.5}$", r"\frac{1}{2}", 1.0),  # a bare reference column
        # a plain-number reference takes the prediction's last number (no restated sums), so
        # a fraction against a decimal is not recognised in that direction
        (r"$\boxed{\frac{1}{2}}$", "0.5", 0.0),
    ],
)
def test_math_style_boxed_answers(
    answer_format: str, completion: str, gold: str, expected: float
) -> None:
    assert MathReward(answer_format)("", completion, gold) == expected


def test_no_boxed_answer_scores_zero_under_boxed_only() -> None:
    # the right value, written without a box: "boxed" demands the box; "auto" lets math-verify
    # search the whole completion
    completion = r"so the answer is $\frac{1}{2}$"
    assert MathReward("boxed")("", completion, HALF) == 0.0
    assert MathReward("auto")("", completion, HALF) == 1.0


@pytest.mark.parametrize(
    ("answer_format", "completion", "expected"),
    [
        ("last_number", "7 + 12 = 19 apples", 1.0),
        ("last_number", "19 is it, or 20", 0.0),
        ("last_number", "nineteen", 0.0),
        ("hashes", "#### 19", 1.0),
        ("boxed", r"\boxed{19}", 1.0),
        ("boxed", r"\boxed{10 + 9}", 0.0),  # numeric gold: the box's last number, not a sum
        ("boxed", "#### 19", 0.0),  # the reference's "####" still gives its answer
    ],
)
def test_numeric_gold_in_every_format(answer_format: str, completion: str, expected: float) -> None:
    assert MathReward(answer_format)("", completion, "12 + 7 = 19\n#### 19") == expected
