"""Properties of the procedural arithmetic task: seeded, disjoint splits, correct answers."""

from __future__ import annotations

import ast
import operator
import re

import pytest

from cadence.data.tasks import (
    DEFAULT_TEMPLATE,
    TASKS,
    ArithmeticTask,
    Example,
    load_task,
    make_prompt,
    reference_answer,
    to_prompt,
)
from cadence.types import Prompt

LINE = re.compile(r"^(\d+) ([+\-*]) (\d+) = (\d+)$")
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
AST_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def check_worked_answer(example: Example) -> int:
    """Recompute every "a op b = c" line; return the final value, asserting the chain holds."""
    *lines, final_line = example.answer.split("\n")
    assert final_line.startswith("#### ")
    assert lines, example
    previous = None
    operands = []
    for line in lines:
        m = LINE.match(line)
        assert m, f"bad worked line {line!r} in {example}"
        a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
        assert OPS[op](a, b) == c, line
        assert c >= 0, line
        if previous is not None:
            assert a == previous, f"line {line!r} does not continue from {previous}"
        else:
            operands.append(a)
        operands.append(b)
        previous = c
    assert int(reference_answer(example.answer)) == previous
    # The question states exactly the numbers the worked lines use, in order.
    assert [int(n) for n in re.findall(r"\d+", example.question)] == operands
    return previous


def evaluate_expression(expr: str) -> int:
    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        assert isinstance(node, ast.BinOp), ast.dump(node)
        return AST_OPS[type(node.op)](walk(node.left), walk(node.right))

    return walk(ast.parse(expr, mode="eval").body)


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_every_answer_matches_its_worked_lines_and_is_never_negative(difficulty: int) -> None:
    task = ArithmeticTask(difficulty=difficulty, seed=3, num_heldout=50)
    for example in [*task.train_examples(2000), *task.heldout()]:
        final = check_worked_answer(example)
        assert final >= 0
        if example.question.startswith("What is "):
            assert evaluate_expression(example.question[8:-1]) == final, example


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_difficulty_bounds_steps_and_operands(difficulty: int) -> None:
    max_steps, hi = {1: (1, 20), 2: (2, 50), 3: (3, 99)}[difficulty]
    examples = ArithmeticTask(difficulty=difficulty, seed=0).train_examples(1000)
    steps = [len(e.answer.split("\n")) - 1 for e in examples]
    assert max(steps) == max_steps and min(steps) == 1
    for e in examples:
        first = LINE.match(e.answer.split("\n")[0])
        assert first and int(first[1]) <= hi
    has_mul = any("*" in e.answer for e in examples)
    assert has_mul == (difficulty == 3)


def test_same_seed_same_examples_different_seed_different() -> None:
    a = ArithmeticTask(difficulty=2, seed=7)
    b = ArithmeticTask(difficulty=2, seed=7)
    c = ArithmeticTask(difficulty=2, seed=8)
    assert a.train_examples(100) == b.train_examples(100)
    assert a.heldout() == b.heldout()
    assert a.train_examples(100) != c.train_examples(100)
    assert a.heldout() != c.heldout()


def test_example_depends_only_on_seed_split_and_index() -> None:
    task = ArithmeticTask(difficulty=3, seed=1)
    assert task.example(5, "train") == ArithmeticTask(difficulty=3, seed=1).example(5, "train")
    assert task.example(5, "train") != task.example(5, "heldout")
    with pytest.raises(ValueError, match="'test'"):
        task.example(0, "test")


def test_heldout_is_distinct_and_has_requested_size() -> None:
    task = ArithmeticTask(difficulty=1, seed=0, num_heldout=200)
    questions = [e.question for e in task.heldout()]
    assert len(questions) == 200
    assert len(set(questions)) == 200


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_train_and_heldout_are_disjoint(difficulty: int) -> None:
    task = ArithmeticTask(difficulty=difficulty, seed=0, num_heldout=200)
    heldout = {e.question for e in task.heldout()}
    train = {e.question for e in task.train_examples(5000)}
    assert not train & heldout
    # At difficulty 1 the raw train draws do hit held-out questions, so the filter is exercised.
    if difficulty == 1:
        raw = {task.example(i, "train").question for i in range(5000)}
        assert raw & heldout


