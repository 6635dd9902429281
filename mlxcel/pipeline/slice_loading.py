"""A stage's slice of the checkpoint, loaded without reading the other layers' weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable


def load_stage_runner(model_dir: Path, start: int, end: int, *, max_rows: int,
                      prepare: Callable[[Any], None] | None = None) -> tuple[Any, Any]:
    """The stage's layers only: the checkpoint loads lazily and only this slice's weights are evaluated,
    so the other layers are never read from disk (MLX loads an array's data when it is first evaluated).
    ``prepare`` sees the model before its slice is cut (--kv-bits: ``ServerConfig.apply_kv_bits``)."""
    import mlx.core as mx

    from mlxcel.engine.executor import slice_runner
    from mlxcel.engine.model_slice import family_of, lm_head, text_model
    from mlxcel.engine.slice_rule import embedding, embedding_name
    from mlxcel.models.loading import load_checkpoint

    loaded = load_checkpoint(model_dir, lazy=True, tokenizer=False)
    model = loaded.model
    if prepare is not None:
        prepare(model)
    runner = slice_runner(model, start, end, max_rows=max_rows)
    inner = text_model(model)  # a wrapper's language_model.model: weights language_model.model.layers.N...
    keep = [layer.parameters() for layer in inner.layers[start:end]]
    last = end == len(inner.layers)
    head = lm_head(model)
    embedded = (embedding_name(model), *family_of(model).embed_modules)  # what the first stage's embedding reads
    if start == 0:
        keep.extend(params for name, params in inner.parameters().items() if name in embedded)
    elif last and head is None:  # a tied head reuses the embedding
        keep.append(embedding(model).parameters())
    if last:  # the final norm, and whatever else the text model applies after its layers (kimi_k3's output
        # attention-residual mix): every part of it but the layers and the embedding
        keep.extend(params for name, params in inner.parameters().items() if name not in ("layers", *embedded))
        if head is not None:
            keep.append(head.parameters())
    mx.eval(keep)  # on this thread: a lazily loaded array evaluated first on another thread has no stream there
    return runner, loaded

