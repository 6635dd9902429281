"""The ``proc`` marker: a test that starts a process (or whose fixture does) must carry it.

So ``pytest -m "not proc"`` is a fast lane of pure tests. Every child the running test starts
through ``subprocess`` or ``multiprocessing`` is counted; an unmarked test that started one fails
and says so (mark its module: ``pytestmark = pytest.mark.proc``). With ``MLXCEL_PROC_RECORD=FILE``
nothing fails: the node ids of the tests that started a process are appended to FILE instead.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from typing import Any

import pytest

RECORD_ENV = "MLXCEL_PROC_RECORD"
_started: list[str] = []  # what the running test started, by program name


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
    record = os.environ.get(RECORD_ENV)
    if record:
        with open(record, "a", encoding="utf-8") as out:
            out.write(f"{item.nodeid}\t{','.join(sorted(set(_started)))}\n")
    elif item.get_closest_marker("proc") is None and report.passed:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} started {len(_started)} process(es) ({', '.join(sorted(set(_started)))}) "
                           "but is not marked proc: add `pytestmark = pytest.mark.proc` to its module")
