"""Partition by real cost: each layer priced by its bytes and its kind, not counted.

A deepseek-like checkpoint (MLA, dense leading layers, then MoE) from a real random checkpoint's
headers and from DeepSeek-V3's config arithmetic; kimi_k3's mix (Kimi Delta Attention with MLA
every fourth layer, 15-16 GB MoE layers) from config arithmetic alone, no weights.
"""

from __future__ import annotations

import json

import pytest

from mlxcel.cli import main
from mlxcel.topology.layer_cost import LayerKind, layer_kinds
from mlxcel.topology.partition import (
    PartitionError,
    StageCosts,
    config_costs,
    layer_costs,
    plan_stages,
    read_safetensors_header,
)

GIB = 1 << 30
DEEPSEEK_V3 = {  # DeepSeek-V3's shape: 3 dense layers, then 58 MoE layers of 256 experts, 8 per token
    "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
    "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "vocab_size": 129280, "tie_word_embeddings": False,
}
KIMI_K3 = {  # kimi_k3's mix at about 1.4 TB in 4-bit: KDA, but MLA in every 4th layer; 512 experts, 16 per token
    "model_type": "kimi_k3", "hidden_size": 7168, "num_hidden_layers": 93, "num_attention_heads": 64,
    "num_key_value_heads": 64, "intermediate_size": 18432, "moe_intermediate_size": 2560, "num_experts": 512,
    "num_experts_per_token": 16, "num_shared_experts": 1, "first_k_dense_replace": 1,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "linear_attn_config": {"kda_layers": [i for i in range(1, 94) if i % 4], "num_heads": 64, "head_dim": 128,
                           "short_conv_kernel_size": 4},
    "vocab_size": 163840, "tie_word_embeddings": False,
}
Q4 = 4.5  # bits per weight of a 4-bit checkpoint: a 16-bit scale and bias per 64 weights


def bytes_only(c: StageCosts) -> StageCosts:
    """The same checkpoint priced by bytes alone (every layer's step = its weights, no caches)."""
    return StageCosts(c.model, c.layers, c.embed, c.norm, c.head, c.tied)


def ranges(stages) -> list[str]:
    return [s.layers for s in stages]


def heaviest_step(c: StageCosts, stages) -> int:
    return max(c.stage_step(s.start, s.end) for s in stages)


# --------------------------------------------------------------------------- deepseek-like


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    return make_random_checkpoint(tmp_path_factory.mktemp("ds"), family="deepseek_v3", layers=6)


def test_a_deepseek_checkpoints_moe_layers_are_charged_their_active_experts(deepseek):
    """From the headers: layer 0 is dense (all of it read), layers 1-5 MoE (2 of 4 experts read)."""
    config = json.loads((deepseek / "config.json").read_text())
    assert layer_kinds(config) == [LayerKind("mla")] + [LayerKind("mla", experts=4, active=2)] * 5
    c = layer_costs(deepseek)
    header = read_safetensors_header(deepseek / "model.safetensors")
    size = lambda name: header[name]["data_offsets"][1] - header[name]["data_offsets"][0]  # noqa: E731
    experts = sum(size(n) for n in header if n.startswith("model.layers.3.mlp.switch_mlp."))
    assert experts > 0 and c.kinds == ("mla+dense",) + ("mla+moe",) * 5
    assert c.active[0] == c.layers[0]  # dense: every weight, every step
    assert c.active[3] == c.layers[3] - experts // 2  # half the routed experts' weights are read
    assert c.layers[3] > c.layers[0] and c.cache == (0,) * 6  # context 0: no cache priced
    assert layer_costs(deepseek, rows=2).active[3] == c.layers[3]  # two rows x 2 experts can touch all 4


