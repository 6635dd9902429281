"""Tensor parallelism by rule (``mlxcel.parallel.rule``): a family with no ``FAMILIES`` row shards when its
layers have the plain attention + MLP (+ experts) layout, and is refused with the reason otherwise.

TP 2 equals TP 1 to 1e-4 in float32 logits (a 4-token prefill, then 2 decode steps): two real rank
processes on the ring backend over loopback (one group for every case), each cut by ``apply_plan`` as a
follower is.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from mlxcel.parallel.errors import ShardRefusal
from mlxcel.parallel.families import FAMILIES
from mlxcel.parallel.plan import check_shardable
from tests.parallel.tp_logits import logits
from tests.parallel.ring_ranks import run_ranks

RULE_CASES = [("olmo2", None), ("smollm3", None), ("granitemoe", "within_expert"), ("granitemoe", "expert_parallel")]


def _config(family: str, **extra: object) -> dict:
    from mlxcel.commands.support import family_config

    config = family_config(family)
    assert config is not None
    return {**config, **extra}


def test_the_rule_families_have_no_row():
    assert not {f for f, _ in RULE_CASES} & set(FAMILIES)


@pytest.mark.parametrize("family,plan", [
    ("olmo2", "olmo2 (by rule) over 2 ranks: 2 of 4 heads, 1 of 2 KV heads, 64 of 128 MLP columns per rank"),
    ("smollm3", "smollm3 (by rule) over 2 ranks: 2 of 4 heads, 1 of 2 KV heads, 64 of 128 MLP columns per rank"),
    ("granitemoe", "granitemoe (by rule) over 2 ranks: 2 of 4 heads, 1 of 2 KV heads, 2 of 4 experts per rank"),
])
def test_the_rule_reads_the_dimensions_from_the_model(family, plan):
    assert check_shardable(_config(family), 2).describe() == plan


@pytest.mark.parametrize("family,reason", [
    ("phi3", "layer 0's self_attn.qkv_proj is a fused QKV projection"),
    ("lfm2", "layer 0 has no self_attn (its blocks: conv, feed_forward, operator_norm, ffn_norm)"),
    ("ernie4_5_moe", "layer 1's mlp has gate, shared_experts beside its routed experts"),
    ("apertus", "layer 0 has neither an mlp of gate/up/down projections nor a routed-experts block"),
])
def test_a_layout_the_rule_does_not_cut_is_refused_with_the_reason(family, reason):
    with pytest.raises(ShardRefusal) as err:
        check_shardable(_config(family), 2, "m")
    assert str(err.value).startswith(f"m: model family {family!r} is not supported by tensor parallelism: it has no "
                                     "row and the plain-layout rule refuses it: ")
    assert reason in str(err.value)


def test_attention_sinks_are_refused_by_name():
    """gpt_oss has a row; asked by rule (its model_type hidden) its per-head sinks are named."""
    from mlx_lm.models import gpt_oss

    from mlxcel.parallel.rule import read_layout

    model = gpt_oss.Model(gpt_oss.ModelArgs.from_dict(_config("gpt_oss")))
    with pytest.raises(ShardRefusal, match=re.escape("layer 0's self_attn has a parameter 'sinks'")):
        read_layout(model)


def test_the_rules_dimensions_must_divide():
    with pytest.raises(ShardRefusal, match=re.escape("does not shard across 4 ranks: KV heads (2) is not divisible "
                                                     "by 4")):
        check_shardable(_config("olmo2"), 4, "m")


def test_per_layer_head_counts_are_refused():
    from mlx_lm.models import olmo2

    from mlxcel.parallel.rule import read_layout

    model = olmo2.Model(olmo2.ModelArgs.from_dict(_config("olmo2", num_hidden_layers=2)))
    other = olmo2.Model(olmo2.ModelArgs.from_dict(_config("olmo2", num_hidden_layers=2, num_attention_heads=2,
                                                          num_key_value_heads=1)))
    model.layers[1].self_attn = other.layers[1].self_attn
    with pytest.raises(ShardRefusal, match=re.escape("layer 1's shapes (2 heads, 1 KV heads, 128 MLP width) differ "
                                                     "from layer 0's (per-layer head counts")):
        read_layout(model)
    model.layers[1].self_attn.n_kv_heads = 2  # counts that do not match the projections
    with pytest.raises(ShardRefusal, match=re.escape("layer 1's projections (32 query, 16 key rows) do not match "
                                                     "2 heads and 2 KV heads")):
        read_layout(model)


# --------------------------------------------------------------------------- tp 2 == tp 1, real ranks


_models: dict[str, Path] = {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    def get(family: str) -> Path:
        if family not in _models:
            _models[family] = make_random_checkpoint(tmp_path_factory.mktemp(family), family=family, layers=2)
        return _models[family]

    yield get
    _models.clear()


def sharded_logits(cases: list[tuple[Path, str | None]], out: Path, size: int = 2) -> list[list[np.ndarray]]:
    """Each case's logits on each rank, from ``size`` rank processes joined once by the ring backend on
    127.0.0.1 (``tests/parallel/tp_logits.py --jobs``)."""
    jobs = out / "jobs.json"
    jobs.write_text(json.dumps([[str(model), mode] for model, mode in cases]))
    run_ranks("tests.parallel.tp_logits", ["--jobs", str(jobs), str(out)], out, size, timeout=360, tail=2000)
    return [[np.load(out / f"rank{rank}-{i}.npy") for rank in range(size)] for i in range(len(cases))]


@pytest.fixture(scope="module")
def grouped(checkpoint, tmp_path_factory) -> dict[tuple[str, str | None], list[np.ndarray]]:
    """Every RULE_CASES row's logits on each rank, from one group of two rank processes."""
    found = sharded_logits([(checkpoint(f), m) for f, m in RULE_CASES], tmp_path_factory.mktemp("tp-rule"))
    return dict(zip(RULE_CASES, found))


@pytest.mark.proc
@pytest.mark.timeout(400)
@pytest.mark.parametrize("family,mode", RULE_CASES)
def test_tp_2_logits_equal_tp_1s(checkpoint, grouped, family, mode):
    single = logits(checkpoint(family))
    for rank in grouped[(family, mode)]:
        assert rank.shape == single.shape
        np.testing.assert_allclose(rank, single, atol=1e-4, rtol=0)


@pytest.mark.proc
@pytest.mark.timeout(400)
def test_generate_with_tp_size_2_runs_a_family_by_rule(checkpoint):
    """The real path: ``mlxcel generate --tp-size 2`` plans by rule (options.py), starts its follower, which
    plans and cuts the same way, and prints tp 1's greedy text."""
    from tests.parallel.test_tp_round_two import generate

    model = checkpoint("olmo2")
    single = generate(model)
    sharded = generate(model, "--tp-size", "2", "--tp-timeout", "120")
    assert "olmo2 (by rule) over 2 ranks: 2 of 4 heads, 1 of 2 KV heads, 64 of 128 MLP columns" in sharded.stderr
    assert sharded.stdout == single.stdout and len(single.stdout) > 1
