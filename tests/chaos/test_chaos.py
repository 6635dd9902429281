"""Chaos: 4 streams of bounded load for about 60 s while a loop kills, freezes or restarts a random node.

Two clusters of tiny random checkpoints: a pipeline with a spare (``--pp-auto 2 --pp-spare 1`` over
three ``--pp-peer`` processes, ``tests/chaos/spare_cluster.py``) on loopback addresses, and a
disaggregated one (router + 2 prefill + 2 decode nodes) whose nodes are hosts in network
namespaces (``tests/chaos/netns.py``; the router runs in this machine's namespace, on the lab's
gateway address), where the loop also cuts a node's link for 2.5-3 s (skipped, with the reason, where
``ip netns`` cannot be used). A killed or restarted node is started again at once by the test with the
same command line (a supervisor's job; issue 25 item 1), except the first stage killed, which the
spare takes over. Counted (``tests/chaos/harness.py``): requests started, completed (whole, and equal
to the undisturbed run, greedy, token for token), resumed and held (/metrics), failed with a clean
error, hung (must be 0) and silently truncated (must be 0); at least 99% complete on both clusters
(issue 25 item 6). The
counts and the seconds from each kill to serving again go to ``$MLXCEL_CHAOS_OUT/<name>.json`` when
set (docs/benchmarks.md records a run).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from tests.chaos import netns
from tests.chaos.harness import ACTIONS, LINK_CUT, Chaos, Counts, Load, Target
from tests.chaos.spare_cluster import SpareCluster
from tests.disagg.cluster import DisaggCluster, Hosts
from tests.pipeline.cluster import free_port
from tests.server.util import metrics

pytestmark = [pytest.mark.proc, pytest.mark.timeout(900)]
PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 50, 51], [1, 60, 61, 62, 63, 64, 65, 66, 67], [1, 80, 81, 82, 83]]
MAX_TOKENS = 24
DURATION_S = float(os.environ.get("MLXCEL_CHAOS_SECONDS", "60"))


@pytest.fixture(autouse=True)
def patient_starts(monkeypatch):
    """A node started again under load on a shared 2-core box may take minutes to print its URL."""
    from tests.pipeline.cluster import Node

    monkeypatch.setattr(Node, "start_wait_s", 240.0)
    monkeypatch.setattr(Node, "ready_wait_s", 240.0)


def undisturbed(url: str) -> list[str]:
    """The greedy text of every prompt before any chaos: what every completion must equal."""
    out = []
    for prompt in PROMPTS:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def reroutes(url: str) -> tuple[int, int, int]:
    """The front end's resumed requests, (a router's) failovers and (a coordinator's) held requests so far."""
    m = metrics(url)
    return (int(m["mlxcel_resumed_requests_total"]), int(m.get("router_failovers", 0)),
            int(m.get("mlxcel_requests_held_total", 0)))


def run_chaos(name: str, url: str, targets: list[Target], healthy, tmp_path: Path,
              actions: tuple[str, ...] = ACTIONS, seed: int = 25) -> Counts:
    expected = undisturbed(url)
    before = reroutes(url)
    load = Load(url, PROMPTS, expected, max_tokens=MAX_TOKENS, pause_s=0.5).start()
    try:
        Chaos(targets, healthy, load.counts, duration=DURATION_S, actions=actions, seed=seed).run()
    finally:
        counts = load.stop()
    counts.resumed, counts.failovers, counts.held = (a - b for a, b in zip(reroutes(url), before))
    summary = counts.summary()
    out = Path(os.environ.get("MLXCEL_CHAOS_OUT") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\nchaos {name}: {json.dumps(summary)}")
    assert counts.hung == 0, counts.problems
    assert counts.truncated == 0, counts.problems
    assert counts.events, "the chaos loop did nothing"
    assert counts.completed + counts.failed_clean == counts.started
    return counts


def test_chaos_pipeline_two_stages_and_a_spare(tmp_path, tiny_llama):
    """--pp-auto 2 --pp-spare 1: the first killed stage is left dead and the spare takes it over; later
    ones are started again from their TOML (the supervisor's job). Requests in flight at a failure are
    resumed, and new ones that arrive while a stage is down are held until it is back (docs/pipeline.md
    §5.6): at least 99% complete, 0 hung, 0 truncated, and the spare took the killed stage over."""
    c = SpareCluster(tmp_path, tiny_llama).start()
    try:
        counts = run_chaos("pipeline-spare", c.url, c.targets(), c.healthy, tmp_path)
        assert counts.completed >= 0.99 * counts.started, counts.summary()
        kills = [e for e in counts.events if e["action"] == "kill"]
        if kills:
            assert c.spare is None, "the spare took no stage over"
            assert any(s["state"].startswith("stage-") for s in c.health()["spares"])
    finally:
        c.stop()


@pytest.fixture
def lab():
    """Four hosts in network namespaces (2 prefill, 2 decode); every namespace and process gone afterwards."""
    why = netns.unusable()
    if why:
        pytest.skip(f"the disaggregated chaos run cuts links between network namespaces: {why}")
    lab = netns.Lab(4)
    try:
        yield lab
    finally:
        lab.close()


def lab_hosts(lab: netns.Lab) -> Hosts:
    """The router on the lab's gateway (this machine), prefill nodes on hosts 0-1, decode nodes on 2-3."""
    on = {a: i for i, a in enumerate(lab.addresses)}
    return Hosts(router=lab.gateway, prefills=tuple(lab.addresses[:2]), decodes=tuple(lab.addresses[2:]),
                 port=lambda h: free_port(h) if h == lab.gateway else 19000,
                 prefix=lambda h: lab.prefix(on[h]) if h in on else [])


def test_chaos_disaggregated_two_of_each_role(tmp_path, tiny_llama, lab):
    c = DisaggCluster(tmp_path, tiny_llama, prefills=2, decodes=2, hosts=lab_hosts(lab),
                      node_flags=("--no-warmup", "--parallel", "4", "--max-queue", "8"))
    c.start()
    try:
        nodes = [*c.prefills, *c.decodes]
        targets = [Target(n.node_id.split("@")[0] + f"-{i % 2}", pid=lambda n=n: n.proc.pid, start=n.restart,
                          stop=lambda sig, n=n: n.stop(sig), link=lambda up, i=i: lab.link(i, up))
                   for i, n in enumerate(nodes)]

        def healthy() -> bool:
            try:
                return all(n["status"] == "up" for n in c.stats()["nodes"])
            except (httpx.TransportError, ValueError):
                return False

        # seed 18: the first round cuts decode-1, freezes decode-0, kills decode-0 and restarts prefill-0
        counts = run_chaos("disagg", c.url, targets, healthy, tmp_path, actions=(*ACTIONS, LINK_CUT), seed=18)
        assert counts.completed >= 0.99 * counts.started, counts.summary()
        cuts = [e for e in counts.events if e["action"] == LINK_CUT]
        assert cuts and all(e["seen_down"] for e in cuts), cuts  # the router counted every cut node out
        # a decode node killed or cut had requests, which went to the other one: resumed after their first
        # token, or sent again before it (which of the two depends on the moment; tests/disagg/test_cluster.py
        # proves a mid-stream resume)
        if any(e["action"] in ("kill", LINK_CUT) and e["node"].startswith("decode") for e in counts.events):
            assert counts.resumed + counts.failovers >= 1, counts.summary()
    finally:
        c.stop()
