"""The GGUF-built tokenizer: llama.cpp's ids (golden file), round trips, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from transformers import AutoTokenizer

from mlxcel.models.errors import ModelError
from mlxcel.models.gguf_import import convert_gguf
from mlxcel.models.gguf_tokenizer import build_tokenizer
from tests.models.tiny_gguf import TinySpec, write_tiny_gguf

FIXTURES = Path(__file__).parents[1] / "fixtures"
GOLDEN = FIXTURES / "smollm2_tokenizer_golden.json"
PRE_GOLDEN = json.loads((FIXTURES / "pretokenizer_golden.json").read_text())


def gguf_metadata(path: Path) -> dict:
    return mx.load(str(path), return_metadata=True)[1]


@pytest.fixture(scope="module")
def golden(default_gguf: Path) -> dict:
    data = json.loads(GOLDEN.read_text())
    from mlxcel.models.gguf_import import file_sha256

    if file_sha256(default_gguf) != data["header"]["gguf_sha256"]:
        pytest.skip("golden ids were made from a different GGUF")
    return data


@pytest.fixture(scope="module")
def smollm_tokenizer(default_gguf: Path):
    return build_tokenizer(gguf_metadata(default_gguf))


@pytest.mark.slow
def test_ids_match_llama_cpp(golden: dict, smollm_tokenizer) -> None:
    mismatches = [
        (c["text"], smollm_tokenizer.encode(c["text"]).ids, c["ids"])
        for c in golden["cases"] if smollm_tokenizer.encode(c["text"]).ids != c["ids"]
    ]
    assert not mismatches, f"{len(mismatches)}/{len(golden['cases'])} differ, first: {mismatches[0]}"


@pytest.mark.slow
def test_ids_match_llama_cpp_without_special_parsing(golden: dict, smollm_tokenizer) -> None:
    smollm_tokenizer.encode_special_tokens = True
    try:
        got = [smollm_tokenizer.encode(c["text"]).ids for c in golden["cases"]]
    finally:
        smollm_tokenizer.encode_special_tokens = False
    assert got == [c["ids_no_special"] for c in golden["cases"]]


@pytest.mark.slow
def test_decode_round_trip(golden: dict, smollm_tokenizer) -> None:
    for case in golden["cases"]:
        assert smollm_tokenizer.decode(case["ids"], skip_special_tokens=False) == case["text"]
        assert case["detokenized"] == case["text"]


@pytest.mark.slow
def test_transformers_loads_the_written_tokenizer(golden: dict, default_gguf: Path, tmp_path: Path) -> None:
    out = convert_gguf(default_gguf, tmp_path / "ckpt")
    tok = AutoTokenizer.from_pretrained(str(out))
    for case in golden["cases"]:
        assert tok.encode(case["text"], add_special_tokens=True) == case["ids"]
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                   tokenize=False)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2


@pytest.mark.parametrize("pre", sorted(PRE_GOLDEN["ids"]))
def test_pre_tokenizer_types_match_llama_cpp(pre: str) -> None:
    vocab = PRE_GOLDEN["vocab"]
    tok = build_tokenizer({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": vocab["tokens"], "tokenizer.ggml.token_type": vocab["token_types"],
        "tokenizer.ggml.merges": vocab["merges"],
    })
    got = [tok.encode(text).ids for text in PRE_GOLDEN["texts"]]
    assert got == PRE_GOLDEN["ids"][pre]


def test_every_supported_pre_type_has_golden_ids() -> None:
    from mlxcel.models.gguf_tokenizer import PRE_TOKENIZERS

    assert set(PRE_TOKENIZERS) == set(PRE_GOLDEN["ids"])


def test_tiny_tokenizer_specials_and_merges(tmp_path: Path) -> None:
    tok = build_tokenizer(gguf_metadata(write_tiny_gguf(tmp_path / "m.gguf")))
    ids = tok.encode("<|im_start|>the 42<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>the 42<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "the 42"
    assert len(tok.encode(" the").ids) == 1  # merges "Ġ t", "h e", "Ġt he"
    assert tok.encode("12").ids == [tok.token_to_id("1"), tok.token_to_id("2")]


def test_refuses_unknown_pre_tokenizer(tmp_path: Path) -> None:
    meta = gguf_metadata(write_tiny_gguf(tmp_path / "m.gguf", TinySpec(pre="jais-exotic")))
    with pytest.raises(ModelError, match=r"pre-tokenizer type 'jais-exotic'; supported: .*smollm"):
        build_tokenizer(meta)


def test_refuses_non_bpe_vocab(tmp_path: Path) -> None:
    meta = dict(gguf_metadata(write_tiny_gguf(tmp_path / "m.gguf")))
    meta["tokenizer.ggml.model"] = "llama"
    with pytest.raises(ModelError, match="tokenizer model 'llama'"):
        build_tokenizer(meta)
