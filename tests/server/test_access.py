"""API keys on the OpenAI port: key sources, the Bearer check over real HTTP, /metrics, logs, the bind policy."""

from __future__ import annotations

import logging
import os
import pickle
import re
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from mlxcel.server import access
from mlxcel.server.access import (
    AccessError,
    APIKeys,
    bearer_token,
    check_bind_policy,
    is_loopback,
    load_api_keys,
)
from tests.ports import free_ports
from tests.server.util import CLI, MODEL, chat_body, stop_process

pytestmark = [pytest.mark.timeout(120), pytest.mark.proc]
KEY = "sk-mlxcel-test-3f9a1c0d5e7b2a4468"
SECOND_KEY = "sk-mlxcel-second-9d0e1f2a3b4c5d6e"
WRONG_KEY = "sk-mlxcel-wrong-77aa88bb99cc00dd"
NO_KEY_ENV = {access.ENV_KEY_FILE: None, access.ENV_KEY: None}
_URL = re.compile(r"serving \S+ on (https?://[\d.]+:\d+)")
_STAGE_URL = re.compile(r"health on (https?://[\d.]+:\d+)/health")


class LoggedServer:
    """A server subprocess keeping stdout and stderr both (uvicorn's access log goes to stdout)."""

    def __init__(self, model: Path, *flags: str, env: dict | None = None, url: re.Pattern = _URL):
        self._url_pattern = url
        cmd = [*CLI, "serve", "-m", str(model), "--port", "0", "--served-model-name", MODEL, *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env or clean_env())
        self.lines: list[str] = []
        self.url = ""
        self._listening = threading.Event()
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        if not self._listening.wait(60) or not self.url:
            self.stop()
            raise RuntimeError("server did not start:\n" + self.log)

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            m = self._url_pattern.search(line)
            if m and not self.url:
                self.url = m.group(1)
                self._listening.set()
        self._listening.set()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, client: httpx.Client, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if client.get(f"{self.url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError("server not ready:\n" + self.log)

    def stop(self) -> int:
        """SIGINT, wait, and read the rest of the output."""
        stop_process(self.proc)
        self._reader.join(10)
        return self.proc.returncode


def key_file(tmp_path: Path, *lines: str, mode: int = 0o600) -> Path:
    path = tmp_path / "api.keys"
    path.write_text("\n".join(lines) + "\n")
    path.chmod(mode)
    return path


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in NO_KEY_ENV}
    return {**env, **extra}


# --- key sources --------------------------------------------------------------------------------------


def test_key_file_one_key_per_line_skipping_blanks_and_comments(tmp_path):
    keys = load_api_keys(key_file(tmp_path, "# operators", KEY, "", "   ", f"  {SECOND_KEY}  ", "# old: x"), env={})
    assert keys.count == 2
    assert keys.matches(KEY.encode()) and keys.matches(SECOND_KEY.encode())
    assert not keys.matches(b"# operators") and not keys.matches(b"")


def test_precedence_flag_then_file_env_then_value_env(tmp_path):
    flag = key_file(tmp_path, KEY)
    env_file = tmp_path / "env.keys"
    env_file.write_text(SECOND_KEY)
    env_file.chmod(0o600)
    assert load_api_keys(flag, env={access.ENV_KEY_FILE: str(env_file)}).matches(KEY.encode())
    from_file = load_api_keys(None, env={access.ENV_KEY_FILE: str(env_file)})
    assert from_file.matches(SECOND_KEY.encode()) and not from_file.matches(KEY.encode())
    from_value = load_api_keys(None, env={access.ENV_KEY: WRONG_KEY})
    assert from_value.matches(WRONG_KEY.encode()) and from_value.source == access.ENV_KEY
    assert load_api_keys(None, env={}) is None


def test_both_environment_variables_is_an_error(tmp_path):
    with pytest.raises(AccessError, match="both MLXCEL_API_KEY_FILE and MLXCEL_API_KEY are set"):
        load_api_keys(key_file(tmp_path, KEY), env={access.ENV_KEY_FILE: "x", access.ENV_KEY: KEY})


@pytest.mark.parametrize("lines, expected", [
    (("# only a comment", ""), "no API key in"),
    ((f"{KEY} trailing",), "line 1 of .*printable ASCII without spaces"),
    (("# c", f"{KEY}\x01"), "line 2 of"),
])
def test_bad_key_files_fail_without_showing_the_key(tmp_path, lines, expected):
    with pytest.raises(AccessError, match=expected) as info:
        load_api_keys(key_file(tmp_path, *lines), env={})
    assert KEY not in str(info.value) and "\n" not in str(info.value)


