"""pytest plugin of the GPU script (``-p progress``): each test's outcome appended to the JSON-lines
file ``$CAKEOPS_PROGRESS`` as soon as it is known, so that a run cut off at its time limit still
says what it ran (the JUnit file is written only when pytest ends)."""

from __future__ import annotations

import json
import os

import pytest


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get("CAKEOPS_PROGRESS")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):  # xdist: the controller writes
        return
    if report.when != "call" and report.passed:
        return  # one line per test: its call, or the setup/teardown that failed or skipped it
    line = {"test": report.nodeid, "when": report.when, "outcome": report.outcome,
            "seconds": round(report.duration, 3)}  # fmt: skip
    if report.failed:
        line["message"] = str(report.longrepr)[-1500:]
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
