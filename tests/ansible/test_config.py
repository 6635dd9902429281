"""The config and checkpoint roles without starting anything: deploy.yml --tags, --check, other inventories."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from mlxcel.config import DEFAULT_PREFIX_CACHE_MB
from mlxcel.models.random_checkpoint import make_random_checkpoint
from mlxcel.topology.cluster_config import load_cluster_config
from mlxcel.topology.partition import PartitionError, parse_layer_ranges
from tests.ansible.playbook import HOSTS, REPO, SPARE_ADDRESS, Deployment, spare_inventory

pytestmark = [pytest.mark.timeout(300), pytest.mark.proc]


def _inventory(path: Path, host_vars: dict[str, dict]) -> str:
    """The loopback inventory as one file, with extra variables per host (node id -> vars)."""
    hosts = {f"local-{n}": {"ansible_host": a, "mlxcel_node_id": n, **host_vars.get(n, {})} for n, a in HOSTS.items()}
    inventory = {"mlxcel_cluster": {
        "vars": {"ansible_connection": "local", "ansible_python_interpreter": "{{ ansible_playbook_python }}",
                 "mlxcel_home": "{{ mlxcel_state_root }}/{{ mlxcel_node_id }}", "mlxcel_install_method": "reuse",
                 "mlxcel_venv": str(REPO / ".venv"), "mlxcel_node_supervisor": "pidfile"},
        "children": {"coordinator": {"hosts": {"local-coordinator": hosts["local-coordinator"]}},
                     "stages": {"hosts": {h: v for h, v in hosts.items() if h != "local-coordinator"}}}}}
    path.write_text(json.dumps(inventory))  # JSON is YAML
    return str(path)


def test_check_mode_changes_nothing(deployment: Deployment, tmp_path: Path) -> None:
    fresh = Deployment(root=tmp_path, model=deployment.model, http_port=deployment.http_port,
                       cluster_port=deployment.cluster_port)
    # the phases that change a fresh host (start and smoke have nothing to check before they ran)
    result = fresh.run("deploy.yml", "--check", "--tags", "install,secret,checkpoint,config",
                       mlxcel_model_dir=str(deployment.model))
    assert result.rc == 0, result.output[-4000:]
    assert not (fresh.controller / "cluster.secret").exists()
    assert not any(fresh.home(n).exists() for n in HOSTS)


def test_checkpoint_copied_where_missing_different_one_fails_naming_the_host_explicit_layers(
        deployment: Deployment, tmp_path: Path) -> None:
    other = make_random_checkpoint(tmp_path / "other", family="llama", layers=2)
    missing = tmp_path / "stage-0-models" / "tiny"
    inventory = _inventory(tmp_path / "hosts.yml", {
        "coordinator": {"mlxcel_model_dir": str(deployment.model)},
        "stage-0": {"mlxcel_model_dir": str(missing), "mlxcel_config_layers": "0-2"},
        "stage-1": {"mlxcel_model_dir": str(other), "mlxcel_config_layers": "3"}})
    result = deployment.run("deploy.yml", "--tags", "checkpoint,config", inventory=inventory)
    assert result.rc != 0
    failed = {h for h, r in result.recap().items() if r["failed"]}
    assert failed == {"local-stage-1"}, result.output[-4000:]
    assert f"local-stage-1: {other} holds a different checkpoint" in result.output.replace("\n", " ")
    # stage-0 lacked it: it got a copy, with the controller's identity
    assert sorted(p.name for p in missing.iterdir()) == sorted(p.name for p in deployment.model.iterdir())
    # the others went on to render their TOML, with the explicit ranges instead of mlxcel plan's; a last range of
    # one index ("3"), which the engine accepts, passes the preflight and is held as the engine wrote it (the
    # refused form "N-" is test_preflight_refuses_a_layer_range_the_engine_refuses)
    assert _engine_accepts("0-2,3", 4)
    config = load_cluster_config(deployment.home("stage-0") / "cluster.toml")
    assert [s.layers for s in config.stages] == [(0, 3), (3, 4)]
    # no optional [pipeline] key set: none rendered (the engine's defaults; the keys set are in the next test)
    texts = [(deployment.home(n) / "cluster.toml").read_text() for n in ("coordinator", "stage-0")]
    assert not any("prefix_cache_mb" in t or "kv_bits" in t for t in texts), texts
    assert config.prefix_cache_mb == DEFAULT_PREFIX_CACHE_MB


def _engine_accepts(layers: str, num_layers: int) -> bool:
    try:
        parse_layer_ranges(layers, num_layers)
    except PartitionError:
        return False
    return True


def test_preflight_refuses_a_layer_range_the_engine_refuses(deployment: Deployment, tmp_path: Path) -> None:
    """"7-" (the engine refuses it) fails the preflight with the engine's reason; the accepted form of one index is
    in the checkpoint test above, whose run renders it."""
    model = make_random_checkpoint(tmp_path / "eight", family="llama", layers=8)
    inventory = _inventory(tmp_path / "hosts.yml", {
        "coordinator": {"mlxcel_model_dir": str(model)},
        "stage-0": {"mlxcel_model_dir": str(model), "mlxcel_config_layers": "0-6"},
        "stage-1": {"mlxcel_model_dir": str(model), "mlxcel_config_layers": "7-"}})
    result = deployment.run("deploy.yml", "--tags", "install,config", inventory=inventory,
                            mlxcel_model_source=str(model))
    assert not _engine_accepts("0-6,7-", 8)
    assert result.rc != 0, result.output[-4000:]
    text = " ".join(result.output.split())
    assert "the stages' mlxcel_config_layers (local-stage-0: '0-6', local-stage-1: '7-') are refused by the " \
           "engine: --layers: stage 1: '7-' is not a layer range" in text, result.output[-4000:]


def test_prefix_cache_mb_and_kv_bits_are_rendered_only_when_set_and_bounded(deployment: Deployment) -> None:
    """Optional [pipeline] keys: rendered for every stage when set (0 = prefix cache off, still rendered),
    out-of-range kv bits refused by the preflight (absent when unset: the checkpoint test above, whose run renders
    them unset)."""
    homes = [deployment.home(n) for n in HOSTS]
    result = deployment.run("deploy.yml", "--tags", "install,config", mlxcel_config_prefix_cache_mb=0,
                            mlxcel_config_kv_bits=4, mlxcel_config_kv_group_size=32)
    assert result.rc == 0, result.output[-4000:]
    configs = [load_cluster_config(h / "cluster.toml") for h in homes]
    assert all(c.prefix_cache_mb == 0 for c in configs)
    assert {(c.kv_bits, c.kv_group_size) for c in configs} == {(4, 32)}
    result = deployment.run("deploy.yml", "--tags", "install,config", mlxcel_config_kv_bits=3)
    assert result.rc != 0 and "mlxcel_config_kv_bits 4 or 8 (got '3')" in " ".join(result.output.split())


def test_pp_auto_refuses_settings_only_a_rendered_toml_carries(deployment: Deployment) -> None:
    result = deployment.run("deploy.yml", "--tags", "install,config", mlxcel_bringup="pp_auto",
                            mlxcel_config_prefix_cache_mb=64, mlxcel_config_startup_s=30)
    assert result.rc != 0
    text = " ".join(result.output.split())
    assert ("mlxcel_bringup pp_auto renders no cluster TOML (the --pp-auto coordinator plans the stages and writes "
            "it), so mlxcel_config_prefix_cache_mb, mlxcel_config_startup_s cannot apply") in text, result.output[-3000:]


def _commands(deployment: Deployment, nodes: object, *args: str, **more: object) -> dict[str, list[str]]:
    """Each node's command line as ``mlxcel node show`` builds it from the node TOML that render_units.yml wrote,
    checked equal to the one the role's old Jinja vars built (tests/ansible/legacy_argv.yml)."""
    result = deployment.run("tests/ansible/render_units.yml", *args, **more)
    assert result.rc == 0, result.output[-4000:]
    commands = {}
    for node in nodes:
        home = deployment.home(node)
        shown = json.loads((home / "node-show.json").read_text())
        legacy = json.loads((home / "legacy-argv.json").read_text())
        assert shown["command"] == legacy, f"{node}: the engine built {shown['command']}, the old vars {legacy}"
        assert shown["match"] == f"--host {_flag(legacy, '--host')} --port {_flag(legacy, '--port')}", shown
        assert "command" not in tomllib.loads((home / "node.toml").read_text())  # plain fields under [server]
        commands[node] = shown["command"]
    return commands


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