def test_missing_or_empty_sources_name_themselves(tmp_path):
    with pytest.raises(AccessError, match=r"cannot read the API key file .*nope \(from --api-key-file\)"):
        load_api_keys(tmp_path / "nope", env={})
    with pytest.raises(AccessError, match="MLXCEL_API_KEY_FILE is set but empty"):
        load_api_keys(None, env={access.ENV_KEY_FILE: ""})
    with pytest.raises(AccessError, match="no API key in MLXCEL_API_KEY"):
        load_api_keys(None, env={access.ENV_KEY: "  "})


def test_group_readable_key_file_warns(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="mlxcel.server.access"):
        load_api_keys(key_file(tmp_path, KEY, mode=0o640), env={})
    assert "group- or world-readable (mode 0640)" in caplog.text and KEY not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mlxcel.server.access"):
        load_api_keys(key_file(tmp_path, KEY, mode=0o600), env={})
    assert caplog.text == ""


def test_keys_never_show_in_repr_str_format_or_pickle(tmp_path):
    keys = load_api_keys(key_file(tmp_path, KEY), env={})
    for text in (repr(keys), str(keys), f"{keys}", f"{keys!r:>80}", repr(access.AccessConfig(keys=keys))):
        assert KEY not in text and "redacted" in text
    with pytest.raises(TypeError):
        pickle.dumps(keys)


def test_every_key_matches_and_nothing_else():
    keys = APIKeys([KEY, SECOND_KEY], "test")
    assert keys.matches(KEY.encode()) and keys.matches(SECOND_KEY.encode())
    for near in (KEY[:-1], KEY + "x", KEY.upper(), "", KEY + SECOND_KEY):
        assert not keys.matches(near.encode())


@pytest.mark.parametrize("value, token, reason", [
    (f"Bearer {KEY}", KEY, access._WRONG),
    (f"bearer   {KEY} ", KEY, access._WRONG),
    (f"Basic {KEY}", None, access._NOT_BEARER),
    (KEY, None, access._NOT_BEARER),
    ("Bearer ", None, access._NOT_BEARER),
])
def test_bearer_token_parsing(value, token, reason):
    got, why = bearer_token([(b"x-api-key", b"other"), (b"Authorization", value.encode())])
    assert got == (token.encode() if token else None) and why == reason
    assert bearer_token([(b"x-api-key", KEY.encode())]) == (None, access._MISSING)
    got, why = bearer_token([(b"x-api-key", b"other"), (b"Authorization", value.encode())], x_api_key=True)
    assert got == (token.encode() if token else None) and why == reason  # Authorization wins on Anthropic's routes


def test_x_api_key_counts_only_on_anthropic_routes():
    assert bearer_token([(b"X-Api-Key", b" k1 ")], x_api_key=True) == (b"k1", access._WRONG)
    assert bearer_token([(b"x-api-key", b"")], x_api_key=True) == (None, access._MISSING_ANTHROPIC)
    assert bearer_token([], x_api_key=True) == (None, access._MISSING_ANTHROPIC)


# --- bind policy -------------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost", "LOCALHOST.",
                                  "::ffff:127.0.0.1"])
def test_loopback_hosts(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "192.168.1.10", "10.0.0.1", "fe80::1",
                                  "::ffff:192.168.1.10", "no-such-host.invalid"])
def test_non_loopback_hosts(host):
    assert not is_loopback(host)


def test_non_loopback_without_key_is_refused_naming_every_source():
    with pytest.raises(AccessError) as info:
        check_bind_policy("0.0.0.0", None, allow_unauthenticated=False)
    message = str(info.value)
    assert "refusing to listen on 0.0.0.0 without an API key" in message and "\n" not in message
    for source in ("--api-key-file", "MLXCEL_API_KEY_FILE", "MLXCEL_API_KEY=", "--allow-unauthenticated"):
        assert source in message


def test_key_or_opt_out_or_loopback_passes_and_the_opt_out_warns(caplog):
    check_bind_policy("0.0.0.0", APIKeys([KEY], "test"), allow_unauthenticated=False)
    check_bind_policy("127.0.0.1", None, allow_unauthenticated=False)
    check_bind_policy("0.0.0.0", None, allow_unauthenticated=True)
    with caplog.at_level(logging.WARNING, logger="mlxcel.server.access"):
        access.log_access(access.AccessConfig(allow_unauthenticated=True), "0.0.0.0")
    assert "serving without an API key on 0.0.0.0 (--allow-unauthenticated)" in caplog.text


def run_serve(model: Path, *flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "serve", "-m", str(model), "--port", "0", *flags], capture_output=True,
                          text=True, timeout=60, env=env or clean_env())


