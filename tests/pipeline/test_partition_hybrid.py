"""Partition by cost for the hybrid and new attention kinds: Mamba and short-convolution layers, a
sliding layer with its own head counts, zero experts and deepseek_v41's compressed attention.

A jamba-like headers-only checkpoint (config.json and safetensors headers, no tensor data the plan
reads) through ``mlxcel plan``; the others from config arithmetic.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from mlxcel.cli import main
from mlxcel.topology.layer_cost import LayerKind, cache_bytes, layer_kinds
from mlxcel.topology.partition import config_costs, layer_costs, plan_stages

JAMBA = {  # Jamba-v0.1's shape, 8 layers: attention at 4, MoE (16 experts, 2 a token) at every odd layer
    "model_type": "jamba", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 8,
    "num_attention_heads": 32, "num_key_value_heads": 8, "attn_layer_offset": 4, "attn_layer_period": 8,
    "expert_layer_offset": 1, "expert_layer_period": 2, "mamba_d_conv": 4, "mamba_d_state": 16, "mamba_expand": 2,
    "num_experts": 16, "num_experts_per_tok": 2, "vocab_size": 65536, "tie_word_embeddings": False,
}
DEEPSEEK_V41 = {  # deepseek_v41's defaults, 4 layers: a 128-token window; rows pooled 1, 4 and 128 to 1
    "model_type": "deepseek_v41", "hidden_size": 5120, "num_hidden_layers": 4, "num_attention_heads": 64,
    "head_dim": 512, "q_lora_rank": 1280, "qk_rope_head_dim": 64, "o_groups": 8, "o_lora_rank": 1024,
    "moe_intermediate_size": 2304, "n_routed_experts": 384, "num_experts_per_tok": 6, "n_shared_experts": 1,
    "sliding_window": 128, "compress_ratios": [1, 4, 128, 4], "index_head_dim": 128, "vocab_size": 129280,
}


def test_jamba_kinds_mamba_layers_attention_every_eighth_experts_every_other():
    kinds = layer_kinds(JAMBA)
    assert [k.name for k in kinds] == ["mamba+dense", "mamba+moe"] * 2 + ["full+dense", "mamba+moe",
                                                                          "mamba+dense", "mamba+moe"]
    assert kinds[1] == LayerKind("mamba", experts=16, active=2)


def test_a_mamba_layers_state_does_not_grow_with_the_context():
    mamba, full = layer_kinds(JAMBA)[0], layer_kinds(JAMBA)[4]
    inner = 2 * 4096
    state = 3 * inner * 2 + inner * 16 * 4  # (kernel - 1) x inner bfloat16 + inner x d_state float32
    assert cache_bytes(JAMBA, mamba, context=1024) == cache_bytes(JAMBA, mamba, context=65536) == state
    assert cache_bytes(JAMBA, full, context=1024) == 1024 * 2 * 8 * 128 * 2


def test_deepseek_v41_compressed_layers_hold_a_window_and_pooled_rows():
    kinds = layer_kinds(DEEPSEEK_V41)
    assert [(k.attention, k.ratio, k.window) for k in kinds] == [("compressed", r, 128) for r in (1, 4, 128, 4)]
    assert all(k.experts == 384 for k in kinds)
    c = config_costs(DEEPSEEK_V41, context=4096)
    assert c.cache[0] == 128 * 512 * 2  # the window only: each token its own row
    assert c.cache[1] == (128 + 1024) * 512 * 2 + 1024 * 128 * 2  # window + 4096 / 4 rows and their index keys
    assert c.cache[2] == (128 + 32) * 512 * 2 + 32 * 128 * 2


def test_sliding_layers_with_their_own_heads_and_zero_experts():
    step = {"model_type": "step3p5", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
            "num_attention_groups": 2, "head_dim": 32, "intermediate_size": 512, "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"], "vocab_size": 100,
            "attention_other_setting": {"num_attention_heads": 4, "num_attention_groups": 4}}
    sliding, full = layer_kinds(step)
    assert (sliding.heads, sliding.kv_heads, full.kv_heads) == (4, 4, None)
    c = config_costs(step, context=64)
    assert c.cache == (16 * 2 * 4 * 32 * 2, 64 * 2 * 2 * 32 * 2)  # its own KV heads over the window
    zero = {"model_type": "longcat_flash", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
            "intermediate_size": 128, "expert_ffn_hidden_size": 32, "n_routed_experts": 8, "zero_expert_num": 8,
            "num_experts_per_tok": 4, "vocab_size": 10}
    kind = layer_kinds(zero)[0]
    assert kind.zero == 8 and kind.touched(1) == 2.0  # half of the 4 picks are zero experts: no weight read
    c = config_costs(zero)
    experts = 8 * 3 * 64 * 32 * 2
    assert c.active[0] == c.layers[0] - experts + experts * 2 // 8


def _headers_only(path: Path, config: dict, tensors: dict[str, tuple[str, list[int]]]) -> Path:
    """A checkpoint the plan can read: config.json and a safetensors file whose header names every tensor
    (the data after it is zeros: the plan reads only the header)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = 2
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return path


def _tiny_jamba_tensors(config: dict) -> dict[str, tuple[str, list[int]]]:
    d, inner, e = config["hidden_size"], 2 * config["hidden_size"], config["num_experts"]
    out = {"model.embed_tokens.weight": ("BF16", [config["vocab_size"], d]),
           "model.final_layernorm.weight": ("BF16", [d]), "lm_head.weight": ("BF16", [config["vocab_size"], d])}
    for i, kind in enumerate(layer_kinds(config)):
        p = f"model.layers.{i}."
        if kind.attention == "mamba":
            out[p + "mamba.in_proj.weight"] = ("BF16", [2 * inner, d])
            out[p + "mamba.out_proj.weight"] = ("BF16", [d, inner])
        else:
            out[p + "self_attn.q_proj.weight"] = ("BF16", [d, d])
            out[p + "self_attn.o_proj.weight"] = ("BF16", [d, d])
        if kind.experts:
            out[p + "feed_forward.switch_mlp.gate_proj.weight"] = ("BF16", [e, 128, d])
            out[p + "feed_forward.router.weight"] = ("BF16", [e, d])
        else:
            out[p + "feed_forward.gate_proj.weight"] = ("BF16", [128, d])
    return out


def test_plan_prices_a_jamba_checkpoint_by_kind(tmp_path, capsys):
    config = {**JAMBA, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "mamba_d_state": 4, "num_experts": 4, "vocab_size": 256}
    model = _headers_only(tmp_path / "jamba", config, _tiny_jamba_tensors(config))
    assert main(["plan", "-m", str(model), "--pp-size", "2", "--context", "1024"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == ("layer kinds: 0 mamba+dense, 1 mamba+moe, 2 mamba+dense, 3 mamba+moe, 4 full+dense, "
                       "5 mamba+moe, 6 mamba+dense, 7 mamba+moe")
    c = layer_costs(model, context=1024)
    assert c.cache[0] == c.cache[1] == 3 * 128 * 2 + 128 * 4 * 4  # a Mamba layer's fixed state
    assert c.cache[4] == 1024 * 2 * 2 * 16 * 2  # the attention layer's keys and values
    assert c.active[1] < c.layers[1]  # 2 of 4 experts read a step
    assert [s.end for s in plan_stages(c, 2)][-1] == 8
