"""Markdown tables of figures (bench.md, study.md, the docs' tables): a header, its rule, one
line per row. Cells come formatted by their caller; nothing here knows a figure."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """`| a | b |` lines: the header, its `|---|` rule, then each row's cells as text (an empty
    cell as `| |`)."""

    def line(cells: Sequence[object]) -> str:
        return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"

    return "\n".join([line(header), "|" + "---|" * len(header), *map(line, rows)])
