"""Local data sets through the `datasets` library, mapped to examples by column name.

Nothing here touches the network: the hub is kept offline, and a path that does not exist but
looks like a hub id is answered with how to download it first. JSON is parsed, never unpickled.

Read on: docs/data.md.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cadence.data.base import (
    DataError,
    Example,
    ListedTask,
    stable_seed,
)

log = logging.getLogger(__name__)

ON_BAD_LINE = ("error", "skip")
FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
ROLES = ("system", "user", "assistant", "tool")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class Rows:
    """One split's records, where each came from, and lines that were no record (skipped)."""

    source: str  # the file (or directory and split) they came from
    records: Sequence[dict[str, Any]]
    where: Callable[[int], str]  # the place of record i, for messages
    columns: tuple[str, ...]
    num_skipped: int = 0


def read_rows(path: str | Path, split: str = "train", on_bad_line: str = "error") -> Rows:
    """The rows of `split` of the data at `path` (see the module docstring)."""
    if on_bad_line not in ON_BAD_LINE:
        raise ValueError(f"on_bad_line must be one of {ON_BAD_LINE}, got {on_bad_line!r}")
    p = _check_local(Path(path))
    if p.is_dir():
        return _read_dir(p, split)
    builder = FILE_FORMATS.get(p.suffix.lower())
    if builder is None:
        raise DataError(
            f"{p}: unknown data file type '{p.suffix}'; use one of "
            f"{', '.join(FILE_FORMATS)}, a save_to_disk directory, or a folder of data files"
        )
    if split != "train":
        raise DataError(
            f"{p} is one file, which holds one split ('train'), not {split!r}: point data.path "
            "at a folder of split files or a save_to_disk directory, or use data.heldout_path"
        )
    try:
        table = _load("load_dataset", builder, data_files=str(p), split="train")
    except Exception as e:
        if builder != "json":
            raise DataError(f"{p}: cannot read it as {builder}: {_reason(e)}") from None
        return _scan_json_lines(p, on_bad_line)
    return Rows(str(p), table.to_list(), _file_places(p, builder), tuple(table.column_names))


def _check_local(p: Path) -> Path:
    if p.exists():
        return p
    if _HUB_ID.match(str(p)) and not p.suffix:
        raise DataError(
            f"data.path '{p}' does not exist here and looks like a Hugging Face Hub id; cadence "
            f"reads local files only: download it first (`hf download {p} --repo-type dataset "
            f"--local-dir data/{p.name}`) and point data.path at the folder of split files "
            "(or one file in it)"
        )
    raise DataError(f"{p}: no such file")


