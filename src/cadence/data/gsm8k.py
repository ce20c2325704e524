"""GSM8K-format data: the `dataset` task (data/dataset.py) with GSM8K's columns and answers.

Each row is `{"question": ..., "answer": "... #### 42"}`, in a JSONL file (or any format the
`dataset` task reads). A bad line is reported as "path:LINE: what is wrong" (or skipped and
counted with `on_bad_line="skip"`), so a broken dataset fails at load time rather than as a
silent zero reward mid-run. This module is a preset, not a second loader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cadence.data.base import DataError, Example
from cadence.data.dataset import DatasetTask, load_examples

__all__ = ["DataError", "JsonlTask", "check_hashes_answer", "load_gsm8k_jsonl"]


def check_hashes_answer(answer: str) -> None:
    _, sep, tail = answer.rpartition("####")
    if not sep or not tail.strip():
        raise DataError("answer has no '#### <number>' final answer")


def load_gsm8k_jsonl(path: str | Path, on_bad_line: str = "error") -> tuple[list[Example], int]:
    """Load a GSM8K-format file; returns (examples, number of skipped bad lines)."""
    return load_examples(
        path,
        "train",
        "question",
        "answer",
        on_bad_line,
        check_answer=check_hashes_answer,
        numeric_answers=False,
    )


class JsonlTask(DatasetTask):
    """GSM8K-format files: string `question` and `answer` columns, answers ending in "#### x".

    Held-out examples come from `heldout_path`, or else are the last `num_heldout` lines of
    `path` (see `DatasetTask` for the rest).
    """

    def __init__(
        self,
        path: str | Path,
        heldout_path: str | Path | None = None,
        num_heldout: int = 200,
        on_bad_line: str = "error",
        seed: int = 0,
        **splits: Any,
    ) -> None:
        super().__init__(
            path,
            prompt_field="question",
            answer_field="answer",
            heldout_path=heldout_path,
            num_heldout=num_heldout,
            on_bad_line=on_bad_line,
            seed=seed,
            check_answer=check_hashes_answer,
            numeric_answers=False,
            **splits,
        )
