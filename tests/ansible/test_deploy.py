"""deploy.yml / status.yml / teardown.yml on the loopback inventory: 3 real processes on 127.0.0.2-4.

The tests run in file order on one deployment: deploy, chat,
a SIGKILLed stage restarted by its supervisor, redeploy (changed=0: the start phase; the phases before it in
the rolling restart's first play), status with the restart, secrets,
secret rotation, bench (all with the rendered TOML), then the same hosts brought up again with
mlxcel_bringup=pp_auto (--pp-auto / --pp-peer): the same answer, status with each peer's assignment,
a dead peer re-assigned by the running coordinator, then a spare host that takes a lost stage over: the redeploy
that starts the old stage host again as a spare changes nothing on the other hosts, and a last run of the start
phase changes nothing at all (pp_auto's idempotence: after a peer was re-assigned, with a spare standing by; a
supervisor's restart of a node is left alone in test_redeploy_changes_nothing); then teardown (supervisors included).
The disaggregated topology has its own module and deployment (test_deploy_disagg.py). The API key and
TLS of a pipeline are tested on the namespace cluster (test_netns.py), where the OpenAI port is off loopback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import time
import tomllib
import urllib.error
import urllib.request

import openai
import pytest

from mlxcel.topology.cluster_config import load_cluster_config

from tests.ansible.deploy_checks import (NODES, StreamingLoad, argv_of, assert_prepare_play_changed_nothing,
                                         assert_redeploy_changes_nothing, flag,
                                         greedy_answer, layer_threads, pids_of, roll_order)
from tests.ansible.playbook import HOSTS, SPARE_ADDRESS, Deployment, free_port, spare_inventory

pytestmark = [pytest.mark.timeout(600), pytest.mark.proc]
PP_AUTO = {"mlxcel_bringup": "pp_auto"}
ANSWERS: dict[str, str] = {}  # bring-up -> the greedy answer to one prompt
SPARES: dict[str, str] = {}  # "inventory": the inventory with a spare host, once a test deployed it
SPARE_NODES = (*NODES, "spare-0")


@pytest.fixture(scope="module")
def deployment(deployment: Deployment) -> Deployment:
    """The module's deployment, with a warm standby only on stage-1 (the stage test_a_killed_stage_... kills)."""
    deployment.standbys = ("stage-1",)
    return deployment


def _deployed(deployment: Deployment) -> None:
    if not (deployment.home("coordinator") / "node.pid").exists():
        pytest.skip("the deployment did not come up (see test_deploy_starts_three_nodes)")


def test_deploy_starts_three_nodes(deployment: Deployment) -> None:
    result = deployment.run("deploy.yml")
    assert result.rc == 0, result.output[-4000:]
    recap = result.recap()
    assert set(recap) == {"local-coordinator", "local-stage-0", "local-stage-1"}, result.output[-2000:]
    assert all(r["failed"] == 0 and r["unreachable"] == 0 for r in recap.values())
    assert f"OpenAI API: {deployment.url}/v1" in result.output
    assert "answer: " in result.output
    # nothing ran before: every node says it started, no handler restarts anything, no message speaks of it
    assert all(f"msg: {node} started" in result.output for node in NODES), result.output[-4000:]
    handlers = [line for line in result.output.splitlines() if line.startswith("RUNNING HANDLER")]
    assert not [h for h in handlers if "restart" in h.lower()], handlers
    assert "restarted" not in "".join(re.findall(r"msg: .*", result.output))
    assert "secret file changed" not in result.output
    for node, address in HOSTS.items():
        pid = int((deployment.home(node) / "node.pid").read_text())
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        assert cmdline[cmdline.index(b"--host") + 1].decode() == address  # its own address, never 0.0.0.0
        assert cmdline[cmdline.index(b"--node-id") + 1].decode() == node
        # the thread budget: the two stages split this machine's cores, the coordinator holds no layers
        threads = "1" if node == "coordinator" else layer_threads(2)
        assert flag([a.decode() for a in cmdline], "--threads") == threads
        # the rendered TOML is what the engine's loader (--distributed-config) reads
        config = load_cluster_config(deployment.home(node) / "cluster.toml")
        assert config.secret_file == deployment.home(node) / "cluster.secret"
        assert (config.coordinator.id, str(config.coordinator.address)) == \
            ("coordinator", f"{HOSTS['coordinator']}:{deployment.cluster_port}")
        assert [(s.id, str(s.address), s.layers) for s in config.stages] == [  # ranges from mlxcel plan
            ("stage-0", f"{HOSTS['stage-0']}:{deployment.cluster_port}", (0, 2)),
            ("stage-1", f"{HOSTS['stage-1']}:{deployment.cluster_port}", (2, 4))]
    print(f"first deploy: {result.seconds:.1f} s")


