"""The calculator evaluates arithmetic by parsing, within bounds; anything else is refused."""

import pytest

from cadence.envs import CalculatorError, calculator, demonstration


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("3 + 4", "7"),
        ("123 + 456", "579"),
        (" 1000 - 1 ", "999"),
        ("7 / 2", "3.5"),
        ("8 / 4", "2"),  # an integral quotient is written without ".0"
        ("-(2 + 3) * 4", "-20"),
        ("2 ** 10", "1024"),
        ("17 // 5 + 17 % 5", "5"),  # 3 + 2
        ("0.1 + 0.2", "0.3"),  # 10 significant digits hide the float noise
    ],
)
def test_values(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("__import__('os').system('true')", "may hold only digits"),
        ("open('/etc/passwd')", "may hold only digits"),
        ("(1).__class__", "may hold only digits"),
        ("x + 1", "may hold only digits"),
        ("'a' * 3", "may hold only digits"),
        ("True + 1", "may hold only digits"),
        ("1e5", "may hold only digits"),
        ("1 +", "not an arithmetic expression"),
        ("(1 + 2) (3)", "not a number or"),  # parses (as a call), is refused by the walk
        ("1 / 0", "division by zero"),
        ("9 ** 9 ** 9", "larger than"),
        ("2 ** 100", "exponent larger than 64|larger than"),
        ("10 ** 15 * 10", "result not a number below"),
        ("1" * 201, "longer than 200"),
        ("+".join(["1"] * 40), "more than 64 parts"),
    ],
)
def test_refusals_name_the_problem(expression, why):
    with pytest.raises(CalculatorError, match=why):
        calculator(expression)


def test_a_demonstration_calls_the_calculator_for_each_worked_step():
    assert demonstration("123 + 456 = 579\n#### 579") == [
        ("<call>calculator: 123 + 456</call>", True),
        ("<result>579</result>", False),
        ("\n#### 579", True),
    ]
    # several steps: each result comes from the tool, the final answer from the policy
    segments = demonstration("5 + 3 = 8\n8 * 2 = 16\n#### 16")
    assert [text for text, trained in segments if not trained] == [
        "<result>8</result>",
        "<result>16</result>",
    ]
    assert segments[-1] == ("\n#### 16", True)
