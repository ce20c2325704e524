"""The `dataset` task: local files in every form the `datasets` library reads, columns mapped by
name, conversations, splits and held-out sets, and bad rows named by place."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cadence.data import DataError, DatasetTask, Example, load_task, read_rows, to_examples

ROWS = [
    {"problem": f"What is {i} + 1?", "solution": f"so $\\boxed{{{i + 1}}}$", "level": i}
    for i in range(8)
]
CHAT = [
    {
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"What is {i} + 2?"},
        ],
        "answer": i + 2,
    }
    for i in range(6)
]


def jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def dataset(rows: list):
    import datasets

    return datasets.Dataset.from_list(rows)


@pytest.mark.parametrize("form", ["jsonl", "json", "parquet", "csv", "saved", "saved-dict", "dir"])
def test_every_local_form_gives_the_same_examples(tmp_path: Path, form: str) -> None:
    d = dataset(ROWS)
    path = {
        "jsonl": lambda: jsonl(tmp_path / "rows.jsonl", ROWS),
        "json": lambda: _write(tmp_path / "rows.json", json.dumps(ROWS)),
        "parquet": lambda: _via(d.to_parquet, tmp_path / "rows.parquet"),
        "csv": lambda: _via(d.to_csv, tmp_path / "rows.csv"),
        "saved": lambda: _via(d.save_to_disk, tmp_path / "saved"),
        "saved-dict": lambda: _via(_dict(d).save_to_disk, tmp_path / "saved-dict"),
        "dir": lambda: _folder(tmp_path / "dir"),
    }[form]()
    rows = read_rows(path)
    examples, skipped = to_examples(rows, "problem", "solution")
    assert skipped == 0
    assert examples == [Example(r["problem"], r["solution"]) for r in ROWS]


def test_splits_of_a_folder_and_of_a_saved_dict(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "dir")
    task = DatasetTask(folder, "problem", "solution", heldout_split="test")
    assert [e.question for e in task.heldout()] == ["What is 0 + 1?", "What is 1 + 1?"]
    assert len({e.question for e in _take(task, 16)}) == 6  # rows 2..7: the overlap is dropped
    saved = _via(_dict(dataset(ROWS)).save_to_disk, tmp_path / "saved")
    with pytest.raises(DataError, match=r"has no split 'validation'; its splits: train, test"):
        read_rows(saved, "validation")
    with pytest.raises(DataError, match=r"one file, which holds one split \('train'\)"):
        read_rows(folder / "train.jsonl", "test")


def test_conversations_and_numeric_answers(tmp_path: Path) -> None:
    task = load_task(
        "dataset", path=jsonl(tmp_path / "chat.jsonl", CHAT), prompt_field="prompt", num_heldout=2
    )
    first = task.heldout()[0]
    assert first.question == "What is 4 + 2?"  # the user's last message
    assert first.messages == (("system", "Be brief."), ("user", "What is 4 + 2?"))
    assert first.answer == "6"  # a number column, as text


def test_heldout_fraction_is_seeded_and_disjoint(tmp_path: Path) -> None:
    rows = [dict(r, problem=f"{r['problem']} #{i}") for i, r in enumerate(ROWS * 5)]
    path = jsonl(tmp_path / "rows.jsonl", rows)
    a = DatasetTask(path, "problem", "solution", heldout_fraction=0.25, seed=3)
    b = DatasetTask(path, "problem", "solution", heldout_fraction=0.25, seed=3)
    c = DatasetTask(path, "problem", "solution", heldout_fraction=0.25, seed=4)
    held = [e.question for e in a.heldout()]
    assert len(held) == 10 and held == [e.question for e in b.heldout()]
    assert held != [e.question for e in c.heldout()]
    assert held != [r["problem"] for r in rows[-10:]]  # drawn, not the tail
    assert not set(held) & {e.question for e in _take(a, 30)}


@pytest.mark.parametrize(
    ("row", "what"),
    [
        ({"problem": 3, "solution": "x"}, "missing or non-string 'problem': expected a string or"),
        ({"problem": "q", "solution": [1]}, "non-string 'solution': expected a string or a number"),
        ({"solution": "x"}, "missing or non-string 'problem'"),
        (
            {
                "problem": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a"},
                ],
                "solution": "1",
            },
            "ends with 'assistant': a prompt ends with the user's turn",
        ),
        ({"problem": [{"role": "robot", "content": "q"}], "solution": "1"}, "message 0 of"),
        ({"problem": [{"role": "user"}], "solution": "1"}, "'content': a string"),
        ({"problem": [], "solution": "1"}, "ends with 'nothing'"),
    ],
)
def test_a_bad_row_is_named_by_file_and_line(tmp_path: Path, row: dict, what: str) -> None:
    rows = [{"problem": "a", "solution": "1"}, row, {"problem": "b", "solution": "2"}]
    path = tmp_path / "rows.jsonl"
    path.write_text(
        "\n".join(json.dumps(r) for r in rows[:1])
        + "\n\n"
        + "\n".join(json.dumps(r) for r in rows[1:])
        + "\n",
        encoding="utf-8",
    )
    with pytest.raises(DataError) as info:
        DatasetTask(path, "problem", "solution", num_heldout=1)
    assert str(info.value).startswith(f"{path}:3: ")  # the blank line counts
    assert what in str(info.value)
    task = DatasetTask(path, "problem", "solution", num_heldout=1, on_bad_line="skip")
    assert task.num_skipped == 1


def test_bad_rows_of_parquet_are_named_by_row(tmp_path: Path) -> None:
    rows = [{"problem": "a", "solution": "1"}, {"problem": None, "solution": "2"}]
    path = _via(dataset(rows).to_parquet, tmp_path / "rows.parquet")
    with pytest.raises(DataError, match=re.escape(f"{path}: row 2: missing")):
        to_examples(read_rows(path), "problem", "solution")
    csv = _via(dataset(rows).to_csv, tmp_path / "rows.csv")
    with pytest.raises(DataError, match=re.escape(f"{csv}:3: missing")):  # after the header
        to_examples(read_rows(csv), "problem", "solution")


def test_a_missing_column_lists_the_columns(tmp_path: Path) -> None:
    path = jsonl(tmp_path / "rows.jsonl", ROWS)
    with pytest.raises(
        DataError,
        match=r"data.prompt_field 'question' is not a column of .*rows"
        r"\.jsonl; its columns: problem, solution, level",
    ):
        DatasetTask(path)


def test_a_file_the_library_refuses_is_scanned_for_its_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    good = [json.dumps(r) for r in ROWS[:4]]
    path.write_text("\n".join([*good[:2], "{oops", *good[2:]]) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=re.escape(f"{path}:3: not valid JSON")):
        read_rows(path)
    rows = read_rows(path, on_bad_line="skip")
    assert rows.num_skipped == 1 and len(rows.records) == 4


def test_paths_that_are_not_local_data(tmp_path: Path) -> None:
    with pytest.raises(
        DataError,
        match=r"looks like a Hugging Face Hub id.*hf download openai/"
        r"gsm8k --repo-type dataset",
    ):
        read_rows("openai/gsm8k")
    with pytest.raises(DataError, match="no such file"):
        read_rows(tmp_path / "absent.parquet")
    with pytest.raises(DataError, match=r"unknown data file type '\.txt'"):
        read_rows(_write(tmp_path / "rows.txt", "hello"))
    with pytest.raises(DataError, match="no data files the datasets library can read"):
        read_rows(_write(tmp_path / "empty" / "notes.md", "nothing").parent)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _via(save, path: Path) -> Path:
    save(str(path))
    return path


def _dict(d):
    import datasets

    return datasets.DatasetDict({"train": d, "test": d.select(range(2))})


def _folder(path: Path) -> Path:
    path.mkdir()
    jsonl(path / "train.jsonl", ROWS)
    jsonl(path / "test.jsonl", ROWS[:2])
    return path


def _take(task, n: int) -> list[Example]:
    it = task.train_iter()
    return [next(it) for _ in range(n)]
