"""MkDocs hook: show the Sphinx markup of rpcx's docstrings as Markdown would.

The docstrings name other objects the Sphinx way (``:class:`~rpcx.RRef```) and end a
paragraph before a code block with ``::``. The Python handler of mkdocstrings renders
both verbatim: ``:class:`` before the code, ``::`` at the end of the paragraph. On the
API reference pages this drops the role and the ``~`` (Sphinx's "show the last part
only") and turns the ``::`` into ``:``.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):(<code>)(~?)([^<]*)")
_LITERAL_BLOCK_MARK = re.compile(r"::(</p>)")


def _plain(match: re.Match[str]) -> str:
    name = match.group(3)
    if match.group(2):  # ~a.b.C -> C
        name = name.rsplit(".", 1)[-1]
    return match.group(1) + name


def on_page_content(html: str, page: Any, **_: Any) -> str:
    """Rewrite, on reference pages, every ``:role:<code>name`` as ``<code>name`` and a
    paragraph's closing ``::`` as ``:``."""
    if not page.file.src_uri.startswith("reference/"):
        return html
    return _LITERAL_BLOCK_MARK.sub(r":\1", _ROLE.sub(_plain, html))
