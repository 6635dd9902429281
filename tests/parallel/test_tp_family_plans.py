"""Each family row's plan and cut, in process: refusals name what does not divide, modes that do not
apply are refused, and a cut model holds the per-rank share the plan promises (E/N whole experts under
``expert_parallel``, 1/N of every expert's width under ``within_expert``, the LM head whole)."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

from mlxcel.cli import build_parser
from mlxcel.models.loading import load_checkpoint
from mlxcel.models.random_checkpoint import _config
from mlxcel.parallel.errors import ShardRefusal, TPError
from mlxcel.parallel.experts import LocalExperts
from mlxcel.parallel.families import FAMILIES
from mlxcel.parallel.options import TPFlags, prepare_tp
from mlxcel.parallel.plan import apply_plan, check_shardable
from tests.parallel.test_tp_round_two import ROUND_TWO


def tiny(family: str, **fields) -> dict:
    """The config.json ``make-random`` writes for ``family`` (4 layers, hidden 64, 4 heads, 2 KV heads)."""
    return {**_config(family, 4, 64, 4, 2, 320, None, None), **fields}


def refused(config: dict, size: int, mode: str | None = None) -> str:
    with pytest.raises(ShardRefusal) as err:
        check_shardable(config, size, "m", moe_mode=mode)
    return str(err.value)


def test_every_family_row_names_a_cut():
    assert all(f.shard in ("mlx-lm", "mlxcel") for f in FAMILIES.values())
    from mlx_lm.utils import _get_classes

    for name, family in FAMILIES.items():  # "mlx-lm" only where the class has shard(), "mlxcel" only where not
        if name == "mistral" or name in ROUND_TWO:  # no make-random config (test_tp_round_two checks their hooks)
            continue
        has = hasattr(_get_classes(tiny(name))[0], "shard")
        assert has == (family.shard == "mlx-lm"), name


def test_moe_plans_by_mode():
    assert check_shardable(tiny("qwen3_moe"), 2).describe() == (
        "qwen3_moe over 2 ranks: 2 of 4 heads, 1 of 2 KV heads, 2 of 4 experts per rank")
    assert check_shardable(tiny("qwen3_moe"), 2, moe_mode="within_expert").describe() == (
        "qwen3_moe over 2 ranks: 2 of 4 heads, 1 of 2 KV heads, 32 of 64 expert columns, all 4 experts per rank")
    assert check_shardable(tiny("llama"), 2).moe_mode is None


def test_experts_that_do_not_divide_are_named():
    msg = refused(tiny("deepseek_v3", n_routed_experts=6), 4)
    assert msg.startswith("m does not shard across 4 ranks: routed experts (n_routed_experts) (6) is not divisible "
                          "by 4 (--tp-moe-mode within_expert splits each expert's width instead)")
    assert "6 routed experts" in msg and "--tp-size values that work: 1, 2)" in msg
    wide = tiny("gpt_oss", intermediate_size=20, num_attention_heads=8, num_key_value_heads=8)
    msg = refused(wide, 8, "within_expert")
    assert msg.startswith("m does not shard across 8 ranks: expert width (intermediate_size) (20) is not divisible "
                          "by 8 (--tp-moe-mode expert_parallel places whole experts instead)")
    assert "routed experts" in refused(wide, 8)  # 4 whole experts do not split over 8 ranks either
    assert check_shardable(wide, 4, moe_mode="within_expert").size == 4


@pytest.mark.parametrize("family,fields,size,dimension", [
    ("qwen3_5", {"linear_num_key_heads": 3}, 2, "linear attention key heads (3)"),
    ("qwen3_5", {"linear_num_key_heads": 4, "linear_num_value_heads": 6}, 4, "linear attention value heads (6)"),
    ("kimi_k3", {"linear_attn_config": {"kda_layers": [1, 3], "num_heads": 3, "head_dim": 16,
                                        "short_conv_kernel_size": 4}}, 2, "linear attention heads (3)"),
    ("deepseek_v3", {"num_attention_heads": 6}, 4, "attention heads (6)"),
    ("glm4_moe", {"moe_intermediate_size": 15, "n_shared_experts": 1}, 2, "shared expert width (15)"),
    ("gemma4_text", {"num_global_key_value_heads": 3}, 2, "global KV heads (3)"),
    ("ernie4_5", {"intermediate_size": 90, "num_key_value_heads": 4}, 4, "intermediate size (90)"),
    ("minimax", {"num_key_value_heads": 3}, 2, "KV heads (3)"),
])
def test_each_familys_dimensions_are_named(family, fields, size, dimension):
    assert re.match(re.escape(f"m does not shard across {size} ranks: {dimension} is not divisible by {size}"),
                    refused(tiny(family, **fields), size))


def test_qwen3_5_kv_heads_may_be_repeated():
    """mlx-lm repeats qwen3_5's KV heads when there are fewer than ranks: N may be a multiple of them."""
    assert check_shardable(tiny("qwen3_5", num_key_value_heads=1), 2).size == 2
    assert "KV heads (3) is not divisible by 2 or divide" in refused(tiny("qwen3_5", num_key_value_heads=3,
                                                                         num_attention_heads=6), 2)


