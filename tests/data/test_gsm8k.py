"""The GSM8K JSONL loader reports bad lines by path and line number; JsonlTask splits and cycles."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cadence.data import JsonlTask, load_task
from cadence.data.gsm8k import DataError, load_gsm8k_jsonl
from cadence.data.tasks import Example


def row(i: int) -> str:
    return json.dumps(
        {"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}
    )


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_good_file_loads_and_ignores_blank_lines(tmp_path: Path) -> None:
    path = write(tmp_path / "data.jsonl", [row(0), "", "   ", row(1)])
    examples, num_skipped = load_gsm8k_jsonl(path)
    assert num_skipped == 0
    assert examples == [
        Example("What is 0 + 1?", "0 + 1 = 1\n#### 1"),
        Example("What is 1 + 1?", "1 + 1 = 2\n#### 2"),
    ]


@pytest.mark.parametrize(
    ("bad_line", "what"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        (json.dumps({"answer": "#### 1"}), "missing or non-string 'question'"),
        (json.dumps({"question": "q", "answer": 3}), "missing or non-string 'answer'"),
        (json.dumps({"question": "q", "answer": "3"}), "answer has no '#### <number>'"),
    ],
)
def test_malformed_line_reports_path_and_line_number(
    tmp_path: Path, bad_line: str, what: str
) -> None:
    path = write(tmp_path / "data.jsonl", [row(0), row(1), bad_line, row(3)])
    with pytest.raises(DataError) as info:
        load_gsm8k_jsonl(path)
    message = str(info.value)
    assert message.startswith(f"{path}:3: ")
    assert what in message


def test_line_numbers_count_blank_lines(tmp_path: Path) -> None:
    path = write(tmp_path / "data.jsonl", [row(0), "", "oops"])
    with pytest.raises(DataError, match=r"data\.jsonl:3: "):
        load_gsm8k_jsonl(path)


def test_skip_mode_skips_and_counts_bad_lines(tmp_path: Path) -> None:
    path = write(tmp_path / "data.jsonl", [row(0), "oops", row(2), "[]", row(4)])
    examples, num_skipped = load_gsm8k_jsonl(path, on_bad_line="skip")
    assert num_skipped == 2
    assert [e.question for e in examples] == ["What is 0 + 1?", "What is 2 + 1?", "What is 4 + 1?"]


def test_empty_file_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path / "empty.jsonl", [""])
    with pytest.raises(DataError, match="no examples"):
        load_gsm8k_jsonl(path)
    only_bad = write(tmp_path / "bad.jsonl", ["oops"])
    with pytest.raises(DataError, match=r"no examples \(1 bad lines skipped\)"):
        load_gsm8k_jsonl(only_bad, on_bad_line="skip")


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "absent.jsonl"
    with pytest.raises(DataError, match=re.escape(f"{path}: no such file")):
        load_gsm8k_jsonl(path)


def test_on_bad_line_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'warn'"):
        load_gsm8k_jsonl(tmp_path / "x.jsonl", on_bad_line="warn")


def test_jsonl_task_holds_out_last_examples_disjoint_from_train(tmp_path: Path) -> None:
    path = write(tmp_path / "data.jsonl", [row(i) for i in range(10)])
    task = JsonlTask(path, num_heldout=3)
    assert [e.question for e in task.heldout()] == [f"What is {i} + 1?" for i in (7, 8, 9)]
    train = [e.question for e in _take(task, 7)]
    assert sorted(train) == sorted(f"What is {i} + 1?" for i in range(7))


def test_jsonl_task_uses_heldout_file_and_drops_overlap(tmp_path: Path) -> None:
    path = write(tmp_path / "train.jsonl", [row(i) for i in range(5)])
    heldout = write(tmp_path / "test.jsonl", [row(4), row(9)])
    task = JsonlTask(path, heldout_path=heldout)
    assert len(task.heldout()) == 2
    assert {e.question for e in _take(task, 8)} == {f"What is {i} + 1?" for i in range(4)}


def test_jsonl_task_epochs_are_shuffled_deterministic_and_resumable(tmp_path: Path) -> None:
    path = write(tmp_path / "data.jsonl", [row(i) for i in range(25)])
    task = JsonlTask(path, num_heldout=5, seed=1)
    stream = _take(task, 60)
    assert stream == _take(JsonlTask(path, num_heldout=5, seed=1), 60)
    assert stream != _take(JsonlTask(path, num_heldout=5, seed=2), 60)
    epochs = [stream[0:20], stream[20:40]]
    assert all(len(set(e)) == 20 for e in epochs)
    assert epochs[0] != epochs[1]
    resumed = task.train_iter(start=33)
    assert [next(resumed) for _ in range(27)] == stream[33:]


def test_jsonl_task_needs_training_examples(tmp_path: Path) -> None:
    path = write(tmp_path / "data.jsonl", [row(i) for i in range(3)])
    with pytest.raises(DataError, match="num_heldout=3"):
        JsonlTask(path, num_heldout=3)


def test_gsm8k_is_registered_and_corpus_has_texts(tmp_path: Path) -> None:
    path = write(tmp_path / "data.jsonl", [row(i) for i in range(6)])
    task = load_task("gsm8k", path=path, num_heldout=2)
    assert isinstance(task, JsonlTask)
    corpus = task.corpus(3)
    assert len(corpus) == 3
    assert all(t.startswith("Question: What is ") and "####" in t for t in corpus)


def _take(task: JsonlTask, n: int) -> list[Example]:
    it = task.train_iter()
    return [next(it) for _ in range(n)]
