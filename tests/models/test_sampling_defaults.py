"""Checkpoint-recommended sampling: read from generation_config.json, recorded for the default model."""

import json
import shutil

from mlxcel.models.default_model import RECOMMENDED_SAMPLING, add_recommended_sampling
from mlxcel.models.loading import load_checkpoint, read_sampling_defaults


def test_reads_only_numeric_sampling_keys(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.3, "top_p": "0.9", "top_k": 40, "do_sample": True, "eos_token_id": 2}))
    assert read_sampling_defaults(tmp_path) == {"temperature": 0.3, "top_k": 40}


def test_missing_or_broken_config_gives_no_defaults(tmp_path):
    assert read_sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert read_sampling_defaults(tmp_path) == {}


def test_recommended_sampling_is_added_once_and_keeps_other_fields(tmp_path, tiny_llama):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.5}))
    add_recommended_sampling(ckpt)
    config = json.loads((ckpt / "generation_config.json").read_text())
    assert config["eos_token_id"] == 2
    assert config["temperature"] == 0.5  # an explicit value is kept
    assert config["top_p"] == RECOMMENDED_SAMPLING["top_p"]
    assert load_checkpoint(ckpt).sampling_defaults() == {"temperature": 0.5, "top_p": RECOMMENDED_SAMPLING["top_p"]}


def test_an_earlier_mlxcel_recommendation_is_replaced(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "top_p": 0.9, "eos_token_id": 2}))
    add_recommended_sampling(tmp_path)
    config = json.loads((tmp_path / "generation_config.json").read_text())
    assert {k: config[k] for k in RECOMMENDED_SAMPLING} == RECOMMENDED_SAMPLING
    assert config["eos_token_id"] == 2


def test_user_values_are_kept(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.95}))
    add_recommended_sampling(tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"temperature": 0.7, "top_p": 0.95}