# every optional flag of the command line, so that _commands compares each with the old vars' argv
OPTIONS = {"toml": {"mlxcel_api_key_enabled": True, "mlxcel_tls_enabled": True, "mlxcel_cluster_name": "demo",
                    "mlxcel_node_tls_cert_src": "/controller/tls.crt", "mlxcel_node_tls_key_src": "/controller/tls.key",
                    "mlxcel_node_server_args": ["--parallel", "8"]},
           "pp_auto": {"mlxcel_cluster_name": "demo", "mlxcel_config_micro_batch_size": 4,
                       "mlxcel_api_key_enabled": True}}
FRONT_FLAGS = {"toml": ["--distributed-config", "--api-key-file", "--ssl-certfile", "--ssl-keyfile", "--parallel"],
               "pp_auto": ["--pp-auto", "--cluster-peers", "--pp-micro-batch-size", "--cluster-name", "--api-key-file"]}


# the hosts on two machines: the coordinator shares stage-0's but holds no layers, so stage-0 keeps every core
MACHINES = {"coordinator": "m0", "stage-0": "m0", "stage-1": "m1"}


@pytest.fixture(scope="module")
def toml_units(deployment: Deployment) -> dict[str, list[str]]:
    """One render_units.yml run for two tests: the rendered-TOML bring-up under systemd, each optional flag on,
    the hosts on MACHINES; its units stay in the homes until the next render (the systemd test reads them first)."""
    return _commands(deployment, HOSTS, mlxcel_bringup="toml", mlxcel_node_supervisor="systemd",
                     mlxcel_test_machines=MACHINES, **OPTIONS["toml"])


