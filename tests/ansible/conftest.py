"""A private loopback deployment (tiny random checkpoint, free ports, tmp state) shared by a test module."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.ansible.playbook import ANSIBLE_PLAYBOOK, HOSTS, SPARE_ADDRESS, Deployment, free_port


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Iterator[Deployment]:
    """Not yet deployed: tests run deploy.yml themselves. Torn down (and any leftover killed) at the end."""
    if not ANSIBLE_PLAYBOOK.exists():
        pytest.skip("ansible-playbook is not installed in .venv (pip install -e '.[test]')")
    hosts = (*HOSTS.values(), SPARE_ADDRESS)
    http_port = free_port(*hosts)
    d = Deployment(root=tmp_path_factory.mktemp("ansible"), model=tiny_llama, http_port=http_port,
                   cluster_port=free_port(*hosts, avoid=(http_port,)))
    yield d
    if d.pids():  # a test failed before test_teardown_leaves_no_process
        d.run("teardown.yml")
        d.kill_leftovers()
