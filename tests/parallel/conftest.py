"""Tiny checkpoints whose shapes shard over 3 ranks but not 2 (and the other way round)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_6_3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama, 6 heads / 3 KV heads / intermediate 96: shards over 3 ranks, refused at 2 (KV heads)."""
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    return make_random_checkpoint(tmp_path_factory.mktemp("tiny-6-3"), family="llama", layers=3, hidden=48,
                                  heads=6, kv_heads=3, intermediate=96)
