"""deploy.yml / status.yml / rolling_restart.yml / teardown.yml with mlxcel_topology disagg on the loopback inventory.

A router, a prefill node and two decode nodes (real processes on 127.0.0.2-5, with the API key on the
router), in file order on one deployment: the start order (decode, prefill, router), the greedy answer
through the router equal to a single node's, redeploy (changed=0: the start phase here, the phases before it in
the rolling restart's first play), status, a rolling restart of the decode nodes under load (no request fails),
teardown. Its own module (and deployment, on free ports), so
that it runs beside the pipeline's tests (test_deploy.py) on another test worker.
"""

from __future__ import annotations

import json
import re
import time
from typing import Iterator

import openai
import pytest

from mlxcel.topology.cluster_config import load_cluster_config

from tests.ansible.deploy_checks import (StreamingLoad, argv_of, assert_prepare_play_changed_nothing, assert_redeploy_changes_nothing,
                                         flag, greedy_answer, layer_threads, pids_of, roll_order)
from tests.ansible.playbook import HOSTS, REPO, SPARE_ADDRESS, Deployment
from tests.server.util import ServerProcess

pytestmark = [pytest.mark.timeout(600), pytest.mark.proc]

DISAGG = {"router": ("router", HOSTS["coordinator"]), "prefill-0": ("prefill", HOSTS["stage-0"]),
          "decode-0": ("decode", HOSTS["stage-1"]), "decode-1": ("decode", SPARE_ADDRESS)}
DISAGG_NODES = tuple(DISAGG)


@pytest.fixture(scope="module")
def disagg(deployment: Deployment, tmp_path_factory: pytest.TempPathFactory):
    """The inventory: a router, a prefill node and two decode nodes on 127.0.0.2-5 with the API key on; torn down at
    the end."""
    hosts: dict[str, dict] = {}
    for node, (role, address) in DISAGG.items():
        group = hosts.setdefault(role, {"hosts": {}})
        group["hosts"][f"local-{node}"] = {"ansible_host": address, "mlxcel_node_id": node}
    inventory = {"mlxcel_cluster": {
        "vars": {"mlxcel_topology": "disagg", "mlxcel_api_key_enabled": True, "ansible_connection": "local",
                 "ansible_python_interpreter": "{{ ansible_playbook_python }}",
                 "mlxcel_home": "{{ mlxcel_state_root }}/{{ mlxcel_node_id }}", "mlxcel_install_method": "reuse",
                 "mlxcel_venv": str(REPO / ".venv"), "mlxcel_model_dir": "{{ mlxcel_model_source }}",
                 "mlxcel_node_supervisor": "pidfile"},
        "children": hosts}}
    path = tmp_path_factory.mktemp("disagg") / "hosts.yml"
    path.write_text(json.dumps(inventory))  # JSON is YAML
    yield str(path)
    if any((deployment.home(n) / "node.pid").exists() for n in DISAGG_NODES):  # a test failed before teardown
        deployment.run("teardown.yml", inventory=str(path))


@pytest.fixture(scope="module")
def single_answer(tiny_llama) -> Iterator[str]:
    """The greedy answer of one ``mlxcel serve`` process on the same checkpoint (what the router must match)."""
    server = ServerProcess(tiny_llama, "--node-role", "hybrid", "--no-warmup")
    try:
        server.wait_ready()
        yield greedy_answer(server.url)
    finally:
        server.stop()


def _api_key(deployment: Deployment) -> str:
    return (deployment.controller / "api.key").read_text().strip()


def _disagg_deployed(deployment: Deployment) -> None:
    if not (deployment.home("router") / "node.pid").exists():
        pytest.skip("the disaggregated cluster did not come up (see test_disagg_deploy_starts_decode_prefill_router)")


@pytest.mark.timeout(900)
def test_disagg_deploy_starts_decode_then_prefill_then_router(deployment: Deployment, disagg: str) -> None:
    result = deployment.run("deploy.yml", inventory=disagg, timeout=800)  # four nodes: slow on a loaded box
    assert result.rc == 0, result.output[-4000:]
    recap = result.recap()
    assert set(recap) == {f"local-{n}" for n in DISAGG_NODES} and all(r["failed"] == 0 for r in recap.values())
    started = [result.output.find(f"msg: {n} started") for n in ("decode-0", "prefill-0", "router")]
    assert -1 not in started and started == sorted(started), result.output[-4000:]  # decode, prefill, router
    assert f"OpenAI API: {deployment.url}/v1" in result.output and "answer: " in result.output
    key = _api_key(deployment)
    assert key not in result.output
    for node, (role, address) in DISAGG.items():
        home = deployment.home(node)
        pid = int((home / "node.pid").read_text())
        argv = argv_of(deployment, node)
        assert (flag(argv, "--host"), flag(argv, "--node-id")) == (address, node)
        assert flag(argv, "--distributed-config") == str(home / "cluster.toml")
        assert flag(argv, "--cluster-secret-file") == str(home / "cluster.secret")  # every role needs the secret
        # the OpenAI API, its key and TLS are the router's; prefill and decode nodes serve /health only
        assert ("--api-key-file" in argv) == (role == "router") == (home / "api.key").exists()
        # the prefill and decode nodes share this machine's cores; the router holds no layers
        assert flag(argv, "--threads") == ("1" if role == "router" else layer_threads(3))
        config = load_cluster_config(home / "cluster.toml")
        assert [(n.id, n.role, str(n.address)) for n in config.disagg] == [
            (n, r, f"{a}:{deployment.cluster_port}") for n, (r, a) in DISAGG.items()]
        environ = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace").split("\0")
        allowlist = [e for e in environ if e.startswith("MLXCEL_DECODE_ALLOWLIST=")]
        decodes = ",".join(f"{a}:{deployment.cluster_port}" for r, a in DISAGG.values() if r == "decode")
        assert allowlist == ([f"MLXCEL_DECODE_ALLOWLIST={decodes}"] if role == "prefill" else []), allowlist
        assert key not in (home / "node.toml").read_text() + (home / "node.log").read_text()
    print(f"disaggregated deploy: {result.seconds:.1f} s")


