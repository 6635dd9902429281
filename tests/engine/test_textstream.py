"""Per-sequence text on a real byte-level tokenizer: split characters, stop strings, interleaved sequences."""

from __future__ import annotations

import pytest

from mlxcel.engine.textstream import SequenceText

TEXT = "héllo wörld ✓ done"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from mlxcel.models.loading import load_checkpoint

    return load_checkpoint(tiny_llama).tokenizer


def stream(tokenizer, text: str, stops: tuple[str, ...] = ()) -> tuple[list[str], str, bool]:
    seq = SequenceText(tokenizer, stops)
    pieces = [seq.feed(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    return pieces, seq.finish(), seq.stopped


def test_characters_split_over_byte_tokens_come_out_whole(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT)  # "é", "ö" and "✓" take several byte tokens each
    pieces, tail, stopped = stream(tokenizer, TEXT)
    assert "".join(pieces) + tail == TEXT and not stopped
    assert not any("\ufffd" in p for p in pieces)


def test_a_stop_string_across_tokens_cuts_the_text_before_it(tokenizer):
    pieces, tail, stopped = stream(tokenizer, TEXT, ("wör",))
    assert "".join(pieces) == "héllo " and tail == "" and stopped


def test_an_undecided_stop_prefix_is_released_by_finish(tokenizer):
    pieces, tail, stopped = stream(tokenizer, "ab wö", ("wörld",))
    assert "".join(pieces) == "ab " and tail == "wö" and not stopped


def test_sequences_on_one_tokenizer_do_not_share_state(tokenizer):
    texts = ["first ✓ one", "ünïcode two"]
    seqs = [SequenceText(tokenizer, ()) for _ in texts]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    out = ["", ""]
    for i in range(max(map(len, ids))):
        for k in (0, 1):
            if i < len(ids[k]):
                out[k] += seqs[k].feed(ids[k][i])
    assert [o + s.finish() for o, s in zip(out, seqs)] == texts
