"""Layers every stage must hold (mlxcel.topology.stage_rules): bailing_hybrid's MLA layers. The planner never
makes a stage without one, and given ranges that do are refused by ``mlxcel plan --layers`` with the reason,
before any stage is built."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxcel.cli import main
from mlxcel.engine.model_slice import ModelSlice
from mlxcel.topology.partition import PartitionError, layer_costs, plan_stages, stages_for_ranges
from mlxcel.topology.stage_rules import bailing_mla_layers, needed_layers
from tests.engine.test_slice_rule import BAILING, build, decode_alike

# 6 layers in groups of 4: MLA in layer 3 (the group's 4th) and 4-5 (the tail), GLA in 0-2; a split by cost alone
# (0-2 | 3-5, or 0-1 | 2-3 | 4-5) leaves the first stage without an MLA layer
TAIL = {**BAILING, "layer_group_size": 4}


def bailing_checkpoint(tmp_path: Path) -> tuple[Path, object]:
    """A real bailing_hybrid checkpoint (its weights' names and sizes, config.json) of 6 layers, and its model."""
    model = build("bailing_hybrid", TAIL, layers=6)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = {**vars(model.args), "model_type": "bailing_hybrid"}
    (tmp_path / "config.json").write_text(json.dumps(config, default=str))
    return tmp_path, model


def test_the_mla_layers_are_mlx_lm_s():
    model = build("bailing_hybrid", TAIL, layers=6)
    assert bailing_mla_layers(vars(model.args)) == [i for i, layer in enumerate(model.model.layers) if layer.is_global]
    assert bailing_mla_layers(vars(model.args)) == [3, 4, 5]
    assert needed_layers({"model_type": "llama", "num_hidden_layers": 6}) == (frozenset(), "")


def test_gla_layers_are_priced_as_linear_attention():
    """GLA layers hold a fixed float32 state (heads x head_dim x head_dim), not MLA's latent per token; their
    weights by config arithmetic are the model's (norms aside)."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel.topology.layer_cost import cache_bytes, config_layer_bytes, layer_kinds

    model = build("bailing_hybrid", TAIL, layers=6)
    config = {**vars(model.args), "model_type": "bailing_hybrid"}
    kinds = layer_kinds(config)
    assert [k.attention for k in kinds] == ["linear"] * 3 + ["mla"] * 3
    cache = make_prompt_cache(model)
    model(mx.array([[5, 17, 90]]), cache=cache)
    state = cache[0].cache[0]
    assert cache_bytes(config, kinds[0], context=1000) == cache_bytes(config, kinds[0], context=10) == state.nbytes
    attention = sum(v.size for _, v in tree_flatten(model.model.layers[0].attention.parameters()))
    whole, _ = config_layer_bytes(config, kinds[0], bits=8)
    mlp = sum(v.size for _, v in tree_flatten(model.model.layers[0].mlp.parameters()))
    assert abs(whole - attention - mlp) <= 256  # norms and gates' small vectors


@pytest.mark.parametrize("n", [2, 3])
def test_mlxcel_plan_gives_stages_that_each_hold_an_mla_layer(tmp_path, capsys, n):
    """The plan's stages each hold an MLA layer, and they slice: chained, they decode as the whole model."""
    path, model = bailing_checkpoint(tmp_path)
    costs = layer_costs(path)
    assert costs.needs == {3, 4, 5} and "every stage must hold an MLA layer" in costs.needs_why
    assert main(["plan", "-m", str(path), "--pp-size", str(n), "--json"]) == 0
    ranges = [(s["start"], s["end"]) for s in json.loads(capsys.readouterr().out)["stages"]]
    assert len(ranges) == n and ranges[0][0] == 0 and ranges[-1][1] == 6
    assert all(any(a <= i < b for i in (3, 4, 5)) for a, b in ranges), ranges
    assert decode_alike(model, [ModelSlice(model, a, b) for a, b in ranges], steps=2) <= 1e-4


def test_generate_pp_size_splits_automatically_where_each_stage_holds_an_mla_layer(tmp_path, capsys):
    """``mlxcel generate --pp-size 3`` plans its stages (by cost alone, stage 0 would hold GLA layers only and be
    refused when built): each holds an MLA layer, and the text is the whole model's."""
    import shutil

    from mlxcel.models.random_checkpoint import make_random_checkpoint

    path, _ = bailing_checkpoint(tmp_path)
    tokenizer = make_random_checkpoint(tmp_path / "tokenizer", family="llama", layers=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, path / name)
    args = ["generate", "-m", str(path), "-p", "hello world", "--raw", "-n", "3"]
    assert main(args) == 0
    whole = capsys.readouterr().out
    assert main([*args, "--pp-size", "3"]) == 0
    piped = capsys.readouterr()
    assert "pipeline: stage 0 layers 0-3, stage 1 layers 4-4, stage 2 layers 5-5" in piped.err
    assert piped.out == whole


def test_more_stages_than_mla_layers_is_refused_with_the_reason(tmp_path):
    path, _ = bailing_checkpoint(tmp_path)
    with pytest.raises(PartitionError, match=r"cannot split 6 layers into 4 stages: bailing_hybrid's linear-attention "
                                             r"layers read the position from an MLA layer's cache"):
        plan_stages(layer_costs(path), 4)


def test_an_explicit_split_without_an_mla_layer_is_refused_by_name_at_planning(tmp_path, capsys):
    path, _ = bailing_checkpoint(tmp_path)
    assert main(["plan", "-m", str(path), "--pp-size", "2", "--layers", "0-2,3-5"]) == 1
    err = capsys.readouterr().err
    assert ("stage 0 (layers 0-2) holds none of the layers every stage needs: bailing_hybrid's linear-attention "
            "layers read the position from an MLA layer's cache of their stage, so every stage must hold an MLA "
            "layer (every 4th layer and the tail: layers 3, 4, 5)") in err
    assert main(["plan", "-m", str(path), "--pp-size", "2", "--layers", "0-3,4-5"]) == 0


def test_an_explicit_split_inside_gemma4_s_shared_kv_is_refused_at_planning_too():
    from mlxcel.topology.partition import StageCosts

    costs = StageCosts(model="m", layers=(1, 1, 1, 1), embed=1, norm=1, head=1, tied=False, joined=frozenset({3}),
                       joined_why="gemma4_text layers 3-3 reuse ...")
    with pytest.raises(PartitionError, match=r"stage 1 \(layers 3-3\) starts at layer 3: gemma4_text layers 3-3 reuse"):
        stages_for_ranges(costs, [(0, 3), (3, 4)])


# -- deepseek_v41: split points its shared attention state would cross --------------------------------------------

V41_SHAPES = [
    {},  # make-random's: every layer its own compressed-KV and index source
    {"index_source_layer_ids": [0, 2]},  # layers 1 and 3 read the top-k of 0 and 2
    {"kv_source_layer_ids": [0, 2], "index_source_layer_ids": [0, 1, 2, 3]},  # 1 and 3 read 0's and 2's rows
    {"compress_ratios": [0, 4, 0, 4], "index_source_layer_ids": [1], "candidate_source_layer_id": 1},
    {"index_source_layer_ids": [0, 1, 2, 3], "candidate_source_layer_id": 0},  # candidate blocks of layer 0
]


@pytest.mark.parametrize("shape", V41_SHAPES)
def test_deepseek_v41_split_points_are_mlx_lm_s_crossings(shape):
    """From config.json alone, the stage starts whose layers read state computed before them: exactly those where
    mlx-lm's own pipeline sends shared state (``_crossing``), which a boundary here does not carry."""
    from mlx_lm.models.deepseek_v41 import ModelArgs, _crossing

    from mlxcel.models.random_checkpoint import _config
    from mlxcel.topology.stage_rules import deepseek_v41_joined

    config = {**_config("deepseek_v41", 4, 64, 4, 2, 320, None, None), **shape}
    args = ModelArgs.from_dict(config)
    joined, why = deepseek_v41_joined(config)
    assert joined == {b for b in range(1, 4) if _crossing(args, b)}
    assert bool(why) == bool(joined)


def test_the_planner_keeps_deepseek_v41_s_shared_state_on_one_stage_and_refuses_a_split_across_it(tmp_path, capsys):
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    path = make_random_checkpoint(tmp_path, family="deepseek_v41", overrides={"index_source_layer_ids": [0, 2]})
    costs = layer_costs(path)
    assert costs.joined == {1, 3}
    assert [(s.start, s.end) for s in plan_stages(costs, 2)] == [(0, 2), (2, 4)]
    with pytest.raises(PartitionError, match=r"cannot split 4 layers into 3 stages: deepseek_v41's later layers read "
                                             r"attention state .* no stage starts at layers 1 \(topk_idx of layer 0\), "
                                             r"3 \(topk_idx of layer 2\)"):
        plan_stages(costs, 3)
    assert main(["plan", "-m", str(path), "--pp-size", "2", "--layers", "0-2,3-3"]) == 1
    assert "stage 1 (layers 3-3) starts at layer 3: deepseek_v41's later layers read" in capsys.readouterr().err
