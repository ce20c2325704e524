"""Which part of a text is its final answer: `reward.answer_format`.

Read on: docs/data.md#rewards.
"""

from __future__ import annotations

import re

ANSWER_FORMATS = ("hashes", "boxed", "last_number", "auto")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")  # 12, -3, 1,000, 2.5, .5
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def check_format(answer_format: str) -> None:
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(
            f"answer_format must be one of {', '.join(ANSWER_FORMATS)}; got {answer_format!r}"
        )


def after_hashes(text: str) -> str | None:
    """The first line after the last "####", stripped ("" if nothing follows); None without one."""
    _, sep, tail = text.rpartition("####")
    if not sep:
        return None
    lines = tail.strip().splitlines()
    return lines[0].strip() if lines else ""


def last_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` whose braces close; None without one."""
    found = None
    for m in _BOXED.finditer(text):
        depth, start = 1, m.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                found = text[start:i].strip()
                break
    return found


def last_number(text: str) -> str:
    """The last number written in `text` ("" if none)."""
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else ""


def extract(text: str, answer_format: str) -> str | None:
    """The graded part of `text` under `answer_format`; None when the text has none."""
    check_format(answer_format)
    if answer_format == "hashes":
        return after_hashes(text)
    if answer_format == "boxed":
        return last_boxed(text)
    if answer_format == "last_number":
        return last_number(text) or None
    hashes, boxed = text.rfind("####"), _last_boxed_start(text)
    if hashes < 0 and boxed < 0:
        return None
    return after_hashes(text) if hashes > boxed else (last_boxed(text) or "")


def _last_boxed_start(text: str) -> int:
    starts = [m.start() for m in _BOXED.finditer(text)]
    return starts[-1] if starts else -1


def prediction(completion: str, answer_format: str) -> str:
    """The completion's graded answer ("" when it has none): see the module docstring."""
    found = extract(completion, answer_format)
    if found is None:
        return completion.strip() if answer_format in ("hashes", "auto") else ""
    return found


def reference(answer: str, answer_format: str) -> str:
    """The reference's final answer: by `answer_format`, else by whichever marker it has (GSM8K's
    "####" references graded against boxed completions), else the whole text."""
    for fmt in (answer_format, "auto"):
        found = extract(answer, fmt)
        if found:
            return found.strip()
    return answer.strip()


def is_number(text: str) -> bool:
    return NUMBER.fullmatch(text.strip()) is not None
