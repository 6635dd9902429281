"""Build a Hugging Face `tokenizers` tokenizer from GGUF metadata, tokenizing as llama.cpp.

Only byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) are supported. The
pre-tokenizer follows llama.cpp's `tokenizer.ggml.pre` type; control tokens become special
added tokens (matched in text when special tokens are parsed), user-defined tokens plain
added tokens (always matched), as llama.cpp does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from mlxcel.models.errors import ModelError

# llama.cpp token types (llama_token_type in llama.h).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 2, 3, 4

# Pre-tokenizer regexes as llama.cpp applies them (llama-vocab.cpp), in HF syntax.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _gpt2() -> pre_tokenizers.PreTokenizer:
    """GPT-2's regex split, then bytes to printable characters."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    """Every digit alone (`\\p{N}`), then GPT-2's split (llama.cpp: smollm, starcoder...)."""
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split_then_bytes(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    return build


# tokenizer.ggml.pre -> pre-tokenizer factory. Names that share a regex set in llama.cpp
# (llama-vocab.cpp) share a factory; each is checked against llama.cpp in the tests.
_FAMILIES: dict[Callable[[], pre_tokenizers.PreTokenizer], tuple[str, ...]] = {
    _digits_then_gpt2: ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"),
    _gpt2: ("gpt-2", "phi-2", "mpt", "olmo", "jais"),
    _split_then_bytes(_LLAMA3_SPLIT): ("llama-bpe", "llama3", "llama-v3"),
    _split_then_bytes(_QWEN2_SPLIT): ("qwen2", "stablelm2"),
}
PRE_TOKENIZERS = {name: build for build, names in _FAMILIES.items() for name in names}
# llama.cpp keeps a whole pre-token that is itself in the vocabulary for these types.
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3"}


def meta_value(meta: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """A metadata value as a plain Python object (mx.array scalars and vectors unwrapped)."""
    value = meta.get(key, default)
    return value.tolist() if hasattr(value, "tolist") else value


def _check_supported(meta: Mapping[str, Any]) -> str:
    model = meta_value(meta, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelError(
            f"unsupported GGUF tokenizer model {model!r}: only byte-level BPE ('gpt2') is supported"
        )
    pre = meta_value(meta, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ModelError(
            f"unsupported GGUF pre-tokenizer type {pre!r}; supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    return pre


def _special_id(meta: Mapping[str, Any], name: str) -> int | None:
    value = meta_value(meta, f"tokenizer.ggml.{name}_token_id")
    return int(value) if value is not None else None


def _post_processor(meta: Mapping[str, Any], tokens: list[str]) -> processors.PostProcessor:
    """Byte-level offsets, plus BOS/EOS where the GGUF asks llama.cpp to add them."""
    steps: list[processors.PostProcessor] = [processors.ByteLevel(trim_offsets=False)]
    bos, eos = _special_id(meta, "bos"), _special_id(meta, "eos")
    add_bos = bool(meta_value(meta, "tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta_value(meta, "tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        pre = [f"{tokens[bos]}:0"] if add_bos else []
        post = [f"{tokens[eos]}:0"] if add_eos else []
        specials = {tokens[i]: i for i, on in ((bos, add_bos), (eos, add_eos)) if on}
        steps.append(processors.TemplateProcessing(
            single=" ".join(pre + ["$A:0"] + post),
            pair=" ".join(pre + ["$A:0"] + post + pre + ["$B:1"] + post),
            special_tokens=list(specials.items()),
        ))
    return processors.Sequence(steps)


def build_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to llama.cpp's for this GGUF's vocabulary."""
    pre = _check_supported(meta)
    tokens: list[str] = list(meta_value(meta, "tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ModelError("GGUF has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    types = meta_value(meta, "tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta_value(meta, "tokenizer.ggml.merges") or []]
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=merges,
        ignore_merges=pre in _IGNORE_MERGES,
    )
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = _post_processor(meta, tokens)
    tok.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED
    ])
    tok.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, types) if k in (TOKEN_CONTROL, TOKEN_UNKNOWN)
    ])
    return tok


def _added_tokens_decoder(tok: Tokenizer) -> dict[str, dict[str, Any]]:
    return {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                 "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }


def special_tokens(meta: Mapping[str, Any]) -> dict[str, str]:
    """bos/eos/unk/pad token strings named by the GGUF, keyed as transformers names them."""
    tokens = meta_value(meta, "tokenizer.ggml.tokens") or []
    names = {"bos": "bos_token", "eos": "eos_token", "unknown": "unk_token", "padding": "pad_token"}
    out = {}
    for gguf_name, hf_name in names.items():
        idx = _special_id(meta, gguf_name)
        if idx is not None and 0 <= idx < len(tokens):
            out[hf_name] = tokens[idx]
    return out


def tokenizer_config(meta: Mapping[str, Any], tok: Tokenizer, max_length: int | None) -> dict:
    """tokenizer_config.json: special tokens, chat template, no BOS/EOS unless the GGUF adds them."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta_value(meta, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta_value(meta, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": _added_tokens_decoder(tok),
        **special_tokens(meta),
    }
    if max_length:
        config["model_max_length"] = max_length
    template = meta_value(meta, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


def write_tokenizer(
    meta: Mapping[str, Any],
    out_dir: Path,
    tok: Tokenizer | None = None,
    *,
    max_length: int | None = None,
) -> Tokenizer:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`."""
    tok = tok or build_tokenizer(meta)
    tok.save(str(out_dir / "tokenizer.json"))
    files = {
        "tokenizer_config.json": tokenizer_config(meta, tok, max_length),
        "special_tokens_map.json": special_tokens(meta),
    }
    for name, content in files.items():
        (out_dir / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
    return tok