@pytest.mark.parametrize("bringup", ["toml", "pp_auto"])
def test_systemd_unit_restarts_every_failure_but_a_usage_error(request: pytest.FixtureRequest, deployment: Deployment,
                                                               bringup: str) -> None:
    """Also: every node's command line, each optional flag on, is the old vars' (_commands), and so is ExecStart."""
    commands = request.getfixturevalue("toml_units") if bringup == "toml" else _commands(
        deployment, HOSTS, mlxcel_bringup=bringup, mlxcel_node_supervisor="systemd", **OPTIONS[bringup])
    assert all(flag in commands["coordinator"] for flag in FRONT_FLAGS[bringup]), commands["coordinator"]
    for node in HOSTS:
        unit = deployment.home(node) / f"mlxcel-{node}.service"
        text = unit.read_text()
        exec_start = next(line for line in text.splitlines() if line.startswith("ExecStart="))
        assert "Restart=on-failure" in text
        # only a usage error (exit 2) is final; exit 1 restarts, up to the crash-loop limit (the engine's defaults)
        assert "RestartPreventExitStatus=2\n" in text and "RestartPreventExitStatus=1" not in text, text
        assert "RestartSec=0.5\n" in text and "StartLimitBurst=6\n" in text and "StartLimitIntervalSec=50\n" in text
        flag = {"toml": "--distributed-config", "pp_auto": "--pp-auto 2" if node == "coordinator" else "--pp-peer"}
        assert f" {flag[bringup]} " in exec_start, exec_start
        legacy = json.loads((deployment.home(node) / "legacy-argv.json").read_text())
        assert exec_start == "ExecStart=" + shlex.join(legacy), exec_start  # the old vars' command line
        if shutil.which("systemd-analyze"):  # works offline: it parses the unit and checks ExecStart's binary
            verify = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True,
                                    text=True, timeout=60)
            assert verify.returncode == 0 and str(unit) not in verify.stderr, verify.stderr


