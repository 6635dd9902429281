"""``mlxcel models info``: what a checkpoint is, in a few lines."""

from __future__ import annotations

from pathlib import Path

from mlxcel.models.identity import layer_count, model_identity
from mlxcel.models.loading import check_checkpoint


def describe_checkpoint(model_dir: str | Path) -> str:
    path = Path(model_dir)
    config = check_checkpoint(path)
    files = sorted(path.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    quant = config.get("quantization")
    weights = f"{quant.get('bits')}-bit, group {quant.get('group_size')}" if quant else "unquantized"
    lines = [
        f"path:        {path}",
        f"family:      {config.get('model_type')}",
        f"layers:      {layer_count(config)}",
        f"hidden size: {config.get('hidden_size')}",
        f"vocab size:  {config.get('vocab_size')}",
        f"weights:     {weights}; {len(files)} file(s), {size / 1e6:.1f} MB",
        f"identity:    {model_identity(path)}",
    ]
    return "\n".join(lines)
