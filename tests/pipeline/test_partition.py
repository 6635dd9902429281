"""Partitioning: --pp-layers validation, parameter bytes from safetensors headers, the min-bottleneck split, mlxcel plan."""

from __future__ import annotations

import itertools
import json
import random
import struct
from dataclasses import replace
from pathlib import Path

import pytest

from mlxcel.cli import main
from mlxcel.topology.partition import (
    PartitionError,
    StageCosts,
    human_bytes,
    layer_costs,
    parse_layer_ranges,
    parse_memory_list,
    parse_size,
    plan_stages,
    stages_for_ranges,
)
from tests.family_checkpoints import family_checkpoint  # noqa: F401  (fixture)

# --------------------------------------------------------------------------- helpers


def write_safetensors(path: Path, tensors: dict[str, int]) -> None:
    """A safetensors file whose tensors (uint8 vectors) have the given byte sizes; data is zeros."""
    header, offset = {"__metadata__": {"format": "mlx"}}, 0
    for name, size in tensors.items():
        header[name] = {"dtype": "U8", "shape": [size], "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def make_checkpoint(root: Path, layer_sizes: list[int], *, embed: int = 1000, norm: int = 10,
                    head: int | None = None, shards: int = 1, quantized: bool = False) -> Path:
    """config.json + safetensors (optionally sharded) with llama-style names; layer i weighs layer_sizes[i]."""
    tensors: dict[str, int] = {}
    parts = ("weight", "scales", "biases") if quantized else ("weight",)
    tensors.update({f"model.embed_tokens.{p}": embed // len(parts) for p in parts})
    for i, size in enumerate(layer_sizes):
        tensors[f"model.layers.{i}.input_layernorm.weight"] = 4
        for p in parts:
            tensors[f"model.layers.{i}.mlp.down_proj.{p}"] = (size - 4) // len(parts)
    tensors["model.norm.weight"] = norm
    if head is not None:
        tensors.update({f"lm_head.{p}": head // len(parts) for p in parts})
    root.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    for k in range(shards):
        chunk = {n: tensors[n] for n in names[k::shards]}
        write_safetensors(root / f"model-{k + 1:05d}-of-{shards:05d}.safetensors", chunk)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": len(layer_sizes)}))
    return root


def costs(layers: list[int], embed: int = 0, norm: int = 0, head: int = 0, tied: bool = False) -> StageCosts:
    return StageCosts(model="m", layers=tuple(layers), embed=embed, norm=norm, head=embed if tied else head, tied=tied)


# --------------------------------------------------------------------------- explicit ranges


def test_ranges_parse_inclusive_text_into_half_open_pairs():
    assert parse_layer_ranges("0-11,12-29", 30) == [(0, 12), (12, 30)]
    assert parse_layer_ranges(" 0 - 3 , 4 ,5-5", 6) == [(0, 4), (4, 5), (5, 6)]
    assert parse_layer_ranges("0-29", 30) == [(0, 30)]


@pytest.mark.parametrize("text,message", [
    ("0-11,13-29", "--pp-layers: stage 1 starts at 13 but stage 0 ended at 11 (ranges must be contiguous)"),
    ("0-11,10-29", "--pp-layers: stage 1 starts at 10 but stage 0 ended at 11 (ranges must not overlap)"),
    ("0-11,0-29", "stage 1 starts at 0 but stage 0 ended at 11 (ranges must not overlap)"),
    ("1-29", "--pp-layers: stage 0 starts at 1, but the first stage must start at layer 0"),
    ("0-11,,12-29", "--pp-layers: stage 1 is empty"),
    ("0-11,", "--pp-layers: stage 1 is empty"),
    ("0-11,29-12", "--pp-layers: stage 1: range 29-12 is reversed (start must be <= end)"),
    ("0-11,x", "--pp-layers: stage 1: 'x' is not a layer range (expected one inclusive range START-END, "
               "e.g. 0-11, or one layer, e.g. 7)"),
    ("0-11;12-29", "stage 0: '0-11;12-29' is not a layer range"),
    ("-1-29", "stage 0: '-1-29' is not a layer range"),
    ("", "--pp-layers: empty"),
    ("0-11,12-27", "--pp-layers: the last stage ends at 27 but the model has 30 layers (0-29): "
                   "the ranges must cover every layer"),
    ("0-11,12-30", "--pp-layers: stage 1 ends at 30 but the model has only 30 layers (0-29)"),
])
def test_bad_ranges_get_a_specific_message(text, message):
    with pytest.raises(PartitionError) as info:
        parse_layer_ranges(text, 30)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_range_messages_name_their_source():
    with pytest.raises(PartitionError, match=r"^nodes\[1\]\.layers: stage 0 starts at 2"):
        parse_layer_ranges("2-5", 6, source="nodes[1].layers")


# --------------------------------------------------------------------------- costs


def test_costs_group_layers_embedding_norm_and_head(tmp_path):
    ckpt = make_checkpoint(tmp_path / "m", [100, 200, 300], embed=1000, norm=10, head=2000, shards=2)
    c = layer_costs(ckpt)
    assert c.layers == (100, 200, 300) and c.embed == 1000 and c.norm == 10 and c.head == 2000
    assert not c.tied and c.total == 3610 and c.model == "m"
    assert c.stage_bytes(0, 1) == 1100  # embedding on the first stage
    assert c.stage_bytes(1, 3) == 2510  # norm + head on the last
    assert c.stage_bytes(0, 3) == 3610


def test_tied_head_charges_the_embedding_to_the_last_stage_too(tmp_path):
    c = layer_costs(make_checkpoint(tmp_path / "m", [100, 100], embed=1000, norm=10))
    assert c.tied and c.head == 1000 and c.total == 1210
    assert c.stage_bytes(0, 1) == 1100
    assert c.stage_bytes(1, 2) == 1110  # layer + norm + its copy of the embedding for the head
    assert c.stage_bytes(0, 2) == 1210  # one stage holds the matrix once


def test_quantized_tensors_count_weight_scales_and_biases(tmp_path):
    c = layer_costs(make_checkpoint(tmp_path / "m", [304, 604], embed=300, quantized=True))
    assert c.layers == (304, 604) and c.embed == 300


def test_costs_match_a_real_quantized_checkpoint(tmp_path):
    import mlx.core as mx

    from mlxcel.models.random_checkpoint import make_random_checkpoint

    ckpt = make_random_checkpoint(tmp_path / "q", family="llama", layers=3, quantize_bits=4)
    weights = mx.load(str(ckpt / "model.safetensors"))
    c = layer_costs(ckpt)
    layer0 = sum(v.nbytes for k, v in weights.items() if k.startswith("model.layers.0."))
    assert c.layers[0] == layer0 and len(c.layers) == 3
    assert {k.rsplit(".", 1)[1] for k in weights if k.startswith("model.layers.0.mlp.up_proj.")} == {
        "weight", "scales", "biases"}
    assert c.head == sum(v.nbytes for k, v in weights.items() if k.startswith("lm_head."))
    assert c.total == sum(v.nbytes for v in weights.values())


def test_uneven_layers_move_the_split(tmp_path):
    c = layer_costs(make_checkpoint(tmp_path / "m", [1000, 100, 100, 100, 100, 100], embed=4, norm=4, head=4))
    assert [(s.start, s.end) for s in plan_stages(c, 2)] == [(0, 1), (1, 6)]


@pytest.mark.parametrize("setup,message", [
    (lambda d: d.mkdir(), "no *.safetensors files"),
    (lambda d: None, "no such model directory"),
    (lambda d: (d.mkdir(), (d / "a.safetensors").write_bytes(b"\x05\x00")), "not a safetensors file"),
    (lambda d: (d.mkdir(), (d / "a.safetensors").write_bytes(struct.pack("<Q", 4) + b"{no")),
     "unreadable JSON header"),
    (lambda d: (d.mkdir(), (d / "a.safetensors").write_bytes(struct.pack("<Q", 1 << 40))), "over 100 MB"),
    (lambda d: (d.mkdir(), write_safetensors(d / "a.safetensors", {"model.embed_tokens.weight": 4,
                                                                    "model.layers.1.x": 4})),
     "no tensors for layer 0"),
    (lambda d: (d.mkdir(), write_safetensors(d / "a.safetensors", {"model.embed_tokens.weight": 4})),
     "no model.layers.<i>.* tensors"),
])
def test_unusable_checkpoints_are_refused(tmp_path, setup, message):
    setup(tmp_path / "c")
    with pytest.raises(PartitionError, match=message.replace("*", r"\*").replace(".", r"\.")):
        layer_costs(tmp_path / "c")


def test_config_layer_count_must_match_the_weights(tmp_path):
    ckpt = make_checkpoint(tmp_path / "m", [10, 10])
    (ckpt / "config.json").write_text(json.dumps({"num_hidden_layers": 3}))
    with pytest.raises(PartitionError, match="config.json says 3 layers but the weights hold 2"):
        layer_costs(ckpt)


# --------------------------------------------------------------------------- automatic split


def brute_force_bottleneck(c: StageCosts, n: int, memory: list[int] | None = None) -> int | None:
    best = None
    for cuts in itertools.combinations(range(1, c.num_layers), n - 1):
        bounds = list(zip((0, *cuts), (*cuts, c.num_layers)))
        sizes = [c.stage_bytes(a, b) for a, b in bounds]
        if memory and any(s > m for s, m in zip(sizes, memory)):
            continue
        best = max(sizes) if best is None else min(best, max(sizes))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_split_is_optimal_contiguous_and_deterministic(seed):
    rng = random.Random(seed)
    num_layers = rng.randint(1, 9)
    n = rng.randint(1, num_layers)
    c = costs([rng.randint(1, 100) for _ in range(num_layers)], embed=rng.randint(0, 300),
              norm=rng.randint(0, 5), head=rng.randint(0, 300), tied=rng.random() < 0.5)
    memory = [rng.randint(50, 600) for _ in range(n)] if seed % 2 else None
    expected = brute_force_bottleneck(c, n, memory)
    if expected is None:
        with pytest.raises(PartitionError, match=r"^(stage \d+ needs at least|the model needs)"):
            plan_stages(c, n, memory)
        return
    stages = plan_stages(c, n, memory)
    assert [s.index for s in stages] == list(range(n))
    assert stages[0].start == 0 and stages[-1].end == num_layers
    assert all(a.end == b.start for a, b in zip(stages, stages[1:])) and all(s.start < s.end for s in stages)
    assert max(s.bytes for s in stages) == expected
    assert all(s.bytes == c.stage_bytes(s.start, s.end) for s in stages)
    if memory:
        assert all(s.bytes <= m for s, m in zip(stages, memory))
    assert plan_stages(c, n, memory) == stages


def test_even_layers_split_evenly_with_embedding_and_head_at_the_ends():
    c = costs([10] * 30, embed=25, head=25)
    assert [s.layers for s in plan_stages(c, 2)] == ["0-14", "15-29"]
    c = costs([10] * 8, embed=20, head=0)
    assert [s.layers for s in plan_stages(c, 2)] == ["0-2", "3-7"]  # 50 + 50
    assert [s.layers for s in plan_stages(c, 3)] == ["0-1", "2-4", "5-7"]


def test_memory_moves_layers_to_the_larger_host():
    c = costs([10] * 10)
    assert [s.layers for s in plan_stages(c, 2, [30, 1000])] == ["0-2", "3-9"]


@pytest.mark.parametrize("memory,message", [
    ([15, 1000], "stage 0 needs at least 20 B (layer 0 and the embedding) but has 15 B of memory"),
    ([1000, 15], "stage 1 needs at least 35 B (layer 3 and the final norm and head) but has 15 B of memory"),
    ([1000, 5, 1000], "stage 1 needs at least 10 B (layer 1) but has 5 B of memory"),
    ([30, 30], "the model needs 75 B across 2 stages, but their memory adds up to 60 B"),
    ([25, 50], "stage 1 needs at least 55 B (layers 1-3 and the final norm and head) but has 50 B of memory"),
])
def test_impossible_memory_names_the_stage(memory, message):
    c = costs([10] * 4, embed=10, norm=5, head=20)
    with pytest.raises(PartitionError) as info:
        plan_stages(c, len(memory), memory)
    assert message in str(info.value)


def test_stage_count_must_fit_the_layers():
    with pytest.raises(PartitionError, match="cannot split 3 layers into 4 stages"):
        plan_stages(costs([1, 1, 1]), 4)
    with pytest.raises(PartitionError, match="cannot split 3 layers into 0 stages"):
        plan_stages(costs([1, 1, 1]), 0)


def test_explicit_ranges_are_priced():
    c = costs([10, 20, 30], embed=5, head=7)
    stages = stages_for_ranges(c, parse_layer_ranges("0,1-2", 3))
    assert [(s.layers, s.bytes) for s in stages] == [("0-0", 15), ("1-2", 57)]


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("text,value", [
    ("8GiB", 8 << 30), ("16GB", 16 * 10**9), ("512 MiB", 512 << 20), ("1.5gib", 3 << 29), ("100", 100),
    ("2KB", 2000), ("2KiB", 2048), ("3B", 3), ("7mb", 7 * 10**6),
])
def test_sizes_accept_decimal_and_binary_units(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "8 GiBs", "-1GiB", "0", "8XB", "1e9"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(PartitionError, match="^--memory: "):
        parse_size(text)


def test_memory_list_is_one_per_stage_or_one_for_all():
    assert parse_memory_list("8GiB", 3) == [8 << 30] * 3
    assert parse_memory_list("1KiB,2KiB", 2) == [1024, 2048]
    with pytest.raises(PartitionError, match="--memory: 2 values for 3 stages"):
        parse_memory_list("1KiB,2KiB", 3)


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 1023, 1536, 325651968, 3 << 40)] == [
        "0 B", "1023 B", "1.5 KiB", "310.6 MiB", "3.0 TiB"]


# --------------------------------------------------------------------------- mlxcel plan


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json_is_the_contract_shape(tmp_path, capsys):
    ckpt = make_checkpoint(tmp_path / "tiny", [100] * 4, embed=150, norm=10, head=140)
    code, out, err = run_cli(capsys, "plan", "-m", str(ckpt), "--pp-size", "2", "--json")
    assert code == 0, err
    assert json.loads(out) == {"model": "tiny", "num_layers": 4, "stages": [
        {"stage": 0, "layers": "0-1", "start": 0, "end": 2, "bytes": 350},
        {"stage": 1, "layers": "2-3", "start": 2, "end": 4, "bytes": 350},
    ]}


def test_plan_table_shows_layers_bytes_and_share(tmp_path, capsys):
    ckpt = make_checkpoint(tmp_path / "tiny", [1000] * 4, embed=3000, norm=0)
    code, out, _ = run_cli(capsys, "plan", "-m", str(ckpt), "--pp-size", "2", "--memory", "6KiB,8KiB")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("model: tiny (4 layers, 6.8 KiB of tensors; head tied to the embedding")
    assert lines[1].split() == ["stage", "layers", "bytes", "exact", "bytes", "share", "memory"]
    assert lines[2].split() == ["0", "0-1", "4.9", "KiB", "5000", "50.0%", "6.0", "KiB"]
    assert lines[3].split() == ["1", "2-3", "4.9", "KiB", "5000", "50.0%", "8.0", "KiB"]


@pytest.mark.parametrize("argv,message", [
    (["--pp-size", "9"], "cannot split 4 layers into 9 stages"),
    (["--pp-size", "2", "--memory", "1KiB,2KiB,3KiB"], "--memory: 3 values for 2 stages"),
    (["--pp-size", "2", "--memory", "lots"], "--memory: 'lots' is not a size"),
    (["--pp-size", "2", "--memory", "200B"], "the model needs"),
])
def test_plan_errors_are_one_line(tmp_path, capsys, argv, message):
    ckpt = make_checkpoint(tmp_path / "tiny", [100] * 4)
    code, out, err = run_cli(capsys, "plan", "-m", str(ckpt), *argv)
    assert code == 1 and out == ""
    assert err.startswith("mlxcel: error: ") and message in err and err.count("\n") == 1


def test_plan_missing_model_dir(tmp_path, capsys):
    code, _, err = run_cli(capsys, "plan", "-m", str(tmp_path / "nope"), "--pp-size", "2")
    assert code == 1 and "no such model directory" in err


def test_plan_needs_a_positive_stage_count(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", "-m", str(tmp_path), "--pp-size", "0"])
    assert info.value.code == 2
    assert "--pp-size: must be a positive integer, got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_plan_default_model(default_model, capsys):
    code, out, _ = run_cli(capsys, "plan", "-m", str(default_model), "--pp-size", "2", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["num_layers"] == 30
    assert [s["layers"] for s in plan["stages"]] == ["0-14", "15-29"]


def test_gemma4_kv_shared_layers_stay_on_the_stage_of_the_layer_whose_kv_they_read(family_checkpoint):  # noqa: F811
    """gemma-4 E2B's shape: the automatic split never starts a stage between a KV-shared layer and its source."""
    from mlxcel.topology.partition import joined_boundaries
    from tests.family_checkpoints import GEMMA4_E2B

    path = family_checkpoint("gemma4_text_e2b")  # 4 layers, layer 3 reads layer 2's KV
    costs = layer_costs(path)
    assert costs.joined == {3}
    assert [(s.start, s.end) for s in plan_stages(costs, 3)] == [(0, 1), (1, 2), (2, 4)]
    assert [(s.start, s.end) for s in plan_stages(replace(costs, joined=frozenset()), 3)] != [(0, 1), (1, 2), (2, 4)]
    with pytest.raises(PartitionError, match=r"cannot split 4 layers into 4 stages: gemma4_text layers 3-3 reuse "
                                             r"the KV caches of earlier layers \(num_kv_shared_layers 1\), so layers "
                                             r"2-3 stay on one stage"):
        plan_stages(costs, 4)
    # mlx-lm's default shape (35 layers, the last 20 KV-shared, every 5th layer global): sources 13 and 14
    e2b = {"model_type": "gemma4_text", "num_hidden_layers": 35, "num_kv_shared_layers": 20}
    assert joined_boundaries(e2b)[0] == frozenset(range(14, 35))
    assert joined_boundaries({**e2b, "num_kv_shared_layers": 0})[0] == frozenset()
    assert joined_boundaries({**GEMMA4_E2B, "model_type": "llama", "num_hidden_layers": 4})[0] == frozenset()
