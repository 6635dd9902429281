"""How each supported GGUF architecture maps onto an mlx-lm model family.

A family names its mlx-lm `model_type`, the GGUF tensors it may hold and their Hugging
Face paths, and whether llama.cpp's converter permuted the Q/K rows (it does so only
for llama-style models, whose rotary halves it interleaves).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from mlxcel.models.errors import ModelError
from mlxcel.models.gguf_tokenizer import meta_value

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class Family:
    """One GGUF architecture as an mlx-lm model family."""

    model_type: str
    hf_architecture: str
    permuted_qk: bool
    extra_layer_names: Mapping[str, str] = field(default_factory=dict)

    def module_name(self, gguf_base: str) -> str:
        """`blk.3.attn_q` -> `model.layers.3.self_attn.q_proj`; ModelError if unknown."""
        if gguf_base in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[gguf_base]
        names = {**_LAYER_NAMES, **self.extra_layer_names}
        parts = gguf_base.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
            return f"model.layers.{parts[1]}.{names[parts[2]]}"
        raise ModelError(f"unexpected GGUF tensor {gguf_base!r} for the {self.model_type} architecture")


FAMILIES = {
    "llama": Family("llama", "LlamaForCausalLM", permuted_qk=True),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", permuted_qk=False),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", permuted_qk=False, extra_layer_names={
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    }),
}


def family(arch: str | None) -> Family:
    """The family for a GGUF `general.architecture`; ModelError naming the supported ones."""
    if arch not in FAMILIES:
        raise ModelError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(FAMILIES)}")
    return FAMILIES[arch]


def _meta_int(meta: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = meta_value(meta, key, default)
    if value is None:
        raise ModelError(f"GGUF metadata lacks {key}")
    return int(value)


def _meta_float(meta: Mapping[str, Any], key: str, default: float | None = None) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.99999974e-06)."""
    value = meta_value(meta, key, default)
    if value is None:
        raise ModelError(f"GGUF metadata lacks {key}")
    return float(str(np.float32(value)))


def _rope_scaling(meta: Mapping[str, Any], arch: str) -> dict | None:
    kind = meta_value(meta, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise ModelError(f"unsupported GGUF RoPE scaling type {kind!r}; supported: linear")
    return {"type": "linear", "factor": _meta_float(meta, f"{arch}.rope.scaling.factor")}


def _token_ids(meta: Mapping[str, Any]) -> dict[str, int]:
    ids = {}
    for gguf_name, hf_name in (("bos", "bos"), ("eos", "eos"), ("padding", "pad")):
        value = meta_value(meta, f"tokenizer.ggml.{gguf_name}_token_id")
        if value is not None:
            ids[f"{hf_name}_token_id"] = int(value)
    return ids


def model_config(arch: str, meta: Mapping[str, Any], tensors: Mapping[str, mx.array]) -> dict[str, Any]:
    """config.json for mlx-lm from the GGUF's `<arch>.*` hyper-parameters."""
    fam = family(arch)
    hidden = _meta_int(meta, f"{arch}.embedding_length")
    heads = _meta_int(meta, f"{arch}.attention.head_count")
    head_dim = _meta_int(meta, f"{arch}.attention.key_length", hidden // heads)
    rope_dim = _meta_int(meta, f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ModelError(f"partial rotary embedding ({rope_dim} of {head_dim} dims) is not supported")
    return {
        "architectures": [fam.hf_architecture],
        "model_type": fam.model_type,
        "hidden_size": hidden,
        "intermediate_size": _meta_int(meta, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _meta_int(meta, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _meta_int(meta, f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": _meta_float(meta, f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": _meta_float(meta, f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(meta, arch),
        "vocab_size": int(tensors["token_embd.weight"].shape[0]),
        "max_position_embeddings": _meta_int(meta, f"{arch}.context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": False,
        **_token_ids(meta),
    }
