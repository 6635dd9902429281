"""``mlxcel models make-random`` --dtype and --head-dim: a quantized bfloat16 checkpoint stores bfloat16
scales and biases and computes in bfloat16 once loaded; the default stays float32."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from mlxcel.cli import main
from mlxcel.models.loading import load_checkpoint
from mlxcel.models.random_checkpoint import make_random_checkpoint

# Qwen3-0.6B's proportions, shrunk: head_dim is not hidden / heads (1024 / 16 = 64, head_dim 128)
SHAPE = ["--family", "qwen3", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
         "--head-dim", "32", "--intermediate", "96"]


def _float_dtypes(path: Path) -> dict[str, set]:
    """dtypes of the stored tensors, by kind: quantization scales/biases and other float weights."""
    out: dict[str, set] = {"scales": set(), "biases": set(), "float": set()}
    for name, value in mx.load(str(path / "model.safetensors")).items():
        kind = name.rsplit(".", 1)[-1]
        out[kind if kind in ("scales", "biases") else "float"].add(value.dtype)
    out["float"].discard(mx.uint32)  # packed quantized weights
    return out


def _activations(path: Path) -> tuple[mx.Dtype, mx.Dtype, mx.Dtype]:
    """Embedding output, first attention projection output and logits of a 3-token forward."""
    model = load_checkpoint(path).model
    x = mx.array([[1, 2, 3]])
    hidden = model.model.embed_tokens(x)
    q = model.model.layers[0].self_attn.q_proj(hidden)
    return hidden.dtype, q.dtype, model(x).dtype


def test_bfloat16_4bit_stores_bf16_scales_and_computes_in_bf16(tmp_path: Path, capsys) -> None:
    out = tmp_path / "qwen3-bf16-4bit"
    assert main(["models", "make-random", str(out), *SHAPE, "--dtype", "bfloat16", "--bits", "4",
                 "--group-size", "32"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["head_dim"] == 32 and config["torch_dtype"] == "bfloat16" and config["tie_word_embeddings"]
    assert config["quantization"] == {"group_size": 32, "bits": 4}
    assert _float_dtypes(out) == {"scales": {mx.bfloat16}, "biases": {mx.bfloat16}, "float": {mx.bfloat16}}
    assert _activations(out) == (mx.bfloat16, mx.bfloat16, mx.bfloat16)
    model = load_checkpoint(out).model
    assert model.model.layers[0].self_attn.q_proj.weight.shape[0] == 4 * 32  # heads x head_dim rows


def test_float16_unquantized(tmp_path: Path) -> None:
    out = make_random_checkpoint(tmp_path / "f16", family="llama", layers=2, dtype="float16")
    assert _float_dtypes(out) == {"scales": set(), "biases": set(), "float": {mx.float16}}
    assert _activations(out) == (mx.float16, mx.float16, mx.float16)


def test_default_stays_float32(tmp_path: Path) -> None:
    out = make_random_checkpoint(tmp_path / "f32", family="llama", layers=2, quantize_bits=4)
    assert "torch_dtype" not in json.loads((out / "config.json").read_text())
    assert _float_dtypes(out) == {"scales": {mx.float32}, "biases": {mx.float32}, "float": {mx.float32}}


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "int8"], "invalid choice: 'int8'"),
    (["--head-dim", "0"], "--head-dim"),
])
def test_bad_flags_are_refused(tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["models", "make-random", str(tmp_path / "x"), *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_heads_that_do_not_divide_hidden_need_a_head_dim(tmp_path: Path, capsys) -> None:
    assert main(["models", "make-random", str(tmp_path / "x"), "--hidden", "60", "--heads", "8"]) != 0
    assert "not a multiple of heads (8): give head_dim" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_set_overrides_config_fields_and_the_model_follows(tmp_path: Path, capsys) -> None:
    """--set FIELD=JSON: a MoE shape beyond the family's tiny defaults (what the H200 MoE rows are built with)."""
    out = tmp_path / "moe"
    assert main(["models", "make-random", str(out), "--family", "qwen3_moe", "--layers", "2", "--hidden", "64",
                 "--set", "num_experts=16", "--set", "num_experts_per_tok=3", "--set", "moe_intermediate_size=24"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (16, 3, 24)
    block = load_checkpoint(out).model.model.layers[0].mlp
    assert (block.num_experts, block.top_k) == (16, 3)
    assert block.switch_mlp.gate_proj.weight.shape == (16, 24, 64)


def test_a_malformed_set_is_a_usage_error(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["models", "make-random", str(tmp_path / "x"), "--set", "num_experts"])
    assert exc.value.code == 2 and "FIELD=VALUE" in capsys.readouterr().err


def test_a_field_with_its_own_flag_cannot_be_set(tmp_path: Path, capsys) -> None:
    assert main(["models", "make-random", str(tmp_path / "x"), "--set", "hidden_size=128"]) != 0
    assert "give hidden_size with its own flag" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_templates_carry_their_markers_as_special_tokens(tmp_path):
    """Each template variant's markers are single special tokens, and mlx-lm infers the family's parser."""
    from mlx_lm.tokenizer_utils import load

    from mlxcel.models.random_checkpoint import make_random_checkpoint
    from mlxcel.models.random_templates import TEMPLATES

    parsers = {"plain": None, "qwen3": "json_tools", "glm47": "glm47", "kimi_k2": "kimi_k2",
               "qwen3_coder": "qwen3_coder", "minimax_m2": "minimax_m2", "gpt_oss": None}
    for name, (_, specials) in TEMPLATES.items():
        tok = load(make_random_checkpoint(tmp_path / name, layers=1, template=name))
        assert all(len(tok.encode(s, add_special_tokens=False)) == 1 for s in specials), name
        parser = tok.tool_parser
        assert (parser.__module__.rsplit(".", 1)[-1] if parser else None) == parsers[name]
    assert load(tmp_path / "qwen3").think_start == load(tmp_path / "minimax_m2").think_start == "<think>"
    with pytest.raises(ValueError, match="template must be one of"):
        make_random_checkpoint(tmp_path / "x", template="nope")
