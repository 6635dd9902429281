"""Benchmark rows record the real git commit (never "HEAD") and the machine."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from bench.environment import COMMIT_ENV, environment, git_commit, write_jsonl

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

REPO = Path(__file__).resolve().parents[2]
COMMIT = re.compile(r"^[0-9a-f]{40}(-dirty)?$")


def test_checkout_commit_is_the_real_hash():
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    commit = git_commit(environ={})
    assert commit is not None and COMMIT.match(commit)
    assert commit.split("-")[0] == head


def test_repo_without_commits_never_records_head(tmp_path: Path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert git_commit(environ={}, repo=tmp_path) is None  # `git rev-parse HEAD` prints "HEAD" here
    assert git_commit(environ={COMMIT_ENV: "ABCDEF0123456789abcdef0123456789abcdef01"}, repo=tmp_path) == \
        "abcdef0123456789abcdef0123456789abcdef01"


def test_outside_a_checkout_the_env_var_is_used(tmp_path: Path):
    assert git_commit(environ={COMMIT_ENV: "46be2e4-dirty"}, repo=tmp_path) == "46be2e4-dirty"


def test_a_malformed_env_var_is_refused(tmp_path: Path):
    with pytest.raises(ValueError, match=COMMIT_ENV):
        git_commit(environ={COMMIT_ENV: "HEAD"}, repo=tmp_path)


def test_rows_carry_commit_and_machine(tmp_path: Path):
    out = write_jsonl(tmp_path / "r.jsonl", [{"bench": "x", "v": 1}])
    row = json.loads(out.read_text())
    assert COMMIT.match(row["env"]["git_commit"])
    machine = row["env"]["machine"]
    assert machine["arch"] and machine["memory_gb"] > 0
    assert set(machine) >= {"arch", "memory_gb", "machine_id", "accelerator"}
    assert environment()["host"] == row["env"]["host"]


def test_a_bad_env_var_keeps_the_rows_and_says_why(monkeypatch, capsys):
    import bench.environment as benv

    monkeypatch.setattr(benv, "_commit_from_checkout", lambda repo: None)  # as on a copy without .git
    monkeypatch.setenv(COMMIT_ENV, "HEAD")
    env = benv.environment()
    assert env["git_commit"] is None and COMMIT_ENV in env["git_commit_problem"]
    assert "rows record no commit" in capsys.readouterr().err
    monkeypatch.setenv(COMMIT_ENV, "0123abc")
    assert benv.environment()["git_commit"] == "0123abc"