def _threads(command: list[str]) -> str | None:
    return command[command.index("--threads") + 1] if "--threads" in command else None


@pytest.mark.parametrize("case", ["machines", "integer", "null"])
def test_thread_budget_splits_a_machine_between_the_nodes_that_hold_layers(request: pytest.FixtureRequest,
                                                                          deployment: Deployment, case: str) -> None:
    """auto: a stage gets max(1, nproc // the stages on its machine), the coordinator 1 (the same machine for all three
    is in test_deploy.py; the hosts on MACHINES here, in the systemd test's run); an integer goes to every node (here
    of a disaggregated cluster); null leaves the flag out (here on single-node servers). Every command line equals
    the old vars' (_commands)."""
    nproc = len(os.sched_getaffinity(0))
    more: dict = {
        # on the disaggregated example (its command lines compared with the old vars' too)
        "integer": {"mlxcel_node_threads": 3, "inventory": DISAGG_EXAMPLE},
        # on single-node servers (mlxcel_node_pipeline false: no cluster flags at all)
        "null": {"mlxcel_node_threads": None, "mlxcel_node_pipeline": False}}.get(case, {})
    nodes = DISAGG_NODES if case == "integer" else HOSTS
    commands = request.getfixturevalue("toml_units") if case == "machines" else _commands(deployment, nodes, **more)
    want = {"machines": {"coordinator": "1", "stage-0": str(nproc), "stage-1": str(nproc)},
            "integer": dict.fromkeys(DISAGG_NODES, "3"), "null": dict.fromkeys(HOSTS)}[case]
    assert {n: _threads(c) for n, c in commands.items()} == want, commands
    if case == "null":
        assert not [a for c in commands.values() for a in c if a.startswith(("--cluster", "--distributed"))], commands


def test_thread_budget_refuses_what_is_not_auto_a_positive_integer_or_null(deployment: Deployment) -> None:
    result = deployment.run("tests/ansible/render_units.yml", mlxcel_node_threads="half")
    assert result.rc != 0
    assert "mlxcel_node_threads auto, a positive integer or null (got 'half')" in " ".join(result.output.split())


DISAGG_EXAMPLE = "examples/disagg/inventory"
DISAGG_NODES = {"router": ("router", "127.0.0.11"), "prefill-0": ("prefill", "127.0.0.12"),
                "decode-0": ("decode", "127.0.0.13"), "decode-1": ("decode", "127.0.0.14")}


def test_disagg_example_renders_the_toml_the_engine_loads(deployment: Deployment) -> None:
    result = deployment.run("deploy.yml", "--tags", "install,secret,config", inventory=DISAGG_EXAMPLE)
    assert result.rc == 0, result.output[-4000:]
    for node in DISAGG_NODES:
        config = load_cluster_config(deployment.home(node) / "cluster.toml")
        assert config.coordinator is None and not config.stages
        assert [(n.id, n.role, str(n.address)) for n in config.disagg] == [
            (n, role, f"{address}:{deployment.cluster_port}") for n, (role, address) in DISAGG_NODES.items()]
        assert config.secret_file == deployment.home(node) / "cluster.secret"
        assert (deployment.home(node) / "cluster.secret").exists()
        # the example turns the API key on: only the router, which serves the OpenAI API, gets it
        assert (deployment.home(node) / "api.key").exists() == (node == "router")


@pytest.mark.parametrize("topology", ["pipeline", "disagg"])
def test_topology_preflight_names_the_groups_it_needs(deployment: Deployment, topology: str) -> None:
    """Each topology on the other's inventory: refused before anything runs, naming the groups."""
    inventory = {"pipeline": DISAGG_EXAMPLE, "disagg": "inventory"}[topology]
    result = deployment.run("deploy.yml", "--tags", "install", inventory=inventory, mlxcel_topology=topology)
    assert result.rc != 0
    text = " ".join(result.output.split())
    want = {"pipeline": "the inventory needs exactly one host in group 'coordinator' and at least one in 'stages'",
            "disagg": "mlxcel_topology disagg needs at least one host in each of the groups 'router', 'prefill' and "
                      "'decode'"}[topology]
    assert want in text, result.output[-3000:]