def test_cli_refuses_wildcard_without_key_before_binding(tiny_llama):
    """The other wildcard (::) and LAN addresses go through the same check (tests above)."""
    host = "0.0.0.0"
    r = run_serve(tiny_llama, "--host", host)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mlxcel: error: refusing to listen on {host} without an API key")
    assert "MLXCEL_API_KEY_FILE=<PATH>" in lines[0] and "serving" not in r.stderr


def test_cli_rejects_both_key_env_vars(tiny_llama, tmp_path):
    r = run_serve(tiny_llama, env=clean_env(MLXCEL_API_KEY_FILE=str(key_file(tmp_path, KEY)), MLXCEL_API_KEY=KEY))
    assert r.returncode == 1
    assert r.stderr.strip() == ("mlxcel: error: both MLXCEL_API_KEY_FILE and MLXCEL_API_KEY are set; "
                                "set only one of them")


# --- a real server with keys ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(tiny_llama, tmp_path_factory):
    """Two keys from --api-key-file; debug logs (access log included) kept."""
    path = key_file(tmp_path_factory.mktemp("keys"), "# test keys", KEY, SECOND_KEY)
    server = LoggedServer(tiny_llama, "--api-key-file", str(path), "--log-level", "debug")
    try:
        with httpx.Client(timeout=10) as c:
            server.wait_ready(c)
        yield server
    finally:
        server.stop()


def assert_unauthorized(r: httpx.Response) -> None:
    assert r.status_code == 401
    assert r.headers["www-authenticate"].startswith("Bearer")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert error["param"] is None
    assert KEY not in r.text and WRONG_KEY not in r.text


def test_openai_client_with_the_key_chat_completion_and_stream(keyed):
    for key in (KEY, SECOND_KEY):
        oa = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=key, max_retries=0)
        reply = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           extra_body={"ignore_eos": True})  # the random model may sample EOS first
        assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens >= 1
    chunks = list(oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=4, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert oa.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                 extra_body={"ignore_eos": True}).usage.completion_tokens >= 1
    assert [m.id for m in oa.models.list()] == [MODEL]


def test_openai_client_with_a_wrong_key_gets_authentication_error(keyed):
    oa = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=WRONG_KEY, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        list(oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=2, stream=True))


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": f"Bearer {WRONG_KEY}"},
    {"Authorization": f"Bearer {KEY[:-1]}"},
    {"X-API-Key": KEY},
    {"api-key": KEY},
    {"Authorization": f"Basic {KEY}"},
    {"Authorization": KEY},
    {"Authorization": "Bearer"},
], ids=["none", "wrong", "truncated", "x-api-key", "api-key", "basic", "no-scheme", "empty-bearer"])
def test_missing_wrong_or_misplaced_key_is_401(keyed, headers):
    with httpx.Client(base_url=keyed.url, timeout=30, headers=headers) as c:
        assert_unauthorized(c.get("/v1/models"))
        assert_unauthorized(c.post("/v1/chat/completions", json=chat_body(max_tokens=2)))
        assert_unauthorized(c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True}))
        assert_unauthorized(c.get("/v1/no-such-endpoint"))


def test_health_is_open(keyed):
    r = httpx.get(f"{keyed.url}/health", timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "ready"}


