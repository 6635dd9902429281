"""Shared fixtures: tiny random checkpoints (fast) and the converted default model (slow)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import mlxcel  # noqa: F401  (first, so MLX picks up OpenBLAS: see mlxcel/blas.py)

REPO = Path(__file__).resolve().parent.parent
pytest_plugins = ["tests.proc_marker"]

DEFAULT_MODEL = Path(os.environ.get("MLXCEL_DEFAULT_MODEL", REPO / "models" / "smollm2-135m-instruct"))


@pytest.fixture(autouse=True)
def fresh_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts from the environment as it is (mlxcel/envs.py caches it), and a ``monkeypatch.setenv`` or
    ``delenv`` inside a test drops the cache, as a fresh process would read the changed environment."""
    from mlxcel import envs

    envs.reload()
    for name in ("setenv", "delenv"):
        original = getattr(monkeypatch, name)

        def changed(*args, _original=original, **kwargs) -> None:
            _original(*args, **kwargs)
            envs.reload()

        setattr(monkeypatch, name, changed)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    return make_random_checkpoint(tmp_path_factory.mktemp("tiny-llama"), family="llama", layers=4)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    return make_random_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"), family="qwen3", layers=4)


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The converted SmolLM2 checkpoint; tests that need it skip when it has not been fetched."""
    if not (DEFAULT_MODEL / "config.json").exists():
        pytest.skip(f"default model not found at {DEFAULT_MODEL} (run: mlxcel models fetch-default)")
    return DEFAULT_MODEL