def test_deepseek_v3s_dense_layers_are_light_in_memory_but_not_in_a_step():
    c = config_costs(DEEPSEEK_V3, bits=Q4)
    assert c.kinds[:4] == ("mla+dense",) * 3 + ("mla+moe",)
    dense, moe = c.layers[0], c.layers[3]
    assert dense < 0.4 * GIB and 5.5 * GIB < moe < 6.5 * GIB  # held: 313 MiB against 6 GiB
    assert abs(c.active[0] - c.active[3]) < 0.01 * c.active[0]  # read per step: the same (18432 = 9 x 2048)
    by_kind, by_bytes = plan_stages(c, 4), plan_stages(bytes_only(c), 4)
    # by bytes, stage 0 takes an extra layer because its three dense layers weigh little; priced by
    # what a step reads, they cost as much as MoE layers, and the heaviest stage's step is lighter
    assert ranges(by_bytes) == ["0-16", "17-31", "32-46", "47-60"]
    assert ranges(by_kind) == ["0-15", "16-31", "32-46", "47-60"]
    assert heaviest_step(c, by_kind) < heaviest_step(c, by_bytes)


def test_a_stage_holds_its_caches_too():
    """At a long context each MLA layer's latent cache counts against the stage's memory."""
    short, long = config_costs(DEEPSEEK_V3, bits=Q4), config_costs(DEEPSEEK_V3, bits=Q4, context=131072, rows=4)
    assert long.cache[5] == 4 * 131072 * (512 + 64) * 2  # rows x tokens x (latent + rope key) x bfloat16
    fits = max(s.bytes for s in plan_stages(short, 4)) + GIB
    assert max(s.bytes for s in plan_stages(short, 4, [fits] * 4)) <= fits
    with pytest.raises(PartitionError, match="stage .* needs at least"):
        plan_stages(long, 4, [fits] * 4)  # 61 x 288 MiB of caches more do not fit the same memory


# --------------------------------------------------------------------------- kimi_k3's mix


def test_kimi_k3_kinds_mla_every_fourth_layer_and_15_to_16_gb_moe_layers():
    c = config_costs(KIMI_K3, bits=Q4, context=262144)
    assert [i for i, k in enumerate(c.kinds) if k.startswith("mla")] == list(range(3, 93, 4))
    assert c.kinds[0] == "linear+dense" and set(c.kinds[1:]) == {"linear+moe", "mla+moe"}
    assert all(15e9 < w < 16.1e9 for w in c.layers[1:])  # held: 15-16 GB each
    assert 1.3e12 < sum(c.layers) < 1.5e12  # about 1.4 TB
    assert all(a < 0.05 * w for a, w in zip(c.active[1:], c.layers[1:]))  # a step reads 16 of 512 experts
    mla, kda = c.cache[3], c.cache[4]
    assert mla == 262144 * (512 + 64) * 2 and kda == 64 * 128 * 128 * 4  # latent per token; fixed state
    longer = config_costs(KIMI_K3, bits=Q4, context=2 * 262144)
    assert longer.cache[3] == 2 * mla and longer.cache[4] == kda  # linear attention's state does not grow


def test_kimi_k3_plans_onto_eight_hosts_within_their_memory():
    c = config_costs(KIMI_K3, bits=Q4, context=262144, rows=8)
    memory = [190 * GIB] * 8
    stages = plan_stages(c, 8, memory)
    assert [s.start for s in stages][0] == 0 and stages[-1].end == 93
    assert all(s.bytes <= 190 * GIB for s in stages)  # weights + caches fit every host
    assert all(s.bytes == c.stage_bytes(s.start, s.end) and s.step == c.stage_step(s.start, s.end) for s in stages)
    counted = [(i * 93 // 8, (i + 1) * 93 // 8) for i in range(8)]  # the same count of layers per stage
    assert heaviest_step(c, stages) <= max(c.stage_step(a, b) for a, b in counted)
    with pytest.raises(PartitionError, match="the model needs"):
        plan_stages(c, 8, [170 * GIB] * 8)  # 1.4 TB of weights and the caches do not fit 8 x 170 GiB


# --------------------------------------------------------------------------- the CLI


def test_plan_prices_a_moe_checkpoint_by_kind(deepseek, capsys):
    assert main(["plan", "-m", str(deepseek), "--pp-size", "2", "--context", "1024", "--rows", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[-2:] == ["step", "reads"]
    assert out[-1] == "layer kinds: 0 mla+dense, 1-5 mla+moe"
    c = layer_costs(deepseek, context=1024, rows=2)
    assert c.cache[0] == 2 * 1024 * (32 + 8) * 4  # the float32 checkpoint caches float32 latents
