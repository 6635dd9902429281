"""Convert a GGUF file (llama, qwen2, qwen3) into an MLX checkpoint that `mlx_lm.load` reads.

`mx.load` reads the GGUF; Q4_0/Q4_1/Q8_0 tensors arrive as MLX affine-quantized triples
(uint32 weight, scales, biases; group size 32). They are kept quantized, with a per-module
`quantization` override where bits differ, or dequantized to a float dtype on request.
llama.cpp's Q/K row permutation (llama only) is undone: the checkpoint uses Hugging
Face's layout. The tokenizer comes from `gguf_tokenizer`, family details from `gguf_arch`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxcel.models.errors import ModelError
from mlxcel.models.gguf_arch import Family, family, model_config
from mlxcel.models.gguf_header import GGUFHeader, read_gguf_header
from mlxcel.models.gguf_tokenizer import build_tokenizer, meta_value, write_tokenizer

Progress = Callable[[str], None]

SUPPORTED_TENSOR_TYPES = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0")
KEEP_DTYPES = (None, "none", "quantized")  # keep GGUF types: quantized stays quantized
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
GROUP_SIZE = 32  # every GGUF block type MLX reads has 32 weights per block
SOURCE_FILE = "mlxcel_source.json"
_PROGRESS_EVERY = 50  # tensors between progress lines

_PARTS = ("weight", "scales", "biases", "bias")


def resolve_dtype(dtype: str | None) -> str | None:
    """The float dtype to write, or None to keep GGUF types; "auto" picks for the device.

    On MLX's CPU backend float32 is the fastest (quantized matmuls are slower there);
    on a GPU the quantized weights are kept.
    """
    if dtype in KEEP_DTYPES:
        return None
    if dtype == "auto":
        return "float32" if mx.default_device().type == mx.DeviceType.cpu else None
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)} or quantized")
    return dtype


def check_supported(header: GGUFHeader, path: Path) -> None:
    """Refuse architectures and tensor types this importer cannot convert faithfully."""
    try:
        family(header.architecture)
    except ModelError as exc:
        raise ModelError(f"{path.name}: {exc}") from None
    bad = Counter(t.type_name for t in header.tensors if t.type_name not in SUPPORTED_TENSOR_TYPES)
    if bad:
        example = next(t.name for t in header.tensors if t.type_name in bad)
        found = ", ".join(f"{name} ({n} tensors)" for name, n in sorted(bad.items()))
        raise ModelError(
            f"{path.name}: unsupported GGUF tensor type {found}, e.g. {example}; "
            f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
        )
    if "rope_freqs.weight" in {t.name for t in header.tensors}:
        raise ModelError(f"{path.name}: per-frequency RoPE scaling (rope_freqs) is not supported")


def unpermute_rows(a: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's rotary row order for Q or K: per head, rows [half, 2] -> [2, half].

    Rows are output features, so this applies alike to packed weights, scales and biases.
    """
    rows = a.shape[0]
    if rows % (2 * heads):
        raise ModelError(f"cannot un-permute {rows} rows over {heads} heads")
    return a.reshape(heads, rows // heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def _group_tensors(tensors: Mapping[str, mx.array]) -> dict[str, dict[str, mx.array]]:
    """{gguf base name: {"weight"|"scales"|"biases"|"bias": array}}."""
    groups: dict[str, dict[str, mx.array]] = {}
    for name, array in tensors.items():
        base, _, part = name.rpartition(".")
        if part not in _PARTS:
            raise ModelError(f"unexpected GGUF tensor name {name!r}")
        groups.setdefault(base, {})[part] = array
    return groups


def _bits(parts: Mapping[str, mx.array]) -> int:
    in_features = parts["scales"].shape[-1] * GROUP_SIZE
    return parts["weight"].shape[-1] * 32 // in_features


def _dequantize(parts: Mapping[str, mx.array]) -> mx.array:
    """float32 weights from an affine triple, computed in float32 as llama.cpp does."""
    return mx.dequantize(
        parts["weight"],
        parts["scales"].astype(mx.float32),
        parts["biases"].astype(mx.float32),
        group_size=GROUP_SIZE,
        bits=_bits(parts),
    )


def _convert_module(
    parts: dict[str, mx.array], heads: int | None, dtype: str | None
) -> dict[str, mx.array]:
    """One module's arrays: un-permuted if Q/K, dequantized if a dtype is asked for."""
    if heads is not None:
        parts = {k: unpermute_rows(v, heads) for k, v in parts.items()}
    if dtype is None:
        return parts
    if "scales" in parts:
        rest = {k: v for k, v in parts.items() if k not in ("weight", "scales", "biases")}
        parts = {"weight": _dequantize(parts), **rest}
    return {k: v.astype(DTYPES[dtype]) for k, v in parts.items()}


def _qk_heads(gguf_base: str, config: Mapping[str, Any], fam: Family) -> int | None:
    """Head count to un-permute by for a permuted attn_q / attn_k, None for any other tensor."""
    if not fam.permuted_qk:
        return None
    if gguf_base.endswith(".attn_q"):
        return config["num_attention_heads"]
    if gguf_base.endswith(".attn_k"):
        return config["num_key_value_heads"]
    return None


def convert_tensors(
    tensors: Mapping[str, mx.array],
    config: Mapping[str, Any],
    fam: Family,
    dtype: str | None,
    progress: Progress,
) -> tuple[dict[str, mx.array], dict[str, int]]:
    """(mlx-lm weights, {module path: bits} of the modules left quantized)."""
    groups = _group_tensors(tensors)
    weights: dict[str, mx.array] = {}
    bits: dict[str, int] = {}
    for i, (base, parts) in enumerate(sorted(groups.items()), 1):
        module = fam.module_name(base)
        converted = _convert_module(parts, _qk_heads(base, config, fam), dtype)
        if "scales" in converted:
            bits[module] = _bits(converted)
        mx.eval(converted)
        weights.update({f"{module}.{k}": v for k, v in converted.items()})
        if i % _PROGRESS_EVERY == 0 or i == len(groups):
            progress(f"  converted {i}/{len(groups)} tensors")
    return weights, bits


def _float_dtype(weights: Mapping[str, mx.array]) -> str:
    """The checkpoint's float dtype, as transformers names it: the embedding's (or its scales')."""
    embed = weights.get("model.embed_tokens.scales", weights["model.embed_tokens.weight"])
    return str(embed.dtype).rsplit(".", 1)[-1]


def quantization_config(bits: Mapping[str, int]) -> dict[str, Any] | None:
    """mlx-lm's `quantization` section: the commonest bits, per-module overrides for the rest."""
    if not bits:
        return None
    default = Counter(bits.values()).most_common(1)[0][0]
    section: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default, "mode": "affine"}
    for module, b in sorted(bits.items()):
        if b != default:
            section[module] = {"group_size": GROUP_SIZE, "bits": b, "mode": "affine"}
    return section


