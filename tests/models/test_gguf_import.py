"""GGUF -> MLX conversion: logits match a reference built from the same weights."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from mlxcel.models import gguf_import
from mlxcel.models.errors import ModelError
from mlxcel.models.gguf_arch import FAMILIES
from mlxcel.models.gguf_import import convert_gguf, unpermute_rows
from tests.models.tiny_gguf import Q, TinySpec, llama_cpp_permute, reference_weights, write_tiny_gguf

TOKENS = [[1, 40, 41, 42, 200, 7, 266, 3, 9, 120]]

CASES = {
    "f32": TinySpec(embed_type=Q.F32, linear_type=Q.F32),
    "f16": TinySpec(embed_type=Q.F16, linear_type=Q.F16),
    "q4_0": TinySpec(embed_type=Q.Q4_0, linear_type=Q.Q4_0),
    "q4_1": TinySpec(embed_type=Q.Q4_1, linear_type=Q.Q4_1),
    "q8_0": TinySpec(embed_type=Q.Q8_0, linear_type=Q.Q8_0),
    "q8_embed_q4_1_linears": TinySpec(embed_type=Q.Q8_0, linear_type=Q.Q4_1),
    "untied_f16_head": TinySpec(embed_type=Q.Q8_0, linear_type=Q.Q4_0, output_type=Q.F16),
    "qwen2_q4_0": TinySpec(arch="qwen2", pre="qwen2", embed_type=Q.Q8_0, linear_type=Q.Q4_0),
    "qwen3_q8_0": TinySpec(arch="qwen3", pre="qwen2", embed_type=Q.Q8_0, linear_type=Q.Q8_0),
}


def reference_logits(spec: TinySpec) -> np.ndarray:
    """Logits of mlx-lm's model family built directly from the HF-order reference weights."""
    d = spec.dims
    ref = reference_weights(spec)
    family = FAMILIES[spec.arch]
    args = importlib.import_module(f"mlx_lm.models.{spec.arch}").ModelArgs.from_dict({
        "model_type": spec.arch, "hidden_size": d.hidden, "num_hidden_layers": d.layers,
        "intermediate_size": d.ffn, "num_attention_heads": d.heads, "num_key_value_heads": d.kv_heads,
        "rms_norm_eps": 1e-5, "vocab_size": len(ref["token_embd.weight"]), "rope_theta": 10000.0,
        "tie_word_embeddings": spec.output_type is None, "head_dim": d.head_dim,
        "max_position_embeddings": d.context,
    })
    model = importlib.import_module(f"mlx_lm.models.{spec.arch}").Model(args)
    weights = {}
    for name, value in ref.items():
        base, part = name.rsplit(".", 1)
        weights[f"{family.module_name(base)}.{part}"] = mx.array(value)
    model.load_weights(list(weights.items()))
    return np.array(model(mx.array(TOKENS)).astype(mx.float32))


def converted_logits(path: Path) -> np.ndarray:
    model, _ = mlx_lm.load(str(path))
    return np.array(model(mx.array(TOKENS)).astype(mx.float32))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [None, "float32"])
def test_logits_match_reference(tmp_path: Path, case: str, dtype: str | None) -> None:
    spec = CASES[case]
    out = convert_gguf(write_tiny_gguf(tmp_path / "m.gguf", spec), tmp_path / "ckpt", dtype=dtype)
    got, want = converted_logits(out), reference_logits(spec)
    # Kept quantized, float16 scales put activations in float16 (measured error ~0.2%).
    quantized = dtype is None and spec.embed_type not in (Q.F32, Q.F16)
    tol = 1e-2 if quantized else 1e-5
    np.testing.assert_allclose(got, want, atol=tol * np.abs(want).max(), rtol=0)
    config = json.loads((out / "config.json").read_text())
    assert ("quantization" in config) == quantized


