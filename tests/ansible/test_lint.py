"""The playbooks and roles pass ansible-lint's production profile (offline)."""

from __future__ import annotations

import subprocess

import pytest

from tests.ansible.playbook import REPO

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

LINT = REPO / ".venv" / "bin" / "ansible-lint"


def test_ansible_lint_production_profile() -> None:
    if not LINT.exists():
        pytest.skip("ansible-lint is not installed in .venv (pip install -e '.[dev]')")
    proc = subprocess.run([str(LINT), "--profile", "production", "--offline", "--nocolor"], cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Profile 'production' was required, and it passed" in proc.stdout + proc.stderr
