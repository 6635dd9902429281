"""Fixtures for model tests: tiny GGUFs and, where obtainable, the default model's GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxcel.models.errors import ModelError


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The real SmolLM2 GGUF from the installed package or mlxcel's cache, else skip.

    No download here (it could wait minutes on a network timeout); `mlxcel models
    fetch-default` fills the cache.
    """
    from mlxcel.models.default_model import locate_default_gguf

    try:
        return locate_default_gguf(download=False, progress=lambda _line: None)
    except ModelError as exc:
        pytest.skip(f"default GGUF not available (run: mlxcel models fetch-default): {exc}")
