"""What the deployment tests (test_deploy.py, test_deploy_disagg.py) read from a deployed cluster."""

from __future__ import annotations

import os

import openai

from tests.ansible.playbook import HOSTS, Deployment

NODES = tuple(HOSTS)


def greedy_answer(url: str, api_key: str = "unused") -> str:
    """The greedy answer to one chat prompt from the OpenAI API at ``url``."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=60)
    reply = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=12, temperature=0,
                                           messages=[{"role": "user", "content": "Name three colours."}])
    return reply.choices[0].message.content


def pids_of(deployment: Deployment, nodes: tuple[str, ...] = NODES) -> dict[str, str]:
    return {n: (deployment.home(n) / "node.pid").read_text() for n in nodes}


def argv_of(deployment: Deployment, node: str) -> list[str]:
    pid = int((deployment.home(node) / "node.pid").read_text())
    return [a.decode() for a in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def layer_threads(holders_on_this_machine: int) -> str:
    """--threads of a node holding layers when all hosts are this machine (ansible_processor_nproc: our affinity)."""
    return str(max(1, len(os.sched_getaffinity(0)) // holders_on_this_machine))


def assert_redeploy_changes_nothing(deployment: Deployment, *args: str, nodes: tuple[str, ...] = NODES,
                                     **more: object) -> None:
    pids = pids_of(deployment, nodes)
    result = deployment.run("deploy.yml", *args, **more)
    assert result.rc == 0, result.output[-4000:]
    assert {h: r["changed"] for h, r in result.recap().items()} == \
        {f"local-{n}": 0 for n in nodes}, result.output[-4000:]
    assert pids == pids_of(deployment, nodes)  # nothing restarted
    print(f"re-run: {result.seconds:.1f} s")