def test_chat_through_the_coordinator_with_openai(deployment: Deployment) -> None:
    _deployed(deployment)
    client = openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=8, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens >= 1
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=4, temperature=0, stream=True)
    assert any(chunk.choices and chunk.choices[0].finish_reason for chunk in stream)
    ANSWERS["toml"] = greedy_answer(deployment.url)


def _supervisors(deployment: Deployment) -> dict[int, str]:
    """The deployment's live supervisors (mlxcel node supervise), pid -> the node TOML each supervises."""
    found = {}
    for pid in deployment.pids():
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\0")
        except OSError:
            continue
        if "supervise" in argv:
            found[pid] = argv[argv.index("--config") + 1]
    return found


def _answer_when_served(deployment: Deployment, timeout_s: float) -> str:
    """The greedy answer, asked again and again (a 503 or a refused connection is a node not back yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return greedy_answer(deployment.url)
        except (openai.APIStatusError, openai.APIConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_killed_stage_is_restarted_by_its_supervisor_and_serves_again(deployment: Deployment) -> None:
    """pidfile mode: SIGKILL a stage; its supervisor restarts it (from its warm standby), the coordinator re-admits
    it, and the cluster serves again within 10 s."""
    _deployed(deployment)
    if "toml" not in ANSWERS:
        pytest.skip("no answer to compare with (see test_chat_through_the_coordinator)")
    assert sorted(_supervisors(deployment).values()) == sorted(str(deployment.home(n) / "node.toml") for n in NODES)
    state_file = deployment.home("stage-1") / "node.pid.state"
    deadline = time.monotonic() + 180  # its standby (mlxcel/commands/standby.py) has done its imports
    while not json.loads(state_file.read_text())["standby_warm"] and time.monotonic() < deadline:
        time.sleep(0.2)
    pid = int((deployment.home("stage-1") / "node.pid").read_text())
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    answer = _answer_when_served(deployment, timeout_s=60)
    healed = time.monotonic() - killed
    assert answer == ANSWERS["toml"]
    assert int((deployment.home("stage-1") / "node.pid").read_text()) != pid
    state = json.loads((deployment.home("stage-1") / "node.pid.state").read_text())
    assert (state["state"], state["restarts"], state["last_cause"]) == ("running", 1, "signal SIGKILL"), state
    log = (deployment.home("stage-1") / "node.log").read_text()
    assert "mlxcel node supervise: stage-1 ended (signal SIGKILL) after" in log and "stage-1 ready again" in log
    assert "restarted (restart 1) from its warm standby" in log
    print(f"SIGKILL of stage-1 to the cluster serving again: {healed:.1f} s (the stage ready again "
          f"{state['last_heal_s']} s after its death)")
    assert healed <= 10, f"{healed:.1f} s from SIGKILL to serving again (target: 10 s)"


def test_redeploy_changes_nothing(deployment: Deployment) -> None:
    """After the healed crash of test_a_killed_stage_is_restarted_...: the start phase again (--tags start) restarts
    nothing; the phases before it are re-run on every host by the rolling restart's first play, which changes
    nothing (test_rolling_restart_of_the_stages_under_load_fails_nothing)."""
    _deployed(deployment)
    assert_redeploy_changes_nothing(deployment, "--tags", "start")


def test_status_reports_role_pid_port_and_health(deployment: Deployment) -> None:
    _deployed(deployment)
    result = deployment.run("status.yml")
    assert result.rc == 0, result.output[-4000:]
    for node, address in HOSTS.items():
        pid = (deployment.home(node) / "node.pid").read_text().strip()
        role = "coordinator" if node == "coordinator" else "stage"
        line = next((ln for ln in result.output.splitlines() if f" {node} " in f" {ln.strip(' -')} "), "")
        assert role in line and pid in line and f"{address}:{deployment.http_port}" in line, result.output[-3000:]
        assert str(deployment.cluster_port) in line and "200 " in line, line
        # the restarts column: the stage killed above was restarted once by its supervisor
        assert line.rstrip().endswith(" 1 (signal SIGKILL)" if node == "stage-1" else " 0"), line


def test_secret_is_0600_everywhere_and_never_leaks(deployment: Deployment) -> None:
    _deployed(deployment)
    controller_secret = deployment.controller / "cluster.secret"
    secret = controller_secret.read_text().strip()
    assert len(bytes.fromhex(secret)) == 32
    assert stat.S_IMODE(controller_secret.stat().st_mode) == 0o600
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert secret not in ps
    for node in NODES:
        home = deployment.home(node)
        assert (home / "cluster.secret").read_text().strip() == secret
        assert stat.S_IMODE((home / "cluster.secret").stat().st_mode) == 0o600
        toml = (home / "cluster.toml").read_text()
        assert tomllib.loads(toml)["cluster"]["secret_file"] == str(home / "cluster.secret")
        for name in ("cluster.toml", "node.log", "node.toml"):
            assert secret not in (home / name).read_text(), f"{node}: the secret is in {name}"
        environ = open(f"/proc/{int((home / 'node.pid').read_text())}/environ", "rb").read().decode(errors="replace")
        assert secret not in environ


def test_secret_rotation_restarts_every_node_with_the_new_secret(deployment: Deployment) -> None:
    _deployed(deployment)
    old_secret = (deployment.controller / "cluster.secret").read_text()
    pids = {n: (deployment.home(n) / "node.pid").read_text() for n in NODES}
    result = deployment.run("deploy.yml", mlxcel_secret_rotate=True)
    assert result.rc == 0, result.output[-4000:]
    new_secret = (deployment.controller / "cluster.secret").read_text()
    output = result.output.split()  # the YAML callback folds long messages
    assert new_secret != old_secret and new_secret.strip() not in result.output
    for node in NODES:
        assert (deployment.home(node) / "cluster.secret").read_text() == new_secret
        assert (deployment.home(node) / "node.pid").read_text() != pids[node], f"{node} did not restart"
        assert f"msg: {node} restarted ({deployment.home(node) / 'cluster.secret'} changed)" in " ".join(output)
    assert "answer: " in result.output  # the restarted cluster serves


def test_bench_fetches_rows_and_builds_the_report(deployment: Deployment) -> None:
    _deployed(deployment)
    # pipeline_bench starts processes of its own (tests/bench covers it): frame and serving here
    result = deployment.run("bench.yml", mlxcel_bench_run_id="t1", mlxcel_bench_suites=["frame", "serving"], mlxcel_bench_report_dir=str(deployment.root / "reports"),
                            mlxcel_bench_frame_port=free_port(*HOSTS.values()), timeout=400,
                            mlxcel_bench_frame_args=["--suites", "unprotected,aes", "--sizes", "8192,1048576"])
    assert result.rc == 0, result.output[-4000:]
    rows = deployment.controller / "bench" / "t1"
    frame = [json.loads(line) for line in (rows / "coordinator" / "frame_bench.jsonl").read_text().splitlines()]
    assert {r["payload_bytes"] for r in frame} == {8192, 1048576} and all(r["p50_us"] > 0 for r in frame)
    assert list((rows / "controller").glob("serve_bench*.jsonl"))
    report = deployment.root / "reports" / "t1"
    assert (report / "index.html").stat().st_size > 1000
    assert f"report: {report}/index.html" in result.output


@pytest.mark.timeout(900)
def test_rolling_restart_of_the_stages_under_load_fails_nothing(deployment: Deployment) -> None:
    """rolling_restart.yml on the stages while two clients stream: each stage is drained (new sequences wait,
    what it holds finishes), restarted and re-admitted before the next; the coordinator holds the requests
    that arrive while a stage is away (resuming is on by default), so none fails and every answer is whole."""
    _deployed(deployment)
    if "toml" not in ANSWERS:
        pytest.skip("no answer to compare with (see test_chat_through_the_coordinator)")
    stages = ("stage-0", "stage-1")
    pids, coordinator = pids_of(deployment, stages), pids_of(deployment, ("coordinator",))
    tomls = {n: (deployment.home(n) / "node.toml").read_text() for n in stages}
    load = StreamingLoad(deployment, "unused", streams=2)
    load.start()
    try:
        wait_until = time.monotonic() + 60
        while load.completed < 2 and time.monotonic() < wait_until:  # the load runs before the first drain
            time.sleep(0.1)
        result = deployment.run("rolling_restart.yml", mlxcel_node_rolling_roles=["stage"], timeout=800)
        done_during = load.completed
    finally:
        load.stop()
    assert result.rc == 0, result.output[-4000:]
    assert_prepare_play_changed_nothing(result.output)  # the phases before the start phase, re-run
    assert all(pids[n] != p for n, p in pids_of(deployment, stages).items())  # both restarted
    # the same node TOML: a serial play still sees the other hosts' facts (the thread budget counts them)
    assert {n: (deployment.home(n) / "node.toml").read_text() for n in stages} == tomls
    assert pids_of(deployment, ("coordinator",)) == coordinator  # the coordinator was left alone
    assert roll_order(result.output) == ["local-stage-0", "local-stage-1"], result.output[-3000:]
    print(f"rolling restart of 2 stages: {result.seconds:.1f} s; {load.completed} requests completed "
          f"({done_during} by its end), {len(load.failures)} failed")
    assert load.failures == [], load.failures[:5]
    assert done_during >= 4 and set(load.answers) == {ANSWERS["toml"]}, (done_during, set(load.answers))


def test_pp_auto_bringup_assigns_the_stages_and_answers_as_the_toml_did(deployment: Deployment) -> None:
    _deployed(deployment)
    if "toml" not in ANSWERS:
        pytest.skip("no answer of the rendered-TOML cluster to compare with (see test_chat_through_the_coordinator)")
    pids = pids_of(deployment)
    result = deployment.run("deploy.yml", **PP_AUTO)
    assert result.rc == 0, result.output[-4000:]
    text = " ".join(result.output.split())  # the YAML callback folds long messages
    # another command line on every host: the whole cluster restarts, the peers first, then the coordinator
    assert "starting every node of the cluster" in text and all(
        f"local-{n} (command line" in text for n in NODES), result.output[-4000:]
    assert all(pids[n] != p for n, p in pids_of(deployment).items())
    coordinator = argv_of(deployment, "coordinator")
    assert flag(coordinator, "--pp-auto") == "2" and "--distributed-config" not in coordinator
    assert flag(coordinator, "--cluster-peers") == ",".join(
        f"{HOSTS[n]}:{deployment.cluster_port}" for n in ("stage-0", "stage-1"))
    assert flag(coordinator, "--cluster-control-addr") == f"{HOSTS['coordinator']}:{deployment.cluster_port}"
    assert flag(coordinator, "--threads") == "1"
    generated = (deployment.home("coordinator") / "cluster.toml").read_text()
    assert generated.startswith("# Cluster TOML planned by an mlxcel"), generated[:300]
    for i, node in enumerate(("stage-0", "stage-1")):
        argv = argv_of(deployment, node)
        assert "--pp-peer" in argv and "--distributed-config" not in argv
        assert flag(argv, "--threads") == layer_threads(2)
        assert flag(argv, "--cluster-control-addr") == f"{HOSTS[node]}:{deployment.cluster_port}"
        assert not (deployment.home(node) / "cluster.toml").exists()  # the rendered TOML is gone
        received = deployment.home(node) / f"cluster-stage-{i}.toml"  # what the peer was assigned
        config = load_cluster_config(received)
        assert [(s.id, str(s.address), s.layers) for s in config.stages] == [
            ("stage-0", f"{HOSTS['stage-0']}:{deployment.cluster_port}", (0, 2)),
            ("stage-1", f"{HOSTS['stage-1']}:{deployment.cluster_port}", (2, 4))]
        assert received.read_text().split("\n\n", 1)[1] == generated.split("\n\n", 1)[1]  # one body
    assert "local-stage-0 is stage-0 (layers 0-1)" in text and "local-stage-1 is stage-1 (layers 2-3)" in text
    assert "answer: " in result.output
    ANSWERS["pp_auto"] = greedy_answer(deployment.url)
    assert ANSWERS["pp_auto"] == ANSWERS["toml"]
    print(f"switch to pp_auto: {result.seconds:.1f} s")


def _pp_auto(deployment: Deployment) -> None:
    _deployed(deployment)
    if "pp_auto" not in ANSWERS:
        pytest.skip("the pp_auto bring-up did not come up (see test_pp_auto_bringup_assigns_the_stages...)")


def test_pp_auto_status_shows_the_stage_each_peer_was_assigned(deployment: Deployment) -> None:
    _pp_auto(deployment)
    result = deployment.run("status.yml", **PP_AUTO)
    assert result.rc == 0, result.output[-4000:]
    text = " ".join(result.output.split())
    for node, layers in (("stage-0", "0-1"), ("stage-1", "2-3")):
        pid = (deployment.home(node) / "node.pid").read_text().strip()
        row = rf"\b{node} +stage +{pid} .* 200 ready +{node} layers {layers}\b"
        assert re.search(row, text), result.output[-3000:]
    assert re.search(r"\bcoordinator +coordinator +\d+ .* 200 ready +- ", text), result.output[-3000:]


def test_pp_auto_a_dead_peer_is_reassigned_by_itself(deployment: Deployment) -> None:
    """A killed peer, restarted by its supervisor, is given its stage again by the running coordinator. (That a
    redeploy then changes nothing is the spare test's last run: a peer re-assigned after its start, a node the
    supervisor restarted in test_redeploy_changes_nothing; one deploy.yml run fewer.)"""
    _pp_auto(deployment)
    pids = pids_of(deployment)
    os.kill(int(pids["stage-1"]), signal.SIGKILL)  # a crash: its supervisor restarts it, as a peer waiting for an offer
    killed = time.monotonic()
    health = f"http://{HOSTS['stage-1']}:{deployment.http_port}/health"
    while _health(health).get("node_id") != "stage-1" or pids_of(deployment)["stage-1"] == pids["stage-1"]:
        assert time.monotonic() - killed < 60, _health(health)  # the coordinator re-assigns the restarted peer
        time.sleep(0.2)
    while (cluster := _health(f"{deployment.url}/health")).get("status") != "ready":
        assert time.monotonic() - killed < 60, cluster  # and uses it once it answers as stage-1
        time.sleep(0.2)
    serving = time.monotonic() - killed
    assert cluster.get("reassigned") == {"stage-1": 1}
    now = pids_of(deployment)
    assert (now["coordinator"], now["stage-0"]) == (pids["coordinator"], pids["stage-0"])  # nothing else restarted
    assert greedy_answer(deployment.url) == ANSWERS["toml"]
    print(f"pp_auto peer kill -> serving again: {serving:.1f} s")


def _health(url: str) -> dict:
    """The JSON body of a /health answer (any status); {} when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return json.loads(reply.read() or b"{}")
    except urllib.error.HTTPError as err:
        return json.loads(err.read() or b"{}")
    except (OSError, ValueError):
        return {}


