"""load_checkpoint: with its tokenizer, and the model alone (pipeline stages and TP followers never see text)."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from mlxcel.models.errors import ModelError
from mlxcel.models.loading import load_checkpoint


def test_the_model_alone_has_no_tokenizer_and_the_same_logits(tiny_llama: Path) -> None:
    whole, alone = load_checkpoint(tiny_llama), load_checkpoint(tiny_llama, lazy=True, tokenizer=False)
    assert whole.tokenizer is not None and alone.tokenizer is None
    assert alone.config == whole.config and alone.num_layers == whole.num_layers
    tokens = mx.array([[1, 5, 9, 2]])
    assert mx.array_equal(alone.model(tokens), whole.model(tokens)).item()


def test_the_model_alone_never_builds_the_tokenizer(tiny_llama: Path, tmp_path: Path) -> None:
    """A tokenizer.json that cannot be parsed fails the whole load by name, and not the model-only one."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    (broken / "tokenizer.json").write_text("{not json")
    assert load_checkpoint(broken, tokenizer=False).tokenizer is None
    with pytest.raises(ModelError, match=r"broken: cannot load checkpoint"):
        load_checkpoint(broken)
