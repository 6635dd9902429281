"""Which modes a family runs in, from the code's own tables: ``mlxcel models info`` and docs/models.md's matrix.

The matrix in docs/models.md must be exactly what ``mlxcel models matrix`` prints: a family added to
``model_slice.FAMILIES``, ``parallel.plan`` or ``RANDOM_FAMILIES``, or a cache class the handoff
learns, changes the generated matrix, and this test fails until the docs say so too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxcel.commands.support import (
    MATRIX_BEGIN,
    MATRIX_END,
    di_support,
    matrix_markdown,
    matrix_rows,
    module_of,
    pp_support,
    tp_support,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"
LLAMA4 = {"model_type": "llama4", "eos_token_id": 2, "text_config": {
    "attention_bias": False, "attention_chunk_size": 8, "head_dim": 16, "hidden_size": 32,
    "interleave_moe_layer_step": 4, "intermediate_size": 32, "intermediate_size_mlp": 64,
    "max_position_embeddings": 2048, "model_type": "llama4_text", "num_attention_heads": 2,
    "num_experts_per_tok": 1, "num_hidden_layers": 2, "num_key_value_heads": 1, "num_local_experts": 2,
    "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 10000.0, "use_qk_norm": False, "vocab_size": 320}}


@pytest.fixture(scope="module")
def rows():
    return dict(matrix_rows())


def test_the_docs_matrix_is_the_generated_one():
    text = DOC.read_text()
    assert MATRIX_BEGIN in text and MATRIX_END in text, "docs/models.md lost its matrix markers"
    documented = text[text.index(MATRIX_BEGIN):text.index(MATRIX_END) + len(MATRIX_END)]
    assert documented == matrix_markdown(), "docs/models.md's matrix differs from the code: paste `mlxcel models matrix`"


def test_every_family_a_table_names_has_a_row(rows):
    from mlxcel.config import RANDOM_FAMILIES
    from mlxcel.engine.model_slice import FAMILIES as PP, REFUSED
    from mlxcel.models.random_checkpoint import IN_PROCESS_FAMILIES
    from mlxcel.parallel.plan import FAMILIES as TP

    assert set(RANDOM_FAMILIES) | set(IN_PROCESS_FAMILIES) | set(PP) | set(REFUSED) | set(TP) == set(rows)


def test_the_last_families_mlx_lm_distributes_have_rows_with_every_cell_known(rows):
    """iquestloopcoder (refused for PP: its loop), longcat_flash_ngram and muse_spark are rows, not only in
    the refused list; each cell is asked of a model built from a tiny config, none left '?'."""
    assert rows["iquestloopcoder"]["PP"].ok is False
    assert rows["iquestloopcoder"]["DI"].cell() == "yes (KVCache, RotatingKVCache)"  # the two passes' caches
    assert rows["longcat_flash_ngram"]["PP"].cell() == rows["muse_spark"]["PP"].cell() == "yes"
    # the n-gram ids' cache holds int64, an ARRAY of dtype 5 in a window of ids (the probe of its tiny config)
    assert rows["longcat_flash_ngram"]["DI"].cell() == "yes (ArraysCache, CacheList)"
    assert rows["muse_spark"]["DI"].cell() == "yes (KVCache, RotatingKVCache)"
    assert rows["iquestloopcoder"]["TP"].cell() == rows["longcat_flash_ngram"]["TP"].cell() == "yes"  # shard()
    for family in ("iquestloopcoder", "longcat_flash_ngram", "muse_spark"):
        assert all(support.ok is not None for support in rows[family].values()), family


def test_each_column_follows_the_table_of_its_mode(rows):
    from mlxcel.config import RANDOM_FAMILIES
    from mlxcel.engine.model_slice import FAMILIES as PP
    from mlxcel.models.random_checkpoint import IN_PROCESS_FAMILIES
    from mlxcel.parallel.plan import FAMILIES as TP

    for family, support in rows.items():
        # a row, or the rule for a make-random family without one (its logits tested in test_families)
        made = family in RANDOM_FAMILIES + IN_PROCESS_FAMILIES
        assert support["PP"].ok is (module_of(family) in PP or made), family
        if support["PP"].ok:
            assert (support["PP"].detail == "by rule") is (module_of(family) not in PP), family
        assert support["single"].ok is True, family
        if family in TP:
            assert support["TP"].ok is True and support["TP"].detail == "", family
        elif support["TP"].ok:  # no row: the plain-layout rule took it
            assert support["TP"].detail == "by rule", family


def test_tp_by_rule_and_the_rules_refusal_say_so(rows):
    for family in ("olmo2", "smollm3", "granitemoe", "mixtral"):
        assert rows[family]["TP"].cell() == "yes (by rule)", family
    assert rows["phi3"]["TP"].ok is False
    from mlxcel.commands.support import family_config, tp_support

    assert tp_support(family_config("olmo2"), verbose=True).cell() == "yes (by rule; --tp-size 2)"
    assert "fused QKV projection" in tp_support(family_config("phi3"), verbose=True).detail


def test_the_handoff_column_names_the_cache_classes(rows):
    assert rows["qwen3_next"]["DI"].cell() == "yes (ArraysCache, KVCache)"
    assert rows["gemma3_text"]["DI"].cell() == "yes (KVCache, RotatingKVCache)"
    assert rows["deepseek_v3"]["DI"].cell() == "yes (KVCache)"  # MLA's latents
    assert rows["deepseek_v41"]["DI"].cell() == "yes (LayerCache)"  # record kind DSV41


def test_llama4s_chunked_caches_travel_and_it_slices_but_has_no_cut():
    support = di_support(LLAMA4)
    assert support.ok is True and support.detail == "ChunkedKVCache"  # CHUNKED records (docs/disagg.md)
    assert pp_support(LLAMA4).ok is True  # its text model, inside the wrapper (tests/engine/test_families.py)
    assert tp_support(LLAMA4).ok is False


def test_models_info_prints_the_modes_of_a_checkpoint(tmp_path, capsys):
    from mlxcel.cli import main
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    path = make_random_checkpoint(tmp_path / "qn", family="qwen3_next")
    assert main(["models", "info", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    modes = {line.split(":")[0]: line.split(":", 1)[1].strip() for line in out if line.startswith("mode ")}
    assert modes["mode single"] == "yes" and modes["mode PP"] == "yes"
    assert modes["mode DI"] == "yes (ArraysCache, KVCache)"
    assert modes["mode TP"].startswith("no (") and "qwen3_next" in modes["mode TP"]
    llama = make_random_checkpoint(tmp_path / "ll", family="llama")
    assert main(["models", "info", str(llama)]) == 0
    assert "mode TP:     yes (--tp-size 2)" in capsys.readouterr().out.splitlines()


def test_pp_by_rule_and_a_refusal_by_the_rule_say_so():
    """A plain decoder without a row is "by rule"; one that breaks the rule is refused with the rule's reason."""
    from mlxcel.models.random_checkpoint import _config

    base = _config("llama", 4, 64, 4, 2, 320, None, None)
    assert pp_support({**base, "model_type": "olmo2"}).cell() == "yes (by rule)"
    support = pp_support({**base, "model_type": "gemma"}, verbose=True)  # gemma (1): no row, a scaled embedding
    assert support.ok is False and support.detail == "it scales its embedding"
