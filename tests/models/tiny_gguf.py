"""Build tiny GGUF files (llama, qwen2, qwen3) for tests, laid out as llama.cpp's converter does.

Weights start in Hugging Face order; for llama, attn_q/attn_k rows are permuted with
llama.cpp's formula before writing (its converter leaves qwen2/qwen3 unpermuted).
`reference_weights` gives what a faithful import must recover: the HF-order weights after the GGUF type's quantization round trip (row permutation
commutes with row-wise block quantization, so no permutation code is involved).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from tokenizers import pre_tokenizers

Q = gguf.GGMLQuantizationType

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"
)

LAYER_TENSORS = {  # gguf name -> HF-order shape as a function of the dims
    "attn_q": lambda d: (d.heads * d.head_dim, d.hidden),
    "attn_k": lambda d: (d.kv_heads * d.head_dim, d.hidden),
    "attn_v": lambda d: (d.kv_heads * d.head_dim, d.hidden),
    "attn_output": lambda d: (d.hidden, d.heads * d.head_dim),
    "ffn_gate": lambda d: (d.ffn, d.hidden),
    "ffn_up": lambda d: (d.ffn, d.hidden),
    "ffn_down": lambda d: (d.hidden, d.ffn),
}


@dataclass
class Dims:
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 96
    layers: int = 2
    context: int = 256

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass
class TinySpec:
    """What to write: tensor types per role, architecture, pre-tokenizer, untied head."""

    embed_type: Q = Q.F32
    linear_type: Q = Q.F32
    output_type: Q | None = None  # None: head tied to the embedding
    arch: str = "llama"
    pre: str = "smollm"
    dims: Dims = field(default_factory=Dims)
    seed: int = 0


def vocabulary() -> tuple[list[str], list[int]]:
    """Control tokens, the 256 byte-level characters, then merged tokens."""
    merged = ["".join(m.split(" ")) for m in MERGES]
    tokens = CONTROL + sorted(pre_tokenizers.ByteLevel.alphabet()) + merged
    types = [3] * len(CONTROL) + [1] * (len(tokens) - len(CONTROL))
    return tokens, types


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Q/K permutation (HF rotary halves -> interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(spec: TinySpec) -> dict[str, np.ndarray]:
    """Random float32 weights in HF order, keyed by GGUF tensor name."""
    rng = np.random.default_rng(spec.seed)
    d = spec.dims
    vocab = len(vocabulary()[0])
    w = {"token_embd.weight": rng.normal(0, 0.5, (vocab, d.hidden)),
         "output_norm.weight": 1 + rng.normal(0, 0.1, d.hidden)}
    if spec.output_type is not None:
        w["output.weight"] = rng.normal(0, 0.2, (vocab, d.hidden))
    for i in range(d.layers):
        w[f"blk.{i}.attn_norm.weight"] = 1 + rng.normal(0, 0.1, d.hidden)
        w[f"blk.{i}.ffn_norm.weight"] = 1 + rng.normal(0, 0.1, d.hidden)
        for name, shape in LAYER_TENSORS.items():
            w[f"blk.{i}.{name}.weight"] = rng.normal(0, 0.15, shape(d))
        if spec.arch == "qwen2":  # q/k/v biases
            for name in ("attn_q", "attn_k", "attn_v"):
                w[f"blk.{i}.{name}.bias"] = rng.normal(0, 0.1, LAYER_TENSORS[name](d)[0])
        if spec.arch == "qwen3":  # per-head RMS norms on q and k
            for name in ("attn_q_norm", "attn_k_norm"):
                w[f"blk.{i}.{name}.weight"] = 1 + rng.normal(0, 0.1, d.head_dim)
    return {k: v.astype(np.float32) for k, v in w.items()}


def tensor_type(name: str, spec: TinySpec) -> Q:
    if name.endswith("norm.weight") or name.endswith(".bias"):
        return Q.F32
    if name == "token_embd.weight":
        return spec.embed_type
    if name == "output.weight":
        return spec.output_type
    return spec.linear_type


def encode(w: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F32:
        return w.astype(np.float32)
    if qtype == Q.F16:
        return w.astype(np.float16)
    return gguf.quants.quantize(w, qtype)


def round_trip(w: np.ndarray, qtype: Q) -> np.ndarray:
    """The float32 values a reader of the stored tensor sees."""
    if qtype in (Q.F32, Q.F16):
        return encode(w, qtype).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).astype(np.float32)


def reference_weights(spec: TinySpec) -> dict[str, np.ndarray]:
    """HF-order float32 weights after the storage round trip, keyed by GGUF name."""
    return {k: round_trip(v, tensor_type(k, spec)) for k, v in hf_weights(spec).items()}


def _add_metadata(writer: gguf.GGUFWriter, spec: TinySpec) -> None:
    d = spec.dims
    writer.add_name("tiny")
    writer.add_block_count(d.layers)
    writer.add_context_length(d.context)
    writer.add_embedding_length(d.hidden)
    writer.add_feed_forward_length(d.ffn)
    writer.add_head_count(d.heads)
    writer.add_head_count_kv(d.kv_heads)
    writer.add_rope_dimension_count(d.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    tokens, types = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(spec.pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_tiny_gguf(path: Path, spec: TinySpec | None = None) -> Path:
    """Write a tiny llama-style GGUF at `path` following `spec`; return `path`."""
    spec = spec or TinySpec()
    d = spec.dims
    writer = gguf.GGUFWriter(str(path), spec.arch)
    _add_metadata(writer, spec)
    for name, w in hf_weights(spec).items():
        if spec.arch == "llama" and ".attn_q." in name:
            w = llama_cpp_permute(w, d.heads)
        elif spec.arch == "llama" and ".attn_k." in name:
            w = llama_cpp_permute(w, d.kv_heads)
        qtype = tensor_type(name, spec)
        data = encode(w, qtype)
        raw = None if qtype in (Q.F32, Q.F16) else qtype
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
