"""The programs in README.md and docs/ run, and print what their comments say.

A ``python`` block that is a whole program (it has ``if __name__ == "__main__":``) and
states its output is run as written, in a process of its own, with one change: a
``tcp://127.0.0.1:PORT`` address gets a free port. Its output must be the stated lines,
in order. A ``print(...)`` states its line in a comment after it (``print(x)  # 42``;
after its closing parenthesis where the call spans lines), or, with none there, in the
comment lines right below it (one per line printed; ``(3 times)`` at the end repeats
one). A stated line that ends in `` \\`` goes on in the next comment line (``# a \\``
then ``#   b`` state ``a b``): the pages' code column is 80 characters wide. A stated
line may elide with ``...``, and may add a word on the value after ``: `` (``# 0.5: no
deadline`` stands for ``0.5``). A program on a backend that is not installed (a
plugin's) is skipped. So the docs cannot drift from the code they show.

``python -m rpcx backends`` samples are checked against the command's own listing.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from rpcx.cli import main as cli_main
from rpcx.registry import available_backends
from rpcx.testing.world import free_port

# Whole programs in fresh interpreters: nox -s programs runs them (and CI), not nox -s tests.
pytestmark = pytest.mark.program

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "examples" / "README.md",
         *sorted((ROOT / "docs").rglob("*.md"))]
TEXTS = {page: page.read_text() for page in PAGES}
BOUND = 120.0

_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_AFTER_CALL = re.compile(r"\s+#\s*(.+)$")  # a comment after a call's closing parenthesis
_COMMENT = re.compile(r"\s*#\s?(.*)$")
_GOES_ON = " \\"  # a stated line's end that continues it in the next comment line
_TIMES = re.compile(r"(.*) \((\d+) times\)$")
_BACKEND = re.compile(r"backend=\"(\w+)\"")
_LOCAL_TCP = re.compile(r"tcp://127\.0\.0\.1:\d+")


@dataclass(frozen=True)
class Program:
    page: pathlib.Path
    line: int
    code: str
    stated: list[str]

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _print_ends(code: str) -> list[tuple[int, str]]:
    """Each ``print(...)`` call of ``code``, in order: the index of the line its closing
    parenthesis is on (a call may span lines), and what that line holds after it."""
    lines = code.splitlines()
    ends = []
    for node in ast.walk(ast.parse(code)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "print" and node.end_lineno is not None
                and node.end_col_offset is not None):
            line = lines[node.end_lineno - 1].encode()  # (the offset counts UTF-8 bytes)
            ends.append((node.end_lineno - 1, node.end_col_offset,
                         line[node.end_col_offset:].decode()))
    return [(i, after) for i, _, after in sorted(ends)]


def _stated(code: str) -> list[str]:
    """The lines ``code`` says it prints, in order (see the module)."""
    lines = code.splitlines()
    stated: list[str] = []
    for i, after in _print_ends(code):
        printed = _AFTER_CALL.match(after)
        inline = printed.group(1) if printed else None
        said = [inline] if inline else []
        for below in lines[i + 1:]:
            goes_on = bool(said) and said[-1].endswith(_GOES_ON)
            comment = _COMMENT.match(below)
            if (inline and not goes_on) or comment is None:
                break
            if goes_on:
                said[-1] = said[-1].removesuffix(_GOES_ON) + " " + comment.group(1).strip()
            else:
                said.append(comment.group(1))
        for one in said:
            times = _TIMES.fullmatch(one)
            stated += [times.group(1)] * int(times.group(2)) if times else [one]
    return stated


def _programs() -> list[Program]:
    found = []
    for page, text in TEXTS.items():
        for block in _PYTHON_BLOCK.finditer(text):
            code = block.group(1)
            if 'if __name__ == "__main__":' not in code:
                continue
            line = text.count("\n", 0, block.start()) + 2
            try:
                stated = _stated(code)
            except SyntaxError as e:
                raise SyntaxError(f"{page.relative_to(ROOT)}:{line}: {e}") from e
            if stated:
                found.append(Program(page, line, code, stated))
    return found


def _matches(printed: str, stated: str) -> bool:
    """Whether ``printed`` is what the comment ``stated`` says it is: the whole comment,
    or the comment cut before one of its ``": "`` (the rest a remark); ``...`` elides."""
    candidates = [stated, *(stated[:m.start()] for m in re.finditer(": ", stated))]
    return any(re.fullmatch(".*".join(map(re.escape, c.split("..."))), printed)
               for c in candidates)


PROGRAMS = _programs()


def test_the_docs_have_programs_to_check() -> None:
    assert len(PROGRAMS) >= 20, [str(p) for p in PROGRAMS]


def test_stated_lines_are_read_as_this_module_says() -> None:
    code = ("print(a)  # 42\n"
            "print(b)\n"
            "# x (2 times)\n"
            "# y\n"
            "z = 1  # not a print\n"
            "print(c)  # 0.5: no deadline\n"
            "print(f(d))  # tensor([1.]) (2 times)\n"
            "print(e)  # a long \\\n"
            "#   line \\\n"
            "#   (2 times)\n"
            "# not stated: the line before does not go on\n"
            "print(g)\n"
            "# first \\\n"
            "#     second\n"
            "# third\n"
            "print(h(1,\n"
            "        2))  # 3\n"
            "print(\n"
            "    k)\n"
            "# 4\n")
    assert _stated(code) == ["42", "x", "x", "y", "0.5: no deadline", "tensor([1.])",
                             "tensor([1.])", "a long line", "a long line", "first second",
                             "third", "3", "4"]
    assert _matches("0.5", "0.5: no deadline") and not _matches("0.6", "0.5: no deadline")
    assert _matches("timed out after 0.2 s (timeout 0.2 s)", "timed out after ...")
    assert not _matches("timed out", "timed out after ...")


@pytest.mark.parametrize("program", PROGRAMS, ids=str)
def test_a_program_in_the_docs_prints_what_it_says(program: Program,
                                                   tmp_path: pathlib.Path) -> None:
    if "cuda" in program.code and torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    missing = set(_BACKEND.findall(program.code)) - set(available_backends())
    if missing:
        pytest.skip(f"runs on {', '.join(sorted(missing))}, not installed")
    code = _LOCAL_TCP.sub(lambda _: f"tcp://127.0.0.1:{free_port()}", program.code)
    script = tmp_path / "program.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RPCX_")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=BOUND, cwd=tmp_path, env=env)
    assert done.returncode == 0, f"{program} failed:\n{done.stderr[-3000:]}"
    printed = done.stdout.splitlines()
    assert len(printed) == len(program.stated) and all(
        _matches(line, stated) for line, stated in zip(printed, program.stated, strict=True)
    ), f"{program} printed:\n{done.stdout}\nits comments say:\n" + "\n".join(program.stated)


def _table(text: str) -> dict[str, list[str]]:
    """A ``rpcx backends`` listing's entries by backend name (``name`` for the heading):
    its first line's two cells (name, plugin; widths vary), then its indented lines
    (description, capabilities), spaces collapsed."""
    entries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if not line.strip():
            current = None
        elif not line[0].isspace():
            cells = re.split(r"\s{2,}", line.strip())
            current = None
            if len(cells) == 2:
                current = entries[cells[0].removesuffix(" (default)")] = cells
        elif current is not None:
            current.append(" ".join(line.split()))
    return entries


def _backends_samples() -> list[tuple[str, str]]:
    samples = []
    for page, text in TEXTS.items():
        for block in re.finditer(r"^```(?:console|bash)\n(.*?)^```", text, re.S | re.M):
            body = block.group(1)
            if "$ python -m rpcx backends\n" in body:
                line = text.count("\n", 0, block.start()) + 2
                samples.append((f"{page.relative_to(ROOT)}:{line}",
                                body.split("$ python -m rpcx backends\n", 1)[1]))
    return samples


@pytest.mark.parametrize("where, sample", _backends_samples(), ids=lambda v: v)
def test_a_backends_sample_is_the_command_s_output(
        where: str, sample: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["backends"]) == 0
    real = capsys.readouterr().out
    shown, installed = _table(sample), _table(real)
    assert shown.get("name") == installed["name"], f"{where}: the heading"
    for name, cells in shown.items():  # (a plugin the docs show may not be installed)
        if name in installed:
            assert cells == installed[name], f"{where}: {name}"
    built_in = {name for name, cells in installed.items() if cells[1].startswith("rpcx.")}
    assert built_in <= set(shown), f"{where} lacks {built_in - set(shown)}"
    assert real.strip().splitlines()[-1] in sample, where
