"""Model identity: one SHA-256 that every surface uses to tell checkpoints apart.

The digest covers the bytes of config.json, the name and size of every
*.safetensors file (sorted by name) and the layer count. Two hosts that
compute the same identity hold the same model for every purpose mlxcel has:
pipeline stages, zero-config assignment and disaggregated handoff.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from mlxcel.models.errors import ModelError

IDENTITY_VERSION = b"mlxcel-model-identity-v1"


#: the config.json fields that mlx-lm's families read their layer count from (``ModelArgs`` of
#: mlx_lm/models/*.py: most say num_hidden_layers; longcat_flash, exaone, afm7 and phixtral num_layers; dbrx
#: and olmo n_layers; gpt2, gptj and gpt_bigcode n_layer; openelm num_transformer_layers), in the order tried
LAYER_COUNT_KEYS = ("num_hidden_layers", "num_layers", "n_layers", "n_layer", "num_transformer_layers")


def layer_count(config: dict) -> int:
    """The number of transformer layers named by a config (its text_config for multimodal ones),
    under whichever of ``LAYER_COUNT_KEYS`` the family uses."""
    nested = config.get("text_config")
    for source in (config, nested if isinstance(nested, dict) else {}):
        for key in LAYER_COUNT_KEYS:
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    raise ModelError(f"config.json names no layer count (none of {', '.join(LAYER_COUNT_KEYS)}, "
                     "at its top level or in text_config, is a positive integer)")


def read_config(model_dir: Path) -> tuple[bytes, dict]:
    """Raw bytes and parsed contents of a checkpoint's config.json."""
    path = Path(model_dir) / "config.json"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ModelError(f"{model_dir}: not a checkpoint (no config.json)") from None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(config, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return raw, config


def model_identity(model_dir: str | Path) -> str:
    """Hex SHA-256 over config.json, the names and sizes of the weights files, and the layer count."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelError(f"{model_dir}: no such model directory")
    raw, config = read_config(model_dir)
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        raise ModelError(f"{model_dir}: not a checkpoint (no *.safetensors files)")
    digest = hashlib.sha256(IDENTITY_VERSION)
    digest.update(len(raw).to_bytes(8, "big") + raw)
    for path in weights:
        name = path.name.encode()
        digest.update(len(name).to_bytes(2, "big") + name + path.stat().st_size.to_bytes(8, "big"))
    digest.update(layer_count(config).to_bytes(4, "big"))
    return digest.hexdigest()
