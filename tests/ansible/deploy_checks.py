"""What the deployment tests (test_deploy.py, test_deploy_disagg.py) read from a deployed cluster."""

from __future__ import annotations

import os
import re
import threading
import time

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


def assert_prepare_play_changed_nothing(output: str) -> None:
    """rolling_restart.yml's first play prepares every host as deploy.yml does (install, secret, checkpoint,
    config): on a deployed cluster it changes nothing (the redeploy tests re-run the start phase only)."""
    prepare = output.split("PLAY [Roll the stages or the decode nodes", 1)[0]
    assert "PLAY [Prepare every host" in prepare and "changed: [" not in prepare, prepare[-4000:]


def roll_order(output: str) -> list[str]:
    """The hosts in the order the playbook rolled them, checking that none overlaps the next: a host's wait
    until it is idle comes after the previous host's restart (the hosts of the preparing plays report in any
    order, so only these two tasks count)."""
    events, task = [], ""
    for line in output.splitlines():
        if line.startswith("TASK ["):
            task = line
        elif "Restarted | wait until it holds nothing" in task and re.match(r"(ok|changed): \[", line):
            events.append(("idle", re.match(r"\w+: \[([\w-]+)", line)[1]))
        elif re.match(r"included: \S*/restart-\w+\.yml for ", line):
            events.append(("restart", line.rsplit(" for ", 1)[1].strip()))
    order = [host for kind, host in events if kind == "idle"]
    assert events == [(kind, host) for host in order for kind in ("idle", "restart")], events
    return order


class StreamingLoad:
    """``streams`` clients, each streaming one greedy chat completion after another, ``pause_s`` apart, until stopped.
    The pause keeps requests arriving in every phase of a rolling restart (each lasts seconds) without the clients
    taking the CPU the restarting node needs on a small shared box."""

    def __init__(self, deployment: Deployment, key: str, streams: int, pause_s: float = 0.25):
        self.client = openai.OpenAI(base_url=f"{deployment.url}/v1", api_key=key, max_retries=0, timeout=120)
        self.model = self.client.models.list().data[0].id
        self.streams, self.pause_s, self.stopping = streams, pause_s, False
        self.completed, self.failures, self.answers = 0, [], []  # type: ignore[var-annotated]
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(streams)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stopping = True
        for thread in self.threads:
            thread.join(timeout=120)

    def _run(self) -> None:
        while not self.stopping:
            try:
                stream = self.client.chat.completions.create(
                    model=self.model, max_tokens=12, temperature=0, stream=True,
                    messages=[{"role": "user", "content": "Name three colours."}])
                text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                self.answers.append(text)
                self.completed += 1
            except Exception as exc:  # noqa: BLE001 - every failure counts
                self.failures.append(f"{type(exc).__name__}: {exc}")
            time.sleep(self.pause_s)