def test_train_iter_resumes_from_cursor() -> None:
    task = ArithmeticTask(difficulty=1, seed=0)
    it = task.train_iter()
    first = [next(it) for _ in range(300)]
    resumed = task.train_iter(start=120)
    assert [next(resumed) for _ in range(180)] == first[120:]


def test_corpus_holds_prompt_and_answer_texts() -> None:
    task = ArithmeticTask(difficulty=2, seed=0)
    corpus = task.corpus(10)
    assert len(corpus) == 10
    first = task.train_examples(1)[0]
    assert corpus[0] == make_prompt(first.question) + first.answer


@pytest.mark.parametrize("bad", [0, 4, -1, True])
def test_difficulty_is_validated(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"1, 2 or 3, got {bad!r}"):
        ArithmeticTask(difficulty=bad)


def test_make_prompt_and_to_prompt() -> None:
    assert DEFAULT_TEMPLATE == "Question: {question}\nAnswer: "
    assert make_prompt("What is 1 + 2?") == "Question: What is 1 + 2?\nAnswer: "
    assert make_prompt("x", "Q {question} {A}") == "Q x {A}"
    with pytest.raises(ValueError, match="placeholder"):
        make_prompt("x", "no placeholder")
    example = Example("What is 1 + 2?", "1 + 2 = 3\n#### 3")
    prompt = to_prompt(example, uid="arithmetic:0:3", index=3, template=DEFAULT_TEMPLATE)
    assert prompt == Prompt(
        uid="arithmetic:0:3",
        text="Question: What is 1 + 2?\nAnswer: ",
        answer="1 + 2 = 3\n#### 3",
        index=3,
    )


def test_reference_answer_takes_text_after_last_marker() -> None:
    assert reference_answer("12 + 7 = 19\n#### 19") == "19"
    assert reference_answer("#### 1 #### 42 \n") == "42"
    with pytest.raises(ValueError, match=r"no '#### <final answer>' line: '12 \+ 7 = 19'"):
        reference_answer("12 + 7 = 19")
    with pytest.raises(ValueError, match="'#### '"):
        reference_answer("#### ")


def test_load_task_builds_registered_tasks_and_names_choices() -> None:
    assert set(TASKS) == {"arithmetic", "gsm8k", "dataset", "reasoning_gym"}
    task = load_task("arithmetic", difficulty=2, seed=5)
    assert isinstance(task, ArithmeticTask) and task.difficulty == 2
    with pytest.raises(ValueError, match=r"'nope'.*arithmetic.*gsm8k"):
        load_task("nope")


def test_public_surface() -> None:
    import cadence.data

    assert set(cadence.data.__all__) == {
        "DEFAULT_TEMPLATE",
        "TASKS",
        "ArithmeticTask",
        "as_render",
        "ChatRender",
        "DataError",
        "DatasetChoice",
        "DatasetTask",
        "Example",
        "JsonlTask",
        "PlainRender",
        "ReasoningGymTask",
        "Render",
        "Task",
        "load_gsm8k_jsonl",
        "load_task",
        "make_prompt",
        "read_rows",
        "reference_answer",
        "to_examples",
        "to_prompt",
    }


def test_max_operand_bounds_every_number() -> None:
    examples = ArithmeticTask(difficulty=2, seed=0, max_operand=10).train_examples(500)
    for ex in examples:
        lines = [LINE.match(line) for line in ex.answer.splitlines()[:-1]]
        # the start value and each line's right operand are drawn; left operands are totals
        drawn = [int(lines[0].group(1))] + [int(m.group(3)) for m in lines]
        assert all(0 <= x <= 10 for x in drawn), ex
    with pytest.raises(ValueError, match="max_operand"):
        ArithmeticTask(max_operand=1)


def test_the_heldout_split_follows_its_own_seed_not_the_run_seed() -> None:
    a = ArithmeticTask(difficulty=1, seed=0, num_heldout=50, heldout_seed=7)
    b = ArithmeticTask(difficulty=1, seed=12345, num_heldout=50, heldout_seed=7)
    assert a.heldout() == b.heldout()  # one yardstick for both runs
    assert a.train_examples(20) != b.train_examples(20)  # each run draws its own stream
    held = {e.question for e in a.heldout()}
    assert not any(e.question in held for e in b.train_examples(300))
    # without a held-out seed the split follows the task's seed, as before
    assert (
        ArithmeticTask(seed=3, num_heldout=5).heldout()
        == ArithmeticTask(seed=9, num_heldout=5, heldout_seed=3).heldout()
    )
