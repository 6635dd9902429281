"""A report built once per session from the committed fixtures (tests/fixtures/report)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "report"


@pytest.fixture(scope="session")
def fixture_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the fixture results (tests may write next to it)."""
    dest = tmp_path_factory.mktemp("results") / "results"
    shutil.copytree(FIXTURES / "results", dest)
    return dest


@pytest.fixture(scope="session")
def fixture_report(fixture_results: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The report of the fixture results, compared with the fixture baseline."""
    from mlxcel.report.build import build_report

    out = tmp_path_factory.mktemp("report") / "demo"
    result = build_report([fixture_results], out, baseline=FIXTURES / "baseline")
    assert not result.problems
    return out
