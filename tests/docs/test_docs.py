"""The docs stay true to the repository: every file a page links to exists (and every heading
an anchor names), and every figure the README states says when it was measured and with which
command, so a figure cannot outlive the code that produced it unnoticed."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|\!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
# a measured figure: a decimal (not a version, not a model's size in M or B parameters), a ratio,
# a percentage, a gain in points, a standard error
FIGURE = re.compile(
    r"(?<![\d.])\d+\.\d+(?![\d.]| ?[MB]\b)|\d(\.\d+)?x\b|\d%|[+-]\d+(\.\d+)? points|±"
)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
COMMAND = re.compile(r"`(cadence|make|python|\.venv/bin/python|PYTHONPATH=\S+ \S+) [^`]*`")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces
    to '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    kept = [c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN"]
    return "".join(kept).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    found: set[str] = set()
    for heading in re.findall(r"^#+ (.+)$", text, re.M):
        base, n = slug(heading), 0
        while (name := base if n == 0 else f"{base}-{n}") in found:
            n += 1
        found.add(name)
    return found


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    return [a or b for a, b in LINK.findall(text)]


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not this repository's
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            bad.append(f"{page.name}: {target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            bad.append(f"{page.name}: {target} (no such heading)")
    return bad


def test_every_link_in_the_docs_reaches_a_file_and_heading_that_exist():
    assert [b for page in PAGES for b in broken_links(page)] == []


def blocks(markdown: str) -> list[tuple[str, str]]:
    """(section heading, block) for every paragraph, list item run or table outside code."""
    out, heading = [], ""
    for block in re.split(r"\n\s*\n", FENCE.sub("", markdown)):
        block = block.strip()
        if not block:
            continue
        if block.startswith("#"):
            heading = block.splitlines()[0]
            rest = "\n".join(block.splitlines()[1:]).strip()
            if not rest:
                continue
            block = rest
        out.append((heading, block))
    return out


def undated_figures(markdown: str) -> list[str]:
    """Blocks that state a figure with no date and no command in reach: the block itself, or
    the blocks before it in its section (a table's introduction says when and how)."""
    bad, context, section = [], "", None
    for heading, block in blocks(markdown):
        if heading != section:
            section, context = heading, ""
        context += "\n" + block
        if FIGURE.search(block) and not (DATE.search(context) and COMMAND.search(context)):
            bad.append(f"{heading}: {block[:90]!r}")
    return bad


def test_every_figure_in_the_readme_says_when_and_with_which_command():
    assert undated_figures((ROOT / "README.md").read_text()) == []


def test_the_checks_see_a_missing_file_a_missing_heading_and_an_undated_figure(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# Title\n\n## A `key` heading, here\n")
    page.write_text("[a](there.md#a-key-heading-here) [b](gone.md) [c](there.md#nowhere)\n")
    assert broken_links(page) == [
        "page.md: gone.md (no such file)",
        "page.md: there.md#nowhere (no such heading)",
    ]
    dated = "## Measured\n\nOn 2026-12-01, `cadence bench --suite trl`:\n\n| a | 2.36x |\n"
    undated = "## Claims\n\nPacking computes 2.36x fewer tokens.\n"
    assert undated_figures(dated) == []
    assert len(undated_figures(undated)) == 1
