"""Model identity changes with config.json bytes, weight file names/sizes and layer count, nothing else."""

import json
import shutil

import pytest

from mlxcel.models.errors import ModelError
from mlxcel.models.identity import model_identity


@pytest.fixture
def ckpt(tmp_path, tiny_llama):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, dst)
    return dst


def test_identity_is_stable_and_path_independent(ckpt, tiny_llama):
    assert model_identity(ckpt) == model_identity(tiny_llama)
    assert len(model_identity(ckpt)) == 64


def test_config_bytes_matter(ckpt):
    before = model_identity(ckpt)
    (ckpt / "config.json").write_text((ckpt / "config.json").read_text() + " ")
    assert model_identity(ckpt) != before


def test_weight_file_names_and_sizes_matter(ckpt):
    before = model_identity(ckpt)
    (ckpt / "model.safetensors").rename(ckpt / "model-00001.safetensors")
    renamed = model_identity(ckpt)
    assert renamed != before
    with open(ckpt / "model-00001.safetensors", "ab") as fh:
        fh.write(b"\0")
    assert model_identity(ckpt) != renamed


def test_layer_count_matters(ckpt):
    before = model_identity(ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (ckpt / "config.json").write_text(json.dumps(config, indent=2))
    assert model_identity(ckpt) != before


def test_tokenizer_files_do_not_matter(ckpt):
    before = model_identity(ckpt)
    (ckpt / "tokenizer_config.json").write_text("{}")
    assert model_identity(ckpt) == before


def test_errors(tmp_path):
    with pytest.raises(ModelError, match="no such model directory"):
        model_identity(tmp_path / "missing")
    with pytest.raises(ModelError, match="no config.json"):
        model_identity(tmp_path)
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2}')
    with pytest.raises(ModelError, match="no \\*.safetensors"):
        model_identity(tmp_path)
