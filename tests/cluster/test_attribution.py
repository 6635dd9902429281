"""The attribution-only unprotected mode (mlxcel/cluster/attribution.py): bench code in-process only,
refused by every role, reachable from no flag, environment variable or TOML key."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel.cluster import attribution
from mlxcel.cluster.attribution import AttributionOnly, AttributionRefused, attribution_only
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.cluster.transport import Transport
from mlxcel.cluster.wire import Kind, Suite
from mlxcel.entrypoints import ROLES
from tests.cluster.conftest import wait_until

REPO = Path(__file__).resolve().parents[2]
SECRET = ClusterSecret(b"attribution-tests-0123456789abcdef", source="test")
ROUTE_WORDS = re.compile(r"attribution|unprotect|suite|unseal|frame.?protect|no.?encrypt|null.?aead", re.I)


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts in a process that neither serves a role nor was handed a token."""
    monkeypatch.setattr(attribution, "_state", attribution._State())


def test_bench_token_gives_unsealed_frames_over_an_authenticated_handshake() -> None:
    token = attribution_only("test")
    options = attribution.transport_options(token, who="test")
    assert options.suite is Suite.UNPROTECTED
    got: list[bytes] = []
    with Transport("127.0.0.1:0", SECRET, options) as server, Transport("127.0.0.1:0", SECRET, options) as client:
        addr = server.serve(lambda m: got.append(bytes(m.payload)))
        client.send(addr, Kind.CONTROL, b"in the clear")
        assert wait_until(lambda: got == [b"in the clear"])
        assert client.connection(addr).sealer.suite is Suite.UNPROTECTED
    # a protected peer does not talk to it: the handshake refuses the suite mismatch
    with Transport("127.0.0.1:0", SECRET, options) as plain, Transport("127.0.0.1:0", SECRET) as sealed:
        addr = sealed.serve(lambda m: None)
        with pytest.raises(Exception, match="suite"):
            plain.send(addr, Kind.CONTROL, b"x")


def test_no_token_means_the_default_protected_options() -> None:
    assert attribution.transport_options(None, who="test").suite is Suite.AES_256_GCM


def test_a_forged_token_is_refused() -> None:
    with pytest.raises(AttributionRefused, match="attribution_only"):
        attribution.transport_options(AttributionOnly("forged"), who="stage stage-0")
    with pytest.raises(TypeError, match="AttributionOnly"):
        attribution.transport_options(Suite.UNPROTECTED, who="stage stage-0")  # type: ignore[arg-type]


@pytest.mark.parametrize("role", list(ROLES))
def test_every_role_refuses_to_start_in_a_process_holding_the_token(role: str, monkeypatch: pytest.MonkeyPatch) -> None:
    attribution_only("bench")
    started: list[str] = []
    monkeypatch.setattr(type(ROLES[role]), "_hooks", lambda self: started.append(self.name))
    with pytest.raises(AttributionRefused, match=f"role {role} refuses to start"):
        ROLES[role].run(None)  # type: ignore[arg-type]
    assert started == [] and attribution.serving_role() is None  # nothing started, nothing changed


