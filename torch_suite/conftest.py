"""pytest plugin for torch's RPC suite: backend choice, known failures, the summary.

Options:
    --torch-suite-backend NAME   auto, gloo, tensorpipe or torch (default: $TORCH_SUITE_BACKEND,
                                 else gloo).
    --torch-suite-raw            do not mark the known failures (expectations.py) xfail.
    --torch-suite-report PATH    write the per-test outcomes there (default:
                                 torch_suite/results/<backend>.txt).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

HERE = Path(__file__).parent
# SUITE.test -> passed, failed, error, skipped, xfailed, xpassed (with xdist, the
# controller receives every worker's reports)
_OUTCOMES: dict[str, str] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("torch_suite")
    group.addoption("--torch-suite-backend", default=None,
                    help="auto, gloo, tensorpipe or torch (torch's own agent)")
    group.addoption("--torch-suite-raw", action="store_true",
                    help="run without marking the known failures xfail")
    group.addoption("--torch-suite-report", default=None,
                    help="file for the per-test outcomes")


def pytest_configure(config: pytest.Config) -> None:
    chosen = config.getoption("--torch-suite-backend")
    if chosen:
        os.environ["TORCH_SUITE_BACKEND"] = chosen  # read when the test module is imported
    # Workers fork from this process: keep OpenMP out of it (and 4 workers on 2 cores
    # gain nothing from more threads).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Before any test module is collected: torch's test helpers bind
    # torch.distributed.rpc when first imported, whichever module imports them first.
    from torch_suite import shim

    if shim.backend() != "torch":
        shim.install()


def _backend() -> str:
    return os.environ.get("TORCH_SUITE_BACKEND", "gloo")


def _key(item_or_nodeid: str) -> str:
    """``SUITE.test`` for ``torch_suite/test_torch_rpc.py::GlooRpcTest::test``."""
    parts = item_or_nodeid.split("::")
    cls, test = parts[-2], parts[-1]
    prefix = _backend().capitalize()
    return f"{cls.removeprefix(prefix)}.{test}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--torch-suite-raw"):
        return
    from torch_suite.expectations import expected_failure

    for item in items:
        if "test_torch_rpc.py::" not in item.nodeid:
            continue
        known = expected_failure(_key(item.nodeid), _backend())
        if known is not None:
            item.add_marker(pytest.mark.xfail(reason=f"[{known.category}] {known.reason}",
                                              strict=True))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "test_torch_rpc.py::" not in report.nodeid:  # the harness's own tests
        return
    outcomes = _OUTCOMES
    key = _key(report.nodeid)
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        elif report.when == "setup" and report.failed:
            outcome = "error"
        else:
            outcome = report.outcome
        outcomes[key] = outcome
    elif report.when == "teardown" and report.failed and outcomes.get(key) == "passed":
        outcomes[key] = "error"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter,
                            config: pytest.Config) -> None:
    outcomes = _OUTCOMES
    if not outcomes:
        return
    counts = Counter(outcomes.values())
    backend = _backend()
    total = len(outcomes)
    line = ", ".join(f"{counts[k]} {k}" for k in
                     ("passed", "failed", "error", "skipped", "xfailed", "xpassed") if counts[k])
    terminalreporter.write_sep("=", f"torch's RPC suite on {backend}: {total} tests: {line}")
    report = config.getoption("--torch-suite-report")
    path = Path(report) if report else HERE / "results" / f"{backend}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        out.write(f"# torch's RPC suite on {backend}: {total} tests: {line}\n")
        for key in sorted(outcomes):
            out.write(f"{outcomes[key]:8} {key}\n")
    terminalreporter.write_line(f"per-test outcomes: {path}")