def _kill_node(deployment: Deployment, node: str) -> None:
    """A host lost: its supervisor, its server and its warm standby, all with SIGKILL (nothing restarts it)."""
    home = f"{deployment.home(node)}/"
    for pid in deployment.pids():
        if home in open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace"):
            os.kill(pid, signal.SIGKILL)


def test_pp_auto_a_spare_stands_by_takes_a_lost_stage_over_and_the_old_stage_host_returns_as_a_spare(
        deployment: Deployment) -> None:
    inventory = SPARES["inventory"] = spare_inventory(deployment)
    spare, stage = f"{SPARE_ADDRESS}:{deployment.cluster_port}", f"{HOSTS['stage-1']}:{deployment.cluster_port}"
    result = deployment.run("deploy.yml", inventory=inventory, mlxcel_bringup_spare_after_s=2, **PP_AUTO)
    assert result.rc == 0, result.output[-4000:]
    text = " ".join(result.output.split())
    assert "local-spare-0 stands by as a spare" in text and "local-stage-1 is stage-1 (layers 2-3)" in text, text[-3000:]
    coordinator = argv_of(deployment, "coordinator")
    assert flag(coordinator, "--pp-auto") == "2" and flag(coordinator, "--pp-spare") == "1"
    assert flag(coordinator, "--cluster-peers").endswith(f",{spare}") and flag(coordinator, "--pp-spare-after") == "2"
    assert "--pp-peer" in argv_of(deployment, "spare-0")
    assert _health(f"http://{SPARE_ADDRESS}:{deployment.http_port}/health")["status"] == "standby"
    pids = pids_of(deployment, SPARE_NODES)  # status.yml's standby row is checked once, after the swap below

    _kill_node(deployment, "stage-1")  # the host is lost: the spare takes stage-1 over after 2 s
    lost = time.monotonic()
    while (cluster := _health(f"{deployment.url}/health")).get("status") != "ready" \
            or [s.get("address") for s in cluster.get("stages", [])][1:] != [spare]:
        assert time.monotonic() - lost < 90, cluster
        time.sleep(0.5)
    print(f"pp_auto stage host lost -> the spare serves its stage: {time.monotonic() - lost:.1f} s")
    assert {"address": stage, "state": "replaced"}.items() <= cluster["spares"][1].items(), cluster
    answer = greedy_answer(deployment.url)

    result = deployment.run("deploy.yml", inventory=inventory, mlxcel_bringup_spare_after_s=2, **PP_AUTO)
    assert result.rc == 0, result.output[-4000:]
    text = " ".join(result.output.split())
    assert "local-stage-1 starts again as a spare (not running;" in text and "starting every node" not in text, text[-3000:]
    assert "local-stage-1 stands by as a spare" in text and "local-spare-0 is stage-1 (layers 2-3)" in text, text[-3000:]
    now = pids_of(deployment, SPARE_NODES)
    assert [now[n] for n in ("coordinator", "stage-0", "spare-0")] == [pids[n] for n in ("coordinator", "stage-0", "spare-0")]
    # only the host in the spare position changed: the others (the spare that now serves stage-1 included) are as they were
    assert {h: r["changed"] for h, r in result.recap().items() if h != "local-stage-1"} == \
        {"local-coordinator": 0, "local-stage-0": 0, "local-spare-0": 0}, result.output[-4000:]
    assert {"address": stage, "state": "standby"} in _health(f"{deployment.url}/health")["spares"]
    assert greedy_answer(deployment.url) == answer

    status = deployment.run("status.yml", inventory=inventory, **PP_AUTO)  # a standby is healthy: nothing restarts
    assert status.rc == 0 and pids_of(deployment, SPARE_NODES) == now, status.output[-4000:]
    text = " ".join(status.output.split())
    assert re.search(rf"\bstage-1 +spare +{now['stage-1'].strip()} .* 503 standby +standby \(healthy\)", text), text[-3000:]
    assert re.search(rf"\bspare-0 +stage +{now['spare-0'].strip()} .* 200 ready +stage-1 layers 2-3\b", text), text[-3000:]
    # the start phase again: nothing restarts with the old stage host standing by (the phases before it were
    # re-run by the swap's redeploy above, which changed nothing on the hosts it left alone)
    assert_redeploy_changes_nothing(deployment, "--tags", "start", nodes=SPARE_NODES, inventory=inventory,
                                    mlxcel_bringup_spare_after_s=2, **PP_AUTO)


def test_teardown_leaves_no_process(deployment: Deployment) -> None:
    assert deployment.pids(), "nothing to tear down: the deployment never started"
    # after the spare test: its inventory, whose group "spares" needs mlxcel_bringup pp_auto
    nodes, inventory, more = (SPARE_NODES, SPARES["inventory"], PP_AUTO) if SPARES else (NODES, "inventory", {})
    assert len(_supervisors(deployment)) == len(nodes)  # one supervisor per node, stopped with it
    result = deployment.run("teardown.yml", inventory=inventory, **more)
    assert result.rc == 0, result.output[-4000:]
    assert deployment.pids() == []
    assert not any((deployment.home(n) / "node.pid").exists() for n in nodes)
    again = deployment.run("teardown.yml", inventory=inventory, **more)  # what is already gone is fine
    assert again.rc == 0 and all(r["changed"] == 0 for r in again.recap().values()), again.output[-3000:]
    assert os.path.isdir(deployment.home("coordinator"))