def test_disagg_chat_through_the_router_equals_a_single_node(deployment: Deployment, disagg: str,
                                                            single_answer: str) -> None:
    _disagg_deployed(deployment)
    with pytest.raises(openai.AuthenticationError):  # the router's API key is on
        greedy_answer(deployment.url, api_key="not-the-key")
    assert greedy_answer(deployment.url, api_key=_api_key(deployment)) == single_answer


def test_disagg_redeploy_changes_nothing(deployment: Deployment, disagg: str) -> None:
    """The start phase again (--tags start) restarts nothing; the phases before it (install, secret, checkpoint,
    config) are re-run on every host by the rolling restart's first play, which changes nothing (tested there)."""
    _disagg_deployed(deployment)
    assert_redeploy_changes_nothing(deployment, "--tags", "start", inventory=disagg, nodes=DISAGG_NODES)


def test_disagg_status_reports_each_role_and_health(deployment: Deployment, disagg: str) -> None:
    _disagg_deployed(deployment)
    result = deployment.run("status.yml", inventory=disagg)
    assert result.rc == 0, result.output[-4000:]
    text = " ".join(result.output.split())
    pids = pids_of(deployment, DISAGG_NODES)
    rows = {node: re.search(rf"\b{node} +{role} +{pids[node].strip()} +{address}:{deployment.http_port} +"
                            rf"{deployment.cluster_port} +200 ready +(-|sequences \d+)", text)
            for node, (role, address) in DISAGG.items()}
    assert all(rows.values()), result.output[-3000:]
    # a ready router shows no detail; a prefill or decode node its sequences in progress
    assert [rows[n][1] for n in DISAGG_NODES] == ["-"] + ["sequences 0"] * 3, result.output[-3000:]
    assert [rows[n].start() for n in DISAGG_NODES] == sorted(rows[n].start() for n in DISAGG_NODES)  # TOML order


@pytest.mark.timeout(900)
def test_disagg_rolling_restart_of_the_decode_nodes_under_load_fails_nothing(deployment: Deployment,
                                                                            disagg: str) -> None:
    """rolling_restart.yml on the decode nodes while two clients stream: each is drained (the router sends it
    nothing new, what it holds finishes), restarted and used again before the next; no request fails."""
    _disagg_deployed(deployment)
    key = _api_key(deployment)
    expected = greedy_answer(deployment.url, api_key=key)
    decodes = ("decode-0", "decode-1")
    pids = pids_of(deployment, decodes)
    tomls = {n: (deployment.home(n) / "node.toml").read_text() for n in decodes}
    others = pids_of(deployment, ("router", "prefill-0"))
    load = StreamingLoad(deployment, key, streams=2)
    load.start()
    try:
        wait_until = time.monotonic() + 60
        while load.completed < 2 and time.monotonic() < wait_until:  # the load runs before the first drain
            time.sleep(0.1)
        result = deployment.run("rolling_restart.yml", inventory=disagg, mlxcel_node_rolling_roles=["decode"],
                                timeout=800)
        done_during = load.completed
    finally:
        load.stop()
    assert result.rc == 0, result.output[-4000:]
    assert_prepare_play_changed_nothing(result.output)  # the phases before the start phase, re-run
    assert all(pids[n] != p for n, p in pids_of(deployment, decodes).items())  # both restarted
    # the same node TOML: a serial play still sees the other hosts' facts (the thread budget counts them)
    assert {n: (deployment.home(n) / "node.toml").read_text() for n in decodes} == tomls
    assert pids_of(deployment, ("router", "prefill-0")) == others  # the roles not rolled are left alone
    assert roll_order(result.output) == ["local-decode-0", "local-decode-1"], result.output[-3000:]  # one at a time
    print(f"rolling restart of 2 decode nodes: {result.seconds:.1f} s; {load.completed} requests completed "
          f"({done_during} by its end), {len(load.failures)} failed")
    assert load.failures == [], load.failures[:5]
    assert done_during >= 4 and set(load.answers) == {expected}, (done_during, set(load.answers))


def test_disagg_teardown_leaves_no_process(deployment: Deployment, disagg: str) -> None:
    _disagg_deployed(deployment)
    result = deployment.run("teardown.yml", inventory=disagg)
    assert result.rc == 0, result.output[-4000:]
    stopped = [result.output.find(f"TASK [mlxcel_node : Stopped | {what}") for what in (
        "stop the coordinator or the routers first", "then the prefill nodes",
        "then the stages, the spares or the decode nodes")]
    assert -1 not in stopped and stopped == sorted(stopped), result.output[-3000:]
    assert deployment.pids() == []
    assert not any((deployment.home(n) / "node.pid").exists() for n in DISAGG_NODES)