def test_a_mode_that_does_not_apply_is_refused():
    assert refused(tiny("llama"), 2, "within_expert") == (
        "m: --tp-moe-mode within_expert does not apply: this llama checkpoint has no routed experts "
        "(leave --tp-moe-mode out)")
    assert check_shardable(tiny("llama"), 2, moe_mode="expert_parallel").moe_mode is None  # the default: harmless
    dense_qwen3_5 = tiny("qwen3_5")
    assert "has no routed experts" in refused(dense_qwen3_5, 2, "within_expert")
    dense_gemma4 = tiny("gemma4_text", enable_moe_block=False)  # experts configured but switched off
    assert "has no routed experts" in refused(dense_gemma4, 2, "within_expert")
    assert check_shardable(dense_gemma4, 2).moe_mode is None


def test_reduce_dtype_is_refused_where_blocks_reduce_inside(tmp_path):
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    model = make_random_checkpoint(tmp_path / "m", family="qwen3_moe", layers=2)
    args = build_parser().parse_args(["generate", "-m", str(model), "-p", "x", "--tp-size", "2",
                                      "--tp-reduce-dtype", "bfloat16"])
    import json

    with pytest.raises(TPError, match=r"^--tp-reduce-dtype bfloat16 does not apply to this qwen3_moe checkpoint"):
        prepare_tp(TPFlags.from_cli_args(vars(args)), model, json.loads((model / "config.json").read_text()))


def test_moe_mode_flag_reaches_the_plan(tmp_path):
    import json

    from mlxcel.models.random_checkpoint import make_random_checkpoint

    model = make_random_checkpoint(tmp_path / "m", family="gpt_oss", layers=2)
    config = json.loads((model / "config.json").read_text())
    for flags, mode in (([], "expert_parallel"), (["--tp-moe-mode", "within_expert"], "within_expert")):
        args = build_parser().parse_args(["generate", "-m", str(model), "-p", "x", "--tp-size", "2", *flags])
        assert prepare_tp(TPFlags.from_cli_args(vars(args)), model, config).plan.moe_mode == mode


