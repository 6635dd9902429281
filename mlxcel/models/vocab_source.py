"""Where this process's model finds its vocabulary for a grammar (mlxcel.engine.grammar): registered at load."""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_sources: dict[int | None, Any] = {}  # logits width -> a TokenizerWrapper or a checkpoint directory


def register(source: Any, vocab_size: int | None) -> None:
    """An mlx-lm ``TokenizerWrapper`` or the checkpoint directory (read only once a grammar comes) of the model
    with ``vocab_size`` logits; the last one registered is the default."""
    with _lock:
        _sources[vocab_size] = source
        _sources[None] = source


def source_of(vocab_size: int | None) -> Any:
    """The registered source for ``vocab_size`` (else the default; None when nothing is registered)."""
    with _lock:
        return _sources.get(vocab_size, _sources.get(None))