@pytest.mark.parametrize("role", list(ROLES))
def test_a_serving_process_refuses_the_token_and_unprotected_transports(role: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(type(ROLES[role]), "_hooks", lambda self: type("Hooks", (), {"run": staticmethod(lambda c: 0)}))
    assert ROLES[role].run(None) == 0  # type: ignore[arg-type]
    assert attribution.serving_role() == role
    with pytest.raises(AttributionRefused, match=f"serves role {role}"):
        attribution_only("bench")
    for suite in (Suite.UNPROTECTED, Suite.HMAC_SHA256, Suite.CHACHA20_POLY1305):
        with pytest.raises(AttributionRefused, match="AES-256-GCM"):
            Transport("127.0.0.1:0", SECRET, suite=suite)
    Transport("127.0.0.1:0", SECRET).close()  # the protected default still builds


def test_pipeline_members_refuse_a_token_in_a_serving_process(tiny_llama: Path) -> None:
    """StageService and PipelineExecutor, given what the bench passes, in a process that serves a role."""
    from mlxcel.models.facts import model_facts
    from mlxcel.pipeline.coordinator import PipelineExecutor
    from mlxcel.pipeline.stage import StageService
    from tests.pipeline.members import cluster_config

    token = attribution_only("bench")
    attribution._state.serving = "stage"  # as if a role had started after the token was handed out
    config = cluster_config("127.0.0.2:1", ["127.0.0.3:2", "127.0.0.4:3"], exchange_s=5)
    facts = model_facts(tiny_llama)
    with pytest.raises(AttributionRefused, match="serves role stage"):
        StageService(config, "stage-0", None, SECRET, facts, _attribution=token)  # type: ignore[arg-type]
    with pytest.raises(AttributionRefused, match="serves role stage"):
        PipelineExecutor(config, SECRET, facts, max_batch_size=2, _attribution=token)


@pytest.mark.proc
def test_the_cli_path_refuses_in_a_process_holding_the_token(tiny_llama: Path) -> None:
    """``mlxcel serve`` (the real start path, single role) in a process where bench code took a token."""
    code = ("import sys; from mlxcel.cluster.attribution import attribution_only; attribution_only('bench'); "
            "from mlxcel.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "serve", "-m", str(tiny_llama), "--host", "127.0.0.1",
                           "--port", "0", "--no-warmup"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode != 0
    assert "role single refuses to start" in proc.stderr


# -- no route from configuration ------------------------------------------------------------------


def test_no_serve_flag_names_a_route() -> None:
    from mlxcel.cli import build_parser

    parser = build_parser()
    options = [s for sub in _subparsers(parser) for a in sub._actions for s in a.option_strings]
    assert options and not [o for o in options if ROUTE_WORDS.search(o)]


def _subparsers(parser):  # type: ignore[no-untyped-def]
    import argparse

    out = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += _subparsers(sub)
    return out


def test_no_toml_key_names_a_route(tmp_path: Path) -> None:
    from mlxcel.topology import cluster_config as cc

    keys = cc._TOP_KEYS | cc._CLUSTER_KEYS | cc._PIPELINE_KEYS | cc._TIMEOUT_KEYS | cc._NODE_KEYS
    assert not [k for k in keys if ROUTE_WORDS.search(k)]
    toml = tmp_path / "c.toml"
    for table in ("cluster", "pipeline"):
        toml.write_text(f'[{table}]\nsuite = "unprotected"\n\n[[nodes]]\nid = "c"\nrole = "coordinator"\n'
                        'address = "127.0.0.1:1"\n\n[[nodes]]\nid = "s"\nrole = "stage"\naddress = "127.0.0.1:2"\n')
        with pytest.raises(cc.ClusterConfigError, match="unknown key"):
            cc.load_cluster_config(toml)


def test_only_bench_code_reaches_the_token() -> None:
    """In mlxcel/ nothing calls attribution_only or passes _attribution; no module but the frame code and this
    one names the unprotected suite; the module reads no environment."""
    calls, suites = [], []
    for path in sorted((REPO / "mlxcel").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", ""))
                if name == "attribution_only" or any(k.arg == "_attribution" for k in node.keywords):
                    calls.append(rel)
            if isinstance(node, ast.Attribute) and node.attr == "UNPROTECTED":
                suites.append(rel)
    assert calls == []
    assert set(suites) <= {"mlxcel/cluster/wire.py", "mlxcel/cluster/frames.py", "mlxcel/cluster/attribution.py"}
    source = (REPO / "mlxcel/cluster/attribution.py").read_text()
    assert "os.environ" not in source and "getenv" not in source and "import os" not in source
    bench_callers = [str(p.relative_to(REPO)) for p in (REPO / "bench").rglob("*.py") if "attribution_only(" in p.read_text()]
    assert bench_callers == ["bench/protection_bench.py"]