class Group:
    """What a cut reads of a group (its size and rank); the forward is not run."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _experts_weight(switch) -> mx.array:
    inner = switch.inner if isinstance(switch, LocalExperts) else switch
    return inner.gate_proj["weight"]


@pytest.mark.parametrize("family,block,switch", [("qwen3_moe", "mlp", "switch_mlp"), ("gpt_oss", "mlp", "experts"),
                                                 ("gemma4_text", "experts", "switch_glu")])
@pytest.mark.parametrize("mode", ["expert_parallel", "within_expert"])
def test_a_cut_rank_holds_its_share_of_the_experts(tmp_path, family, block, switch, mode):
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    path = make_random_checkpoint(tmp_path / family, family=family, layers=2)
    whole = load_checkpoint(path).model
    before = _experts_weight(getattr(getattr(whole.layers[1], block), switch))
    loaded = load_checkpoint(path, lazy=True)
    plan = check_shardable(loaded.config, 2, moe_mode=mode)
    apply_plan(loaded.model, plan, Group(1, 2))
    moe = getattr(loaded.model.layers[1], block)
    moe = getattr(moe, "inner", moe)  # gemma4's block is wrapped in mlxcel's all-reduce
    after = getattr(moe, switch)
    w = _experts_weight(after)
    if mode == "expert_parallel":
        assert isinstance(after, LocalExperts) and (after.start, after.count) == (2, 2)
        assert w.shape == (2, *before.shape[1:]) and mx.array_equal(w, before[2:4])
    else:
        assert not isinstance(after, LocalExperts)
        assert w.shape == (4, before.shape[1] // 2, before.shape[2])
        assert mx.array_equal(w, before[:, before.shape[1] // 2:])
    assert loaded.model.layers[1].self_attn.q_proj.weight.shape[0] == whole.layers[1].self_attn.q_proj.weight.shape[0] // 2


def test_qwen3_5s_head_stays_whole(tmp_path):
    """mlx-lm's qwen3_5 shard() splits an untied head by vocabulary; --tp-lm-head-mode replicated keeps it whole."""
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    loaded = load_checkpoint(make_random_checkpoint(tmp_path / "q", family="qwen3_5", layers=2), lazy=True)
    apply_plan(loaded.model, check_shardable(loaded.config, 2), Group(0, 2))
    lm = loaded.model.language_model
    assert type(lm.lm_head).__name__ == "Linear" and lm.lm_head.weight.shape == (320, 64)
    assert lm.sharding_group is None


def _table_families(text: str, heading: str) -> tuple[set[str], set[str]]:
    """(families of the rows that say yes / a cut, families of the refused rows) of the table under ``heading``."""
    lines = text.split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    rows = [line for line in lines[start:end] if line.startswith("| `")]
    yes, no = set(), set()
    for row in rows:
        cells = row.split("|")
        names = set(re.findall(r"`([a-z0-9_]+)`", cells[1]))
        (no if "refused" in row else yes).update(names)
    return yes, no


def test_docs_name_every_tp_family():
    """docs/models.md's TP column and docs/tp.md's family table say what FAMILIES says."""
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs"
    yes, no = _table_families((docs / "models.md").read_text(), "### Tensor parallelism (`--tp-size`)")
    assert yes == set(FAMILIES) and not (no & set(FAMILIES))
    tp_yes, _ = _table_families((docs / "tp.md").read_text(), "## Supported families")
    assert tp_yes == set(FAMILIES)
    for name, family in FAMILIES.items():  # the cut column
        row = next(line for line in (docs / "tp.md").read_text().splitlines()
                   if line.startswith("| `") and f"`{name}`" in line.split("|")[1])
        assert row.split("|")[2].strip() == family.shard, name


@pytest.mark.parametrize("mode", ["expert_parallel", "within_expert"])
def test_rank_0s_moe_mode_reaches_every_follower(tmp_path, mode):
    """A follower cuts with the mode in rank 0's hello reply, not its own flags (a mismatch would sum
    1/N-wide expert outputs with whole-expert ones without any error)."""
    from mlxcel.models.random_checkpoint import make_random_checkpoint
    from mlxcel.parallel.follower import _load
    from mlxcel.parallel.options import TPOptions
    from mlxcel.parallel.session import RankZero

    path = make_random_checkpoint(tmp_path / "m", family="qwen3_moe", layers=2)
    import json

    plan = check_shardable(json.loads((path / "config.json").read_text()), 1, moe_mode=mode)
    rank0 = RankZero(TPOptions(size=1, plan=plan), path, None, max_batch_size=2, prefix_cache_bytes=0)
    assert rank0.settings["moe_mode"] == mode
    shard = _load(path, 1, mx.distributed.init(), rank0.settings)
    switch = shard.model.layers[0].mlp.switch_mlp
    assert isinstance(switch, LocalExperts) == (mode == "expert_parallel")