def generation_config(config: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, Any]:
    """generation_config.json: BOS, pad and every end-of-generation id the GGUF names."""
    eos = [meta_value(meta, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos_ids = list(dict.fromkeys(int(e) for e in eos if e is not None))
    out: dict[str, Any] = {"eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    for key in ("bos_token_id", "pad_token_id"):
        if key in config:
            out[key] = config[key]
    return out


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _write_json(path: Path, content: Any) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse a file, or a non-empty directory unless `overwrite`."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ModelError(f"{out_dir} exists and is not a directory")
    if out_dir.exists() and not overwrite and not _is_empty_dir(out_dir):
        raise ModelError(f"{out_dir} is not empty; pass overwrite=True (--overwrite) to replace it")


@contextmanager
def atomic_dir(out_dir: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temp dir next to `out_dir`; on success it replaces `out_dir`, else vanishes."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        check_out_dir(out_dir, overwrite)
        old = None
        if out_dir.exists():
            old = out_dir.with_name(f"{tmp.name}.old")
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _load_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    try:
        return mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as exc:
        raise ModelError(f"cannot read GGUF {path}: {exc}") from exc


def _source_record(path: Path, requested: str | None, dtype: str | None) -> dict[str, Any]:
    return {
        "gguf": path.name,
        "gguf_sha256": file_sha256(path),
        "gguf_size": path.stat().st_size,
        "dtype": dtype,
        "requested_dtype": requested,
        "converter": __name__,
    }


def _describe(config: Mapping[str, Any], quant: Mapping[str, Any] | None, dtype: str | None) -> str:
    if dtype:
        weights = dtype
    elif quant:
        overrides = {k: v["bits"] for k, v in quant.items() if isinstance(v, dict)}
        extra = "".join(f", {k} {b}-bit" for k, b in overrides.items())
        weights = f"{quant['bits']}-bit{extra}"
    else:
        weights = "as stored"
    return (f"{config['model_type']}: {config['num_hidden_layers']} layers, "
            f"hidden {config['hidden_size']}, "
            f"{config['num_attention_heads']}/{config['num_key_value_heads']} heads, "
            f"vocab {config['vocab_size']}; weights {weights}")


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    *,
    dtype: str | None = None,
    progress: Progress | None = None,
    overwrite: bool = False,
) -> Path:
    """Convert `gguf_path` into an mlx-lm checkpoint at `out_dir`; return `out_dir`.

    dtype: None keeps quantized tensors quantized; "float32"/"bfloat16"/"float16"
    dequantizes everything; "auto" picks the fastest for the current MLX device.
    The checkpoint appears whole or not at all.
    """
    say = progress or (lambda _line: None)
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    target = resolve_dtype(dtype)
    check_out_dir(out_dir, overwrite)
    start = time.perf_counter()
    say(f"reading {gguf_path} ({gguf_path.stat().st_size / 1e6:.1f} MB)" if gguf_path.is_file()
        else f"reading {gguf_path}")
    header = read_gguf_header(gguf_path)
    check_supported(header, gguf_path)
    tensors, meta = _load_gguf(gguf_path)
    tokenizer = build_tokenizer(meta)
    fam = family(header.architecture)
    config = model_config(header.architecture, meta, tensors)
    weights, bits = convert_tensors(tensors, config, fam, target, say)
    quant = quantization_config(bits)
    if quant:
        config["quantization"] = quant
    config["torch_dtype"] = _float_dtype(weights)
    say(_describe(config, quant, target))
    with atomic_dir(out_dir, overwrite) as tmp:
        say("writing model.safetensors")
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", generation_config(config, meta))
        say("writing tokenizer")
        write_tokenizer(meta, tmp, tokenizer, max_length=config["max_position_embeddings"])
        _write_json(tmp / SOURCE_FILE, _source_record(gguf_path, dtype, target))
    size = sum(p.stat().st_size for p in out_dir.iterdir())
    say(f"wrote {out_dir} ({size / 1e6:.1f} MB) in {time.perf_counter() - start:.1f}s")
    return out_dir