def _read_dir(p: Path, split: str) -> Rows:
    if (p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file():
        data = _load("load_from_disk", str(p))
    else:
        try:
            data = _load("load_dataset", str(p))
        except Exception as e:
            reason = _reason(e)
            raise DataError(f"{p}: no data files the datasets library can read: {reason}") from None
    from datasets import DatasetDict

    if isinstance(data, DatasetDict):
        if split not in data:
            raise DataError(f"{p} has no split {split!r}; its splits: {', '.join(data)}")
        data = data[split]
    elif split != "train":
        raise DataError(f"{p} is a single data set (split 'train'), not split {split!r}")
    where = lambda i: f"{p} [{split}] row {i + 1}"  # noqa: E731
    return Rows(f"{p} [{split}]", data.to_list(), where, tuple(data.column_names))


def _load(fn: str, *args: Any, **kwargs: Any):
    """A `datasets` loader, offline, quiet, its cache in a temporary directory (kept in memory)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
    if fn == "load_from_disk":
        return datasets.load_from_disk(*args, keep_in_memory=True)
    with tempfile.TemporaryDirectory(prefix="cadence-datasets-") as cache:
        return datasets.load_dataset(*args, cache_dir=cache, keep_in_memory=True, **kwargs)


def _reason(e: Exception) -> str:
    cause = e.__cause__ or e.__context__ or e
    return f"{type(cause).__name__}: {cause}".splitlines()[0]


def _file_places(p: Path, builder: str) -> Callable[[int], str]:
    """The place of record i of a file: its line (JSON lines: blank lines skipped; CSV: after
    the header), or its row (parquet, a JSON array)."""
    if builder == "csv":
        return lambda i: f"{p}:{i + 2}"
    if builder != "json":
        return lambda i: f"{p}: row {i + 1}"
    lines: list[int] = []

    def where(i: int) -> str:
        if not lines:
            with p.open("rb") as f:
                lines.extend(n for n, raw in enumerate(f, start=1) if raw.strip())
        if lines and _is_array(p):
            return f"{p}: row {i + 1}"
        return f"{p}:{lines[i]}" if i < len(lines) else f"{p}: row {i + 1}"

    return where


def _is_array(p: Path) -> bool:
    with p.open("rb") as f:
        return f.read(4096).lstrip().startswith(b"[")


def _scan_json_lines(p: Path, on_bad_line: str) -> Rows:
    """A file the library refused, line by line: the first bad line stops, or each is skipped."""
    records: list[dict[str, Any]] = []
    places: list[int] = []
    skipped = 0
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                records.append(_parse_line(raw))
                places.append(lineno)
            except DataError as e:
                if on_bad_line == "error":
                    raise DataError(f"{p}:{lineno}: {e}") from None
                skipped += 1
    columns = tuple(dict.fromkeys(k for r in records for k in r))
    return Rows(str(p), records, lambda i: f"{p}:{places[i]}", columns, skipped)


def _parse_line(raw: bytes) -> dict[str, Any]:
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"not UTF-8 ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise DataError(f"not valid JSON ({e.msg})") from None
    if not isinstance(record, dict):
        raise DataError(f"expected a JSON object, got {type(record).__name__}")
    return record


def to_examples(
    rows: Rows,
    prompt_field: str,
    answer_field: str,
    on_bad_line: str = "error",
    check_answer: Callable[[str], None] | None = None,
    numeric_answers: bool = True,
) -> tuple[list[Example], int]:
    """Examples from `rows` (and bad rows skipped, with the rows' own skipped lines)."""
    for field, key in ((prompt_field, "prompt_field"), (answer_field, "answer_field")):
        if rows.records and field not in rows.columns:
            raise DataError(
                f"data.{key} {field!r} is not a column of {rows.source}; its columns: "
                f"{', '.join(rows.columns)}"
            )
    examples: list[Example] = []
    skipped = rows.num_skipped
    for i, record in enumerate(rows.records):
        try:
            answer = _answer(record.get(answer_field), answer_field, numeric_answers)
            if check_answer is not None:
                check_answer(answer)
            example = _prompt(record.get(prompt_field), prompt_field, answer)
            # the whole row, as TRL hands it to a reward or an environment's reset (envs/)
            examples.append(replace(example, metadata=dict(record)))
        except DataError as e:
            if on_bad_line == "error":
                raise DataError(f"{rows.where(i)}: {e}") from None
            skipped += 1
    return examples, skipped


def load_examples(
    path: str | Path, split: str, prompt_field: str, answer_field: str, on_bad_line="error", **kw
) -> tuple[list[Example], int]:
    """`read_rows` then `to_examples` (`kw`: its `check_answer`, `numeric_answers`); no example
    at all is an error."""
    rows = read_rows(path, split, on_bad_line)
    examples, skipped = to_examples(rows, prompt_field, answer_field, on_bad_line, **kw)
    if not examples:
        raise DataError(f"{rows.source}: no examples ({skipped} bad lines skipped)")
    return examples, skipped


def _answer(value: Any, field: str, numeric: bool) -> str:
    if isinstance(value, str):
        return value
    if numeric and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    kind = "a string or a number" if numeric else "a string"
    raise DataError(f"missing or non-string {field!r}: expected {kind}, got {_kind(value)}")


def _prompt(value: Any, field: str, answer: str) -> Example:
    if isinstance(value, str):
        return Example(question=value, answer=answer)
    if not isinstance(value, list):
        raise DataError(
            f"missing or non-string {field!r}: expected a string or a list of messages, got "
            f"{_kind(value)}"
        )
    messages = tuple(_message(m, field, j) for j, m in enumerate(value))
    if not messages or messages[-1][0] != "user":
        last = messages[-1][0] if messages else "nothing"
        raise DataError(
            f"conversation {field!r} ends with {last!r}: a prompt ends with the user's turn "
            "(leave the answer out of the messages, in data.answer_field)"
        )
    return Example(question=messages[-1][1], answer=answer, messages=messages)


def _message(m: Any, field: str, j: int) -> tuple[str, str]:
    ok = isinstance(m, dict) and isinstance(m.get("content"), str)
    if not ok or m.get("role") not in ROLES:
        raise DataError(
            f"message {j} of {field!r} is not {{'role': one of {', '.join(ROLES)}, 'content': a "
            f"string}}: got {str(m)[:80]}"
        )
    return m["role"], m["content"]


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


class DatasetTask(ListedTask):
    """A task over a local data set, with the same interface as `ArithmeticTask`.

    Held-out examples come from `heldout_split` (of `path`, or of `heldout_path`), from
    `heldout_path`, from a `heldout_fraction` of the rows (drawn with `heldout_seed`, else
    `seed`), or else are the last `num_heldout` rows; at most `num_heldout` are kept, and
    training examples whose question is also held out are dropped. `train_iter` visits every
    training example once per epoch in an order shuffled by (seed, epoch).
    """

    def __init__(
        self,
        path: str | Path,
        prompt_field: str = "question",
        answer_field: str = "answer",
        split: str = "train",
        heldout_path: str | Path | None = None,
        heldout_split: str | None = None,
        heldout_fraction: float = 0.0,
        num_heldout: int = 200,
        on_bad_line: str = "error",
        seed: int = 0,
        check_answer: Callable[[str], None] | None = None,
        numeric_answers: bool = True,
        heldout_seed: int | None = None,
    ) -> None:
        if num_heldout < 0:
            raise ValueError(f"num_heldout must be >= 0, got {num_heldout}")
        if not 0.0 <= heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
        self.seed = seed
        self.heldout_seed = seed if heldout_seed is None else heldout_seed

        def load(where: str | Path, which: str) -> list[Example]:
            examples, skipped = load_examples(
                where,
                which,
                prompt_field,
                answer_field,
                on_bad_line,
                check_answer=check_answer,
                numeric_answers=numeric_answers,
            )
            self.num_skipped += skipped
            return examples

        self.num_skipped = 0
        examples = load(path, split)
        if heldout_split is not None or heldout_path is not None:
            held = load(heldout_path or path, heldout_split or "train")[:num_heldout]
        else:
            examples, held = self._split(examples, path, heldout_fraction, num_heldout)
        if self.num_skipped:
            log.warning(
                "cadence: skipped %d malformed line(s) of %s (data.on_bad_line = 'skip'); "
                "counted as bad_lines_skipped in metrics.jsonl and summary.json",
                self.num_skipped,
                ", ".join(str(p) for p in (path, heldout_path) if p),
            )
        questions = {e.question for e in held}
        self._train = [e for e in examples if e.question not in questions]
        if not self._train:
            raise DataError(f"{path}: every training question is also in the held-out set")
        self._heldout = held

    def _split(
        self, examples: list[Example], path: str | Path, fraction: float, num_heldout: int
    ) -> tuple[list[Example], list[Example]]:
        """(train, held out): a seeded fraction of the rows, or else the last `num_heldout`."""
        n = round(len(examples) * fraction) if fraction else num_heldout
        if len(examples) <= n:
            raise DataError(
                f"{path}: {len(examples)} examples leave none for training after holding out "
                f"{n} (num_heldout={num_heldout}, heldout_fraction={fraction}); lower them or "
                "pass data.heldout_path or data.heldout_split"
            )
        if not fraction:
            return examples[: len(examples) - n], examples[len(examples) - n :]
        order = list(range(len(examples)))
        random.Random(stable_seed(f"{self.heldout_seed}:heldout")).shuffle(order)
        held = sorted(order[:n])
        chosen = set(held)
        train = [e for i, e in enumerate(examples) if i not in chosen]
        return train, [examples[i] for i in held[:num_heldout]]
