"""Every line in a fenced code block of README.md and docs/ fits the site's code column.

Measured in the built site (MkDocs Material, headless Chromium): at a laptop's width
(1366 px; the same from 1280 to 1440 px) a code block is 688 px wide, less 2 x 16 px
of padding, in a monospace font of 13.6 px whose characters are 8.18 px wide (DejaVu
Sans Mono, the fallback where the theme's fonts are off): 80 characters. (At 1920 px
the font grows with the column: 80 again.) A longer line scrolls sideways, its end,
often a comment, hidden. This is the cheap check, run with the unit tests;
tests/test_docs_site.py measures the built site in a browser, every page and the
docstrings on the API pages included.
"""

from __future__ import annotations

import pathlib
import re
import unicodedata

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
WIDTH = 80  # characters: see the module
TAB = 8  # a browser's tab stops

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def _width(line: str) -> int:
    """Columns ``line`` takes in a monospace font: a tab to the next stop, an East Asian
    wide or full-width character two."""
    line = line.expandtabs(TAB)
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in line)


def _code_lines(text: str) -> list[tuple[int, str]]:
    """Each line inside a fenced code block of Markdown ``text``: (line number, the line
    less the fence's own indentation)."""
    found: list[tuple[int, str]] = []
    fence: re.Match[str] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        opening = _FENCE.match(line)
        if fence is None:
            if opening and not (opening["fence"][0] == "`" and "`" in opening["info"]):
                fence = opening
            continue
        marker = fence["fence"]
        closing = opening is not None and not opening["info"].strip() and (
            opening["fence"][0] == marker[0] and len(opening["fence"]) >= len(marker))
        if closing:
            fence = None
            continue
        indent = fence["indent"]
        found.append((number, line[len(indent):] if line.startswith(indent) else
                      line.lstrip(" \t")))
    return found


def test_the_pages_have_code_blocks() -> None:
    assert len(PAGES) > 20, PAGES
    lines = sum(len(_code_lines(page.read_text(encoding="utf-8"))) for page in PAGES)
    assert lines > 1000, lines


def test_code_lines_are_found_and_measured_as_this_module_says() -> None:
    text = ("text ```not a fence``` \n"
            "```python\n"
            "a\n"
            "  ````\n"  # (indented, but longer: still closes the block of 3)
            "b\n"
            "  ~~~~text\n"
            "  c\n"
            "d\n"
            "  ```\n"  # (a ` fence inside a ~ block is its text)
            "  ~~~~\n"
            "```\n"  # (opens a block that the end of the page closes)
            "e\n")
    assert _code_lines(text) == [(3, "a"), (7, "c"), (8, "d"), (9, "```"), (12, "e")]
    assert _width("ab") == 2 and _width("\tx") == TAB + 1 and _width("語x") == 3
    assert _width("└─ │") == 4


def test_code_lines_fit_the_column() -> None:
    """Lines over WIDTH, named file:line: shorten them (a comment above the line instead of
    after it, a call wrapped), or wrap program output (tests/test_doc_programs.py reads a
    stated line that ends in `` \\`` as going on in the next comment line)."""
    over = [f"  {page.relative_to(ROOT)}:{number}: {_width(line)} characters: {line}"
            for page in PAGES
            for number, line in _code_lines(page.read_text(encoding="utf-8"))
            if _width(line) > WIDTH]
    assert not over, (f"{len(over)} lines in code blocks are wider than the site's code "
                      f"column ({WIDTH} characters at 1366 px):\n" + "\n".join(over))
