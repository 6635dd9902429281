"""The ``proc`` marker: a test that starts a process (or whose fixture does) must carry it.

So ``pytest -m "not proc"`` is a fast lane of pure tests. Every child the running test starts
through ``subprocess`` or ``multiprocessing`` is counted. In a run that selects by the marker (``-m``
naming ``proc``), an unmarked test that started one fails and says so (mark its module:
``pytestmark = pytest.mark.proc``); in other runs it is listed at the end of the run. With
``MLXCEL_PROC_RECORD=FILE`` the node ids of the tests that started a process are appended to FILE.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from typing import Any

import pytest

RECORD_ENV = "MLXCEL_PROC_RECORD"
_started: list[str] = []  # what the running test started, by program name
_unmarked: list[str] = []  # unmarked tests that started one (reported at the end of a run)


def _program(args: Any) -> str:
    first = args if isinstance(args, (str, bytes, os.PathLike)) else next(iter(args), "?")
    return os.path.basename(os.fsdecode(first))


def _counting(original: Any, name_of: Any) -> Any:
    def start(self: Any, *args: Any, **kwargs: Any) -> Any:
        _started.append(name_of(self, args))
        return original(self, *args, **kwargs)

    return start


subprocess.Popen._execute_child = _counting(  # type: ignore[attr-defined]
    subprocess.Popen._execute_child, lambda self, args: _program(args[0]))  # type: ignore[attr-defined]
multiprocessing.process.BaseProcess.start = _counting(
    multiprocessing.process.BaseProcess.start, lambda self, args: f"multiprocessing {self.name}")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "proc: starts a process (a server, a stage, a playbook, a browser); "
                                       "pytest -m 'not proc' is the fast lane of pure tests")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    _started.clear()
    yield
    _started.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if call.when != "teardown" or not _started:
        return
    programs = ", ".join(sorted(set(_started)))
    record = os.environ.get(RECORD_ENV)
    if record:
        with open(record, "a", encoding="utf-8") as out:
            out.write(f"{item.nodeid}\t{programs}\n")
    if item.get_closest_marker("proc") is not None:
        return
    message = (f"{item.nodeid} started {len(_started)} process(es) ({programs}) but is not marked proc: "
               "add `pytestmark = pytest.mark.proc` to its module")
    if "proc" in (item.config.getoption("markexpr") or "") and report.passed:
        report.outcome = "failed"
        report.longrepr = message
    else:
        _unmarked.append(message)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _unmarked:
        terminalreporter.write_sep("=", "tests that start processes without the proc marker")
        for message in _unmarked:
            terminalreporter.write_line(message)
