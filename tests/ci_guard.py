"""Under CI=true a skip is a failure, except the few CI may take (tests/conftest.py loads these hooks).

CI (.ci/run) installs everything the suite needs, so a skip there means a test silently did not run: a
missing package, a missing system tool, a sandbox that refuses namespaces. Those fail loudly instead.
The skips allowed are for hardware CI does not have; their device results are committed
(benchmarks/results/*_h200.*).
"""

from __future__ import annotations

import os

import pytest

# reasons (substrings) of the skips CI may take
CI_MAY_SKIP = ("needs a CUDA GPU",)


def _reason(longrepr: object) -> str:
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def _ci_must_not_skip(report: pytest.TestReport | pytest.CollectReport) -> str | None:
    """The skip's reason when CI=true and it is not one CI may take, else None."""
    if os.environ.get("CI") != "true" or not report.skipped or hasattr(report, "wasxfail"):
        return None
    reason = _reason(report.longrepr)
    return None if any(ok in reason for ok in CI_MAY_SKIP) else reason


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    reason = _ci_must_not_skip(report)
    if reason is not None:
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, where everything it needs is installed: {reason}"


_COLLECT_SKIPS: list[str] = []  # a whole module skipped at collection (module-level importorskip)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    reason = _ci_must_not_skip(outcome.get_result())
    if reason is not None:  # an error here would stop the whole run; the run fails at its end instead
        _COLLECT_SKIPS.append(f"{collector.nodeid}: {reason}")


def pytest_terminal_summary(terminalreporter):
    for line in _COLLECT_SKIPS:
        terminalreporter.write_line(f"FAILED (skipped at collection under CI=true) {line}", red=True)


def pytest_sessionfinish(session):
    if _COLLECT_SKIPS and session.exitstatus == 0:
        session.exitstatus = 1