def test_metrics_needs_the_key_and_never_shows_it(keyed):
    assert_unauthorized(httpx.get(f"{keyed.url}/metrics", timeout=10))
    httpx.get(f"{keyed.url}/v1/models", headers={"Authorization": f"Bearer {WRONG_KEY}"}, timeout=10)
    r = httpx.get(f"{keyed.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 200 and "mlxcel_requests_total" in r.text
    assert 'endpoint="/v1/models",status="401"' in r.text  # rejections are counted
    for secret in (KEY, SECOND_KEY, WRONG_KEY):
        assert secret not in r.text


def test_key_never_in_logs_or_process_listing(keyed):
    """Run last in this module: stops the server to collect all of its stderr (debug level, access log on)."""
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {WRONG_KEY}"}, {"X-API-Key": KEY}):
        httpx.post(f"{keyed.url}/v1/chat/completions", json=chat_body(max_tokens=2), headers=headers, timeout=30)
    cmdline = Path(f"/proc/{keyed.proc.pid}/cmdline").read_bytes().decode()
    assert keyed.stop() == 0
    log = keyed.log
    assert '"POST /v1/chat/completions HTTP/1.1" 401' in log and '"POST /v1/chat/completions HTTP/1.1" 200' in log
    assert "DEBUG" in log and "API key required for every endpoint but /health (2 key(s) from --api-key-file" in log
    for secret in (KEY, SECOND_KEY, WRONG_KEY):
        assert secret not in log and secret not in cmdline


# --- the other sources and switches, on real servers ---------------------------------------------------


def test_env_key_with_public_metrics(start_server, tiny_llama, monkeypatch):
    monkeypatch.delenv(access.ENV_KEY_FILE, raising=False)
    server = start_server(tiny_llama, "--metrics-public", env={access.ENV_KEY: KEY})
    try:
        r = httpx.get(f"{server.url}/metrics", timeout=10)
        assert r.status_code == 200 and KEY not in r.text
        assert_unauthorized(httpx.get(f"{server.url}/v1/models", timeout=10))
        ok = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert ok.status_code == 200
    finally:
        assert server.stop() == 0
    assert KEY not in "".join(server.lines)


def test_allow_unauthenticated_starts_open_and_warns(start_server, tiny_llama, monkeypatch):
    """Bound to loopback only; the policy itself is checked with 0.0.0.0 above."""
    for name in NO_KEY_ENV:
        monkeypatch.delenv(name, raising=False)
    server = start_server(tiny_llama, "--host", "127.0.0.1", "--allow-unauthenticated")
    try:
        assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 200
        assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 200
    finally:
        server.stop()
    assert any("WARNING" in line and "serving without an API key on 127.0.0.1 (--allow-unauthenticated)" in line
               for line in server.lines)


def test_prepare_access_applies_the_policy_unless_the_port_serves_only_health(tmp_path):
    flags = access.AccessFlags()
    with pytest.raises(AccessError, match="refusing to listen on 0.0.0.0"):
        access.prepare_access(flags, "0.0.0.0", env={})
    stage = access.prepare_access(flags, "0.0.0.0", env={}, health_only=True)
    assert stage.keys is None and stage.scheme == "http" and stage.uvicorn_options() == {}
    flags = access.AccessFlags(api_key_file=str(key_file(tmp_path, KEY)), metrics_public=True)
    keyed = access.prepare_access(flags, "0.0.0.0", env={})
    assert keyed.keys.matches(KEY.encode()) and keyed.open_paths() == {"/health", "/metrics"}


# --- the pipeline coordinator: same entry point, same app, same flags ------------------------------------


def write_cluster(directory: Path) -> Path:
    secret = directory / "cluster.secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    nodes = zip(("coordinator", "stage-0", "stage-1"), ("coordinator", "stage", "stage"), free_ports(3))
    toml = '[cluster]\npipeline_parallel_size = 2\nsecret_file = "cluster.secret"\n' + "".join(
        f'\n[[nodes]]\nid = "{i}"\nrole = "{r}"\naddress = "127.0.0.1:{p}"\n' for i, r, p in nodes)
    path = directory / "cluster.toml"
    path.write_text(toml)
    return path


def test_coordinator_refuses_wildcard_without_key(tiny_llama, tmp_path):
    toml = write_cluster(tmp_path)
    r = run_serve(tiny_llama, "--distributed-config", str(toml), "--node-id", "coordinator", "--host", "0.0.0.0")
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "mlxcel: error: " + access.REFUSE_MESSAGE.format(host="0.0.0.0")]


def test_pipeline_coordinator_requires_the_key(tiny_llama, tmp_path):
    """Two stages (health-only ports, no key) and a coordinator with --api-key-file, all on loopback."""
    toml = write_cluster(tmp_path)
    cluster = ["--distributed-config", str(toml)]
    servers = []
    try:
        for stage in ("stage-0", "stage-1"):
            servers.append(LoggedServer(tiny_llama, *cluster, "--node-id", stage, url=_STAGE_URL))
        coordinator = LoggedServer(tiny_llama, *cluster, "--node-id", "coordinator",
                                   "--api-key-file", str(key_file(tmp_path, KEY)))
        servers.append(coordinator)
        assert "as coordinator of 2 pipeline stages" in coordinator.log
        with httpx.Client(timeout=30) as c:
            coordinator.wait_ready(c)
            for stage in servers[:2]:
                assert c.get(f"{stage.url}/health").status_code == 200
            assert_unauthorized(c.get(f"{coordinator.url}/v1/models"))
            assert_unauthorized(c.get(f"{coordinator.url}/metrics"))
            assert_unauthorized(c.get(f"{coordinator.url}/v1/models", headers={"Authorization": f"Bearer {WRONG_KEY}"}))
        oa = openai.OpenAI(base_url=f"{coordinator.url}/v1", api_key=KEY, max_retries=0)
        chunks = list(oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, stream=True))
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    finally:
        for server in reversed(servers):
            server.stop()
    assert all(KEY not in server.log for server in servers)