def test_mixed_bits_get_per_module_override(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "m.gguf", CASES["q8_embed_q4_1_linears"])
    config = json.loads((convert_gguf(gguf, tmp_path / "ckpt") / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    assert config["quantization"]["group_size"] == 32
    assert config["quantization"]["model.embed_tokens"]["bits"] == 8
    assert config["tie_word_embeddings"] is True


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dequantize_to_half_dtypes(tmp_path: Path, dtype: str) -> None:
    gguf = write_tiny_gguf(tmp_path / "m.gguf", CASES["q4_1"])
    out = convert_gguf(gguf, tmp_path / "ckpt", dtype=dtype)
    weights = mx.load(str(out / "model.safetensors"))
    assert not any(k.endswith(".scales") for k in weights)
    assert {str(v.dtype) for v in weights.values()} == {f"mlx.core.{dtype}"}
    want = reference_logits(CASES["q4_1"])
    np.testing.assert_allclose(converted_logits(out), want, atol=5e-2 * np.abs(want).max(), rtol=0)


def test_auto_dtype_is_float32_on_cpu() -> None:
    if mx.default_device().type != mx.DeviceType.cpu:
        pytest.skip("only meaningful on MLX's CPU backend")
    assert gguf_import.resolve_dtype("auto") == "float32"
    assert {gguf_import.resolve_dtype(d) for d in (None, "none", "quantized")} == {None}
    with pytest.raises(ModelError, match="unknown dtype 'int3'"):
        gguf_import.resolve_dtype("int3")


@pytest.mark.parametrize("heads", [1, 3, 4])
def test_unpermute_inverts_llama_cpp_permutation(heads: int) -> None:
    rng = np.random.default_rng(heads)
    w = rng.normal(size=(heads * 16, 64)).astype(np.float32)
    np.testing.assert_array_equal(np.array(unpermute_rows(mx.array(llama_cpp_permute(w, heads)), heads)), w)


def test_unpermute_works_on_packed_quantized_rows() -> None:
    w = mx.array(np.random.default_rng(1).normal(size=(64, 64)).astype(np.float32))
    packed = mx.quantize(w, group_size=32, bits=4)
    permuted = [mx.array(llama_cpp_permute(np.array(a), 4)) for a in packed]
    restored = [unpermute_rows(a, 4) for a in permuted]
    np.testing.assert_array_equal(
        np.array(mx.dequantize(*restored, group_size=32, bits=4)),
        np.array(mx.dequantize(*packed, group_size=32, bits=4)),
    )


def test_without_unpermute_logits_differ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_import, "unpermute_rows", lambda a, heads: a)
    gguf = write_tiny_gguf(tmp_path / "m.gguf", CASES["f32"])
    got = converted_logits(convert_gguf(gguf, tmp_path / "ckpt"))
    assert np.abs(got - reference_logits(CASES["f32"])).max() > 1e-2


def test_checkpoint_files_and_metadata(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "m.gguf", CASES["q4_0"])
    lines: list[str] = []
    out = convert_gguf(gguf, tmp_path / "ckpt", progress=lines.append)
    names = {p.name for p in out.iterdir()}
    assert names == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "special_tokens_map.json", "generation_config.json", "mlxcel_source.json"}
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["max_position_embeddings"] == 256
    assert (config["num_key_value_heads"], config["rms_norm_eps"]) == (2, 1e-05)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    source = json.loads((out / "mlxcel_source.json").read_text())
    assert source["gguf"] == "m.gguf" and source["dtype"] is None and len(source["gguf_sha256"]) == 64
    assert any("converted" in line for line in lines) and lines[-1].startswith("wrote")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt")]


def test_refuses_unknown_architecture(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "m.gguf", TinySpec(arch="falcon"))
    with pytest.raises(ModelError, match=r"unsupported GGUF architecture .falcon.; supported: llama, qwen2, qwen3"):
        convert_gguf(gguf, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_refuses_unknown_tensor_type(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "m.gguf", TinySpec(linear_type=Q.Q5_0))
    with pytest.raises(ModelError, match=r"unsupported GGUF tensor type Q5_0 \(14 tensors\).*Q4_1"):
        convert_gguf(gguf, tmp_path / "ckpt")


def test_refuses_non_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelError, match="not a GGUF file"):
        convert_gguf(bad, tmp_path / "ckpt")
    with pytest.raises(ModelError, match="cannot read"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "ckpt")


def test_refuses_non_empty_out_dir_unless_overwrite(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "m.gguf")
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(ModelError, match="not empty"):
        convert_gguf(gguf, out)
    assert (out / "keep.txt").exists()
    convert_gguf(gguf, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "config.json").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (convert_gguf(gguf, empty) / "config.json").exists()


def test_interrupted_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = write_tiny_gguf(tmp_path / "m.gguf")
    def boom(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(gguf_import, "write_tokenizer", boom)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(gguf, tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_interrupted_overwrite_keeps_old_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = write_tiny_gguf(tmp_path / "m.gguf")
    out = convert_gguf(gguf, tmp_path / "ckpt")
    before = (out / "model.safetensors").read_bytes()
    monkeypatch.setattr(gguf_import, "write_tokenizer", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        convert_gguf(gguf, out, dtype="float16", overwrite=True)
    assert (out / "model.safetensors").read_bytes() == before
