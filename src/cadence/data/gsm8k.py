"""GSM8K-format JSONL from a local file, and a task over it.

Each line is `{"question": ..., "answer": "... #### 42"}`. A bad line is reported as
"path:LINE: what is wrong" (or skipped and counted with `on_bad_line="skip"`), so a broken
dataset fails at load time rather than as a silent zero reward mid-run.

This module must not download anything: the path is local. It reads JSON only (no pickle).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from itertools import count, islice
from pathlib import Path

from cadence.data.base import Example, make_prompt, stable_seed

log = logging.getLogger(__name__)
ON_BAD_LINE = ("error", "skip")


class DataError(ValueError):
    """A dataset file is missing, empty or malformed; the message names the file (and line)."""


def load_gsm8k_jsonl(path: str | Path, on_bad_line: str = "error") -> tuple[list[Example], int]:
    """Load a GSM8K-format JSONL file; returns (examples, number of skipped bad lines)."""
    if on_bad_line not in ON_BAD_LINE:
        raise ValueError(f"on_bad_line must be one of {ON_BAD_LINE}, got {on_bad_line!r}")
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    examples: list[Example] = []
    num_skipped = 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                examples.append(_parse_line(raw))
            except DataError as e:
                if on_bad_line == "error":
                    raise DataError(f"{path}:{lineno}: {e}") from None
                num_skipped += 1
    if not examples:
        raise DataError(f"{path}: no examples ({num_skipped} bad lines skipped)")
    return examples, num_skipped


def _parse_line(raw: bytes) -> Example:
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"not UTF-8 ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise DataError(f"not valid JSON ({e.msg})") from None
    if not isinstance(record, dict):
        raise DataError(f"expected a JSON object, got {type(record).__name__}")
    for key in ("question", "answer"):
        if not isinstance(record.get(key), str):
            raise DataError(f"missing or non-string {key!r}")
    answer = record["answer"]
    _, sep, tail = answer.rpartition("####")
    if not sep or not tail.strip():
        raise DataError("answer has no '#### <number>' final answer")
    return Example(question=record["question"], answer=answer)


class JsonlTask:
    """A task over GSM8K-format files, with the same interface as `ArithmeticTask`.

    Held-out examples come from `heldout_path`, or else are the last `num_heldout` lines of
    `path`; training examples whose question is also held out are dropped. `train_iter` visits
    every training example once per epoch in an order shuffled by (seed, epoch).
    """

    def __init__(
        self,
        path: str | Path,
        heldout_path: str | Path | None = None,
        num_heldout: int = 200,
        on_bad_line: str = "error",
        seed: int = 0,
    ) -> None:
        if num_heldout < 0:
            raise ValueError(f"num_heldout must be >= 0, got {num_heldout}")
        examples, self.num_skipped = load_gsm8k_jsonl(path, on_bad_line)
        if heldout_path is not None:
            held, skipped = load_gsm8k_jsonl(heldout_path, on_bad_line)
            self.num_skipped += skipped
        else:
            if len(examples) <= num_heldout:
                raise DataError(
                    f"{path}: {len(examples)} examples leave none for training after holding "
                    f"out num_heldout={num_heldout}; lower num_heldout or pass heldout_path"
                )
            split = len(examples) - num_heldout
            examples, held = examples[:split], examples[split:]
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
        self.seed = seed

    def heldout(self) -> list[Example]:
        return list(self._heldout)

    def train_iter(self, start: int = 0) -> Iterator[Example]:
        """Infinite training stream; `train_iter(k)` resumes after k examples were consumed."""
        n = len(self._train)
        epoch, pos = divmod(start, n)
        for e in count(epoch):
            order = self._epoch_order(e)
            for i in order[pos:]:
                yield self._train[i]
            pos = 0

    def corpus(self, n: int) -> list[str]:
        """`n` prompt + answer texts from the training stream, for training a tokenizer."""
        return [make_prompt(e.question) + e.answer for e in islice(self.train_iter(), n)]

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._train)))
        random.Random(stable_seed(f"{self.seed}:epoch:{epoch}")).shuffle(order)
        return order
