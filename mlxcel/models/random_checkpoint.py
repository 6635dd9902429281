"""Tiny random-weight checkpoints (llama, qwen3) for tests, benchmarks and cluster rehearsals.

They load through the same path as real checkpoints; their output is noise by
construction, but shapes, caches, slicing and transport behave as for real ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _tokenizer_json() -> dict:
    """A byte-level BPE over the 256 byte symbols, no merges, three special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for sym in sorted(alphabet):
        vocab[sym] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return json.loads(tok.to_str())


DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def _config(family: str, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int,
            intermediate: int | None, head_dim: int | None) -> dict:
    config = {
        "model_type": family,
        "hidden_size": hidden,
        "intermediate_size": intermediate or hidden * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim or hidden // heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": family == "qwen3",
        "bos_token_id": None,
        "eos_token_id": 2,
    }
    return config


def make_random_checkpoint(
    out_dir: str | Path,
    *,
    family: str = "llama",
    layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    quantize_bits: int | None = None,
    intermediate: int | None = None,
    vocab: int = 320,
    dtype: str = "float32",
    head_dim: int | None = None,
    group_size: int = 32,
) -> Path:
    """Write config.json, model.safetensors and tokenizer files for a random model; return the dir.

    The tokenizer knows 259 tokens; a larger ``vocab`` (e.g. 49152 for SmolLM2's shape) only
    widens the embedding and head, which is what benchmarks of a model's shape need. ``dtype``
    (float32, bfloat16, float16) is that of every weight, and of a quantized model's scales and
    biases, so a "4-bit bfloat16" model computes in bfloat16 like a real one; ``head_dim``
    defaults to hidden / heads (Qwen3-0.6B: hidden 1024, 16 heads, head_dim 128).
    """
    from mlx_lm.utils import _get_classes

    if vocab < 259:
        raise ValueError(f"vocab must cover the tokenizer's 259 tokens, got {vocab}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if head_dim is None and hidden % heads:
        raise ValueError(f"hidden ({hidden}) is not a multiple of heads ({heads}): give head_dim")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(family, layers, hidden, heads, kv_heads, vocab, intermediate, head_dim)
    if dtype != "float32":  # float32 checkpoints stay as they always were
        config["torch_dtype"] = dtype
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    model.set_dtype(DTYPES[dtype])  # before quantizing: scales and biases take the weights' dtype
    if quantize_bits:
        nn.quantize(model, group_size=group_size, bits=quantize_bits)
        config["quantization"] = {"group_size": group_size, "bits": quantize_bits}
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "tokenizer.json").write_text(json.dumps(_tokenizer_json()))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "eos_token": "<|im_end|>",
        "bos_token": None,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
    }, indent=2))
    return out
