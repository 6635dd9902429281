"""Facts about a checkpoint that every role reads without loading weights: shapes, identity, context window."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "n_ctx", "seq_length")
DEFAULT_CONTEXT = 4096


@dataclass(frozen=True)
class ModelFacts:
    """What a stage and the coordinator compare: identity and the shapes that bound tensors."""

    identity: str
    num_layers: int
    hidden_size: int
    vocab_size: int


def model_facts(model_dir: Path) -> ModelFacts:
    """The checkpoint's identity and shapes, from config.json and the weight files' names and sizes."""
    from mlxcel.models.identity import layer_count, model_identity, read_config

    _, config = read_config(model_dir)
    text = config.get("text_config") or config
    return ModelFacts(identity=model_identity(model_dir), num_layers=layer_count(config),
                      hidden_size=int(text["hidden_size"]), vocab_size=int(text["vocab_size"]))


def context_length(config: dict) -> int:
    """The checkpoint's context window, from the first config key that names one."""
    for key in CONTEXT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_CONTEXT
