"""Layer counts are read the way mlx-lm reads them: every config.json field its families use (issue 40).

A longcat_flash checkpoint names its layers ``num_layers``; mlxcel used to refuse it even on one device
("config.json names no layer count"), though mlx-lm runs it.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from mlxcel.models.errors import ModelError
from mlxcel.models.identity import LAYER_COUNT_KEYS, layer_count, model_identity
from tests.cli_in_process import run_mlxcel

# a tiny longcat_flash (mlx-lm 0.32's ModelArgs): MLA attention, 4 routed experts + 2 zero experts, 3 layers
LONGCAT = {"model_type": "longcat_flash", "attention_method": "MLA", "zero_expert_type": "identity",
           "hidden_size": 64, "ffn_hidden_size": 128, "moe_topk": 2, "expert_ffn_hidden_size": 32,
           "n_routed_experts": 4, "zero_expert_num": 2, "num_layers": 3, "vocab_size": 320,
           "max_position_embeddings": 2048, "num_attention_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 32,
           "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "routed_scaling_factor": 1.0,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "mla_scale_q_lora": True, "mla_scale_kv_lora": True,
           "attention_bias": False, "eos_token_id": 2}


@pytest.fixture(scope="module")
def longcat(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    """A random-weight longcat_flash checkpoint built with mlx-lm's own classes, tiny_llama's tokenizer."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    out = tmp_path_factory.mktemp("longcat")
    model_cls, args_cls = _get_classes(LONGCAT)
    mx.random.seed(0)
    weights = dict(tree_flatten(model_cls(args_cls.from_dict(LONGCAT)).parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(LONGCAT))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama / name, out / name)
    return out


@pytest.mark.parametrize("key", LAYER_COUNT_KEYS)
def test_each_key_names_the_count_at_the_top_and_in_text_config(key):
    assert layer_count({key: 7}) == 7
    assert layer_count({"text_config": {key: 5}}) == 5


def test_no_count_is_an_error_naming_every_key():
    for config in ({}, {"num_layers": 0}, {"num_hidden_layers": True}, {"n_layer": "12"}, {"text_config": []}):
        with pytest.raises(ModelError, match="names no layer count") as err:
            layer_count(config)
        assert all(key in str(err.value) for key in LAYER_COUNT_KEYS)


def test_every_mlx_lm_family_builds_its_layers_from_a_known_key():
    """mlx-lm's models build their layer list over ``range(args.<key>)``: a family that an mlx-lm upgrade
    brings with a new key fails here until ``LAYER_COUNT_KEYS`` has it."""
    import mlx_lm.models

    pattern = re.compile(r"for \w+ in range\(\s*(?:args|config|self\.args)\.(\w+)\s*[)\-]")
    layer_list = re.compile(r"self\.(?:layers|h|blocks|transformer_layers)\s*=\s*\[")
    seen: dict[str, str] = {}
    for path in sorted(Path(mlx_lm.models.__file__).parent.glob("*.py")):
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            if layer_list.search(line):
                window = " ".join(lines[number:number + 4])
                for key in pattern.findall(window)[:1]:
                    seen[path.stem] = key
    assert len(seen) > 50  # the scan still finds the families (mlx-lm 0.32: about 90)
    unknown = {family: key for family, key in seen.items() if key not in LAYER_COUNT_KEYS}
    assert not unknown, f"mlx-lm families count their layers under keys mlxcel does not read: {unknown}"
    assert seen.get("longcat_flash") == "num_layers"


def test_a_longcat_flash_checkpoint_has_an_identity_info_and_a_plan(longcat):
    assert len(model_identity(longcat)) == 64
    info = run_mlxcel("models", "info", str(longcat))
    assert info.returncode == 0, info.stderr
    assert re.search(r"^layers:\s+3$", info.stdout, re.M)
    plan = run_mlxcel("plan", "-m", str(longcat), "--pp-size", "2", "--json")
    assert plan.returncode == 0, plan.stderr
    plan_rows = json.loads(plan.stdout)
    assert plan_rows["num_layers"] == 3
    assert plan_rows["stages"][0]["start"] == 0 and plan_rows["stages"][-1]["end"] == 3


def test_a_longcat_flash_checkpoint_generates_on_one_device_as_mlx_lm_does(longcat):
    from mlx_lm import generate, load

    model, tokenizer = load(str(longcat))
    expected = generate(model, tokenizer, "hello", max_tokens=4)
    result = run_mlxcel("generate", "-m", str(longcat), "--raw", "-p", "hello", "-n", "4", "--temp", "0")
    assert result.returncode == 0, result.stderr
    assert "(longcat_flash, 3 layers)" in result.stderr.splitlines()[0]
    assert "decode: 4 tokens" in result.stderr
    assert result.stdout.rstrip("\n") == expected