def test_disagg_refuses_settings_only_a_pipeline_has(deployment: Deployment) -> None:
    result = deployment.run("deploy.yml", "--tags", "install,config", inventory=DISAGG_EXAMPLE,
                            mlxcel_config_prefix_cache_mb=64, mlxcel_config_startup_s=30)
    assert result.rc != 0
    text = " ".join(result.output.split())
    assert ("mlxcel_topology disagg has no stages, layer ranges or [pipeline] settings (every prefill and decode node "
            "holds the whole model), so mlxcel_config_prefix_cache_mb, mlxcel_config_startup_s cannot apply") in text, \
        result.output[-3000:]


def test_pp_auto_spares_render_on_the_coordinators_command_line(deployment: Deployment) -> None:
    """A host in the group "spares": a --pp-peer like the stage hosts; the coordinator lists it after the stages and
    gets --pp-spare 1 and --pp-spare-after; spares count in the thread budget like stages."""
    result = deployment.run("tests/ansible/render_units.yml", inventory=spare_inventory(deployment),
                            mlxcel_bringup="pp_auto", mlxcel_bringup_spare_after_s=3)
    assert result.rc == 0, result.output[-4000:]
    shown = {n: json.loads((deployment.home(n) / "node-show.json").read_text())["command"]
             for n in (*HOSTS, "spare-0")}
    peers = [f"{HOSTS[n]}:{deployment.cluster_port}" for n in ("stage-0", "stage-1")]
    coordinator = shown["coordinator"]
    assert _flag(coordinator, "--pp-auto") == "2" and _flag(coordinator, "--pp-spare") == "1"
    assert _flag(coordinator, "--cluster-peers") == ",".join([*peers, f"{SPARE_ADDRESS}:{deployment.cluster_port}"])
    assert _flag(coordinator, "--pp-spare-after") == "3"
    cluster = tomllib.loads((deployment.home("coordinator") / "node.toml").read_text())["server"]["cluster"]
    assert cluster["spares"] == [f"{SPARE_ADDRESS}:{deployment.cluster_port}"] and cluster["spare_after_s"] == 3
    for node in ("stage-0", "stage-1", "spare-0"):
        assert "--pp-peer" in shown[node] and "--pp-spare" not in shown[node]
        assert _flag(shown[node], "--threads") == str(max(1, len(os.sched_getaffinity(0)) // 3))


@pytest.mark.parametrize("case, more, want", [
    ("toml", {}, "hosts in 'spares' (['local-spare-0']) need mlxcel_bringup pp_auto"),
    ("after", {"mlxcel_bringup": "pp_auto", "mlxcel_bringup_spare_after_s": 0},
     "mlxcel_bringup_spare_after_s (got 0) needs spares and a value above 0 and at most 3600 seconds"),
    ("order", {"mlxcel_bringup": "pp_auto"}, "so every address of the group 'spares' (127.0.0.10:"),
])
def test_pp_auto_spares_preflight_refuses_with_the_reason(deployment: Deployment, case: str, more: dict,
                                                          want: str) -> None:
    """Spares without pp_auto, a spare_after_s out of bounds, and a spare the coordinator would make a stage (its
    address sorts before a stage's: "127.0.0.10:P" < "127.0.0.3:P") are refused before anything runs."""
    inventory = spare_inventory(deployment, "127.0.0.10" if case == "order" else SPARE_ADDRESS, name=f"inv-{case}")
    result = deployment.run("deploy.yml", "--tags", "install", inventory=inventory, **more)
    assert result.rc != 0
    assert want in " ".join(result.output.split()), result.output[-3000:]
