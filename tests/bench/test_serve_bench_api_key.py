"""bench/serve_bench.py against a keyed single-node server on loopback: the key file (flag or
MLXCEL_API_KEY_FILE) lets it through, without it the run stops naming the 401, and the key never
shows in its output or rows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from bench import serve_bench
from tests.server.util import ServerProcess

pytestmark = [pytest.mark.timeout(180), pytest.mark.proc]
REPO = Path(__file__).resolve().parents[2]
KEY = "sk-bench-test-5b1e0c7d9a2f4e6b8c3d"
QUICK = ["--concurrency", "1", "--requests", "1", "--max-tokens", "4", "--ignore-eos", "--rounds", "1"]


def key_file(directory: Path, *lines: str) -> Path:
    path = directory / "api.key"
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def keyed_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(tiny_llama, "--host", "127.0.0.1",
                           "--api-key-file", str(key_file(tmp_path_factory.mktemp("key"), KEY)))
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def run_bench(url: str, out: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != serve_bench.ENV_KEY_FILE}
    return subprocess.run([sys.executable, "-m", "bench.serve_bench", "--url", url, "--out", str(out), *QUICK, *flags],
                          capture_output=True, text=True, cwd=REPO, env={**base, **(env or {})}, timeout=120)


def test_the_key_file_lets_the_bench_through(keyed_server, tmp_path):
    keys = key_file(tmp_path, "# the deployment's key", "", KEY)
    result = run_bench(keyed_server.url, tmp_path / "rows", "--api-key-file", str(keys))
    assert result.returncode == 0, result.stderr
    assert "round 1/1" in result.stderr and "err=0" in result.stderr
    rows = (tmp_path / "rows" / "serve_bench.jsonl").read_text()
    assert '"errors": 0' in rows
    for text in (result.stdout, result.stderr, rows, *(p.read_text() for p in (tmp_path / "rows").glob("*.csv"))):
        assert KEY not in text


def test_the_environment_names_the_key_file_too(keyed_server, tmp_path):
    keys = key_file(tmp_path, KEY)
    result = run_bench(keyed_server.url, tmp_path / "rows", env={serve_bench.ENV_KEY_FILE: str(keys)})
    assert result.returncode == 0, result.stderr
    assert KEY not in result.stdout + result.stderr


def test_without_a_key_the_run_stops_naming_the_401(keyed_server, tmp_path):
    result = run_bench(keyed_server.url, tmp_path / "rows")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"serve_bench: {keyed_server.url} answered 401 Unauthorized: the server needs an API key "
        f"(--api-key-file FILE or {serve_bench.ENV_KEY_FILE})")
    assert not (tmp_path / "rows").exists()  # nothing measured, nothing written


def test_a_wrong_key_is_refused_without_showing_it(keyed_server, tmp_path):
    wrong = "sk-bench-wrong-0f0f0f0f0f0f0f0f"
    result = run_bench(keyed_server.url, tmp_path / "rows", "--model-name", "tiny",
                       "--api-key-file", str(key_file(tmp_path, wrong)))
    assert result.returncode == 1
    assert "answered 401 Unauthorized: the server refused the API key" in result.stderr
    assert wrong not in result.stdout + result.stderr


def test_key_file_errors_name_the_file_not_the_key(tmp_path):
    assert serve_bench.read_api_key(None, env={}) is None
    assert serve_bench.read_api_key(str(key_file(tmp_path, "# c", f"  {KEY}  ", "sk-second")), env={}) == KEY
    with pytest.raises(SystemExit, match=r"cannot read the API key file .*nope \(from --api-key-file\)"):
        serve_bench.read_api_key(str(tmp_path / "nope"), env={})
    with pytest.raises(SystemExit, match=rf"no API key in .*api.key \(from {serve_bench.ENV_KEY_FILE}\)"):
        serve_bench.read_api_key(None, env={serve_bench.ENV_KEY_FILE: str(key_file(tmp_path, "# only a comment"))})
    args = serve_bench.parse_args(["--api-key-file", str(key_file(tmp_path, KEY))])
    assert dict(args.headers) == {"Authorization": f"Bearer {KEY}"}
    assert KEY not in repr(args) and KEY not in str(args.headers)
