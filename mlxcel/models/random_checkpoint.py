"""Tiny random-weight checkpoints of mlx-lm families (``RANDOM_FAMILIES``) for tests, benchmarks and rehearsals.

They load through the same path as real checkpoints; their output is noise by
construction, but shapes, caches, slicing and transport behave as for real ones.
Each is built by mlx-lm's own ModelArgs and Model classes from a config.json that
holds the common fields (``_config``) and the family's own (``FAMILY_FIELDS``):
few experts, small windows and ranks, so that every kind of layer the family has
(MoE, dense leading layers, sliding, global and linear attention) appears in 4 layers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxcel.config import RANDOM_FAMILIES

# families make-random also builds, tested in process only (pipeline slices, the handoff of a sliced cache:
# tests/engine/test_families.py, test_slice_rule.py), not by the cross-process suites that run every
# RANDOM_FAMILIES one: plain and hybrid decoders sliced by rule or a small row, and mlx-lm's pipelined ones
IN_PROCESS_FAMILIES = ("gemma2", "olmo2", "olmo3", "cohere2", "granitemoe", "smollm3", "seed_oss", "apertus",
                       "lfm2", "jamba", "granitemoehybrid", "deepseek_v2", "glm4_moe_lite", "mistral4",
                       "exaone_moe", "step3p5", "hunyuan", "falcon_h1", "longcat_flash", "kimi_k25", "minimax_m3_vl",
                       "llama4", "nemotron_h", "deepseek_v41")
# multimodal wrappers: their text model's fields under text_config (the text model_type given here)
WRAPPERS = {"kimi_k25": "kimi_k2", "minimax_m3_vl": "minimax_m3", "llama4": "llama4_text"}

from mlxcel.models.random_templates import PLAIN as CHAT_TEMPLATE, STOPS, TEMPLATES
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _tokenizer_json(extra: list[str] | None = None) -> dict:
    """A byte-level BPE over the 256 byte symbols, no merges, three special tokens (then ``extra`` ones)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for sym in sorted(alphabet):
        vocab[sym] = len(vocab)
    for special in extra or ():
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS + list(extra or ()))
    return json.loads(tok.to_str())


DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def _qwen3_5_linear() -> dict:
    """qwen3_5's gated delta net at a tiny scale, in layers 0 and 2 (full attention every 2nd layer)."""
    return {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 2}


def _mla(moe: int) -> dict:
    """deepseek-style MLA with small ranks and MoE (a shared expert) after a dense layer 0."""
    return {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": moe,
            "first_k_dense_replace": 1, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16, "v_head_dim": 16, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
            "norm_topk_prob": True}


def _family_fields(family: str, hidden: int, head_dim: int, intermediate: int) -> dict:
    """The fields ``family``'s ModelArgs needs beyond the common ones, at a tiny scale."""
    moe = max(intermediate // 2, 8)
    fields: dict[str, dict] = {
        "llama": {}, "qwen2": {}, "qwen3": {},
        "phi3": {"pad_token_id": 0},  # transformers' Phi3Config would default it to 32000, outside the vocabulary
        "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "moe_intermediate_size": moe, "norm_topk_prob": True},
        "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
        # global attention every 2nd layer, the others a window of 4 (so a few decode steps wrap it)
        "gemma3_text": {"sliding_window": 4, "sliding_window_pattern": 2, "query_pre_attn_scalar": head_dim,
                        "rope_local_base_freq": 10000.0},
        # MLA with small ranks; layer 0 dense (first_k_dense_replace), the others MoE with a shared expert
        "deepseek_v3": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                        "moe_intermediate_size": moe, "first_k_dense_replace": 1, "kv_lora_rank": 32,
                        "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
                        "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True},
        # attention sinks, sliding and full attention alternating, a window of 4
        "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4},
        "glm4_moe": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                     "moe_intermediate_size": moe, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                     "routed_scaling_factor": 1.0, "norm_topk_prob": True, "use_qk_norm": True,
                     "partial_rotary_factor": 0.5, "attention_bias": False, "rope_scaling": None},
        # linear attention (gated delta net) in layers 0 and 2, full attention in 1 and 3
        "qwen3_next": {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                       "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 4,
                       "num_experts_per_tok": 2, "decoder_sparse_step": 1, "shared_expert_intermediate_size": moe,
                       "mlp_only_layers": [], "moe_intermediate_size": moe, "partial_rotary_factor": 0.25,
                       "full_attention_interval": 2, "norm_topk_prob": True},
        "ernie4_5": {"use_bias": False},
        # layers 1-3 MoE (moe_layer_start_index 1) with a shared expert, layer 0 dense
        "ernie4_5_moe": {"use_bias": False, "moe_num_experts": 4, "moe_k": 2, "moe_layer_start_index": 1,
                         "moe_intermediate_size": moe, "moe_num_shared_experts": 1},
        "hunyuan_v1_dense": {"use_qk_norm": True, "attention_bias": False,
                             "rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"}},
        # sliding / full alternating (a window of 4); llama 4's position-dependent query scale, whose
        # original_max_position_embeddings of 4 makes it change within a few positions
        "ministral3": {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
                       "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                           "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 4}},
        "minimax": {"num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 0,
                    "rotary_dim": head_dim // 2, "use_qk_norm": True},
        # linear attention (gated delta net) in layers 0 and 2, full attention in 1 and 3; dense MLPs
        "qwen3_5": {**_qwen3_5_linear(), "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                             "partial_rotary_factor": 0.25}},
        "qwen3_5_moe": {**_qwen3_5_linear(), "num_experts": 4, "num_experts_per_tok": 2,
                        "shared_expert_intermediate_size": moe, "moe_intermediate_size": moe,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.25}},
        # deepseek_v3's MLA and MoE, plus the lightning indexer that keeps the top index_topk keys: a top-k
        # of 4 so that the sparse path (more than 4 keys) runs within a few positions
        "deepseek_v32": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                         "moe_intermediate_size": moe, "first_k_dense_replace": 1, "kv_lora_rank": 32,
                         "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
                         "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
                         "index_head_dim": 16, "index_n_heads": 2, "index_topk": 4},
        # Kimi Delta Attention (linear) in layers 0 and 2, NoPE MLA in 1 and 3, layer 0 dense and MoE after it
        # (a shared expert), attention residuals over blocks of 2 layers (so a block crosses stage boundaries)
        "kimi_k3": {"linear_attn_config": {"kda_layers": [1, 3], "num_heads": 2, "head_dim": 16,
                                           "short_conv_kernel_size": 4},
                    "attn_res_block_size": 2, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                    "qk_rope_head_dim": 8, "v_head_dim": 16, "num_experts": 4, "num_experts_per_token": 2,
                    "num_shared_experts": 1, "moe_intermediate_size": moe, "first_k_dense_replace": 1,
                    "num_expert_group": 1, "topk_group": 1},
        # sliding / full alternating (a window of 4), k = v in the global layers, one MoE block beside each
        # MLP (gemma-4-26B-A4B's shape); the E2B shape (per-layer inputs, KV-shared layers) is a row of its own in
        # tests/engine/test_families.py
        "gemma4_text": {"sliding_window": 4, "sliding_window_pattern": 2, "hidden_size_per_layer_input": 0,
                        "num_kv_shared_layers": 0, "global_head_dim": head_dim, "attention_k_eq_v": True,
                        "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                        "moe_intermediate_size": moe, "vocab_size_per_layer_input": 0},
        # plain decoders sliced by rule (mlxcel.engine.slice_rule), or a row for a scaled embedding / logits
        "gemma2": {"query_pre_attn_scalar": head_dim, "final_logit_softcapping": 5.0,
                   "attn_logit_softcapping": 50.0},
        "olmo2": {}, "seed_oss": {}, "smollm3": {"pad_token_id": 0},
        "olmo3": {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"] * 2},
        "cohere2": {"sliding_window": 4, "sliding_window_pattern": 2, "logit_scale": 0.5},
        "apertus": {"mlp_bias": False, "attention_bias": False, "post_norm": False, "qk_norm": True},
        "granitemoe": {"logits_scaling": 2.0, "attention_multiplier": 0.25, "embedding_multiplier": 3.0,
                       "residual_multiplier": 0.5, "attention_bias": False, "num_local_experts": 4,
                       "num_experts_per_tok": 2},
        # short convolutions (an ArraysCache each) in layers 0 and 2, full attention in 1 and 3
        "lfm2": {"norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "block_dim": hidden,
                 "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": False,
                 "layer_types": ["conv", "full_attention"] * 2},
        # Mamba in layers 0 and 2, attention in 1 and 3 (MoE there)
        "jamba": {"attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1,
                  "expert_layer_period": 2, "mamba_d_conv": 4, "mamba_d_state": 8, "mamba_expand": 2,
                  "num_experts": 4, "num_experts_per_tok": 2},
        # Mamba-2 in layers 0 and 2, attention in 1 and 3, MoE with a shared expert
        "granitemoehybrid": {"attention_bias": False, "embedding_multiplier": 3.0, "attention_multiplier": 0.25,
                             "logits_scaling": 2.0, "residual_multiplier": 0.5,
                             "layer_types": ["mamba", "attention"] * 2, "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_expand": 2,
                             "mamba_proj_bias": False, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_n_groups": 1,
                             "mamba_conv_bias": True, "num_local_experts": 4, "num_experts_per_tok": 2,
                             "shared_intermediate_size": moe},
        # families mlx-lm pipelines (PipelineMixin), sliced by rule or a row: MLA with small ranks, layer 0 dense
        "deepseek_v2": {**_mla(moe), "rope_scaling": {"type": "yarn", "factor": 1.0,
                                                      "original_max_position_embeddings": 2048}},
        "glm4_moe_lite": _mla(moe),
        "mistral4": {**_mla(moe), "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                      "llama_4_scaling_beta": 0.1,
                                                      "original_max_position_embeddings": 4}},
        # sliding (a window of 4) / full alternating; MoE after the dense layer 0
        "exaone_moe": {"num_experts": 4, "num_shared_experts": 1, "num_experts_per_tok": 2, "sliding_window": 4,
                       "moe_intermediate_size": moe, "layer_types": ["sliding_attention", "full_attention"] * 2,
                       "is_moe_layer": [False, True, True, True]},
        # cross-layer attention: layers 1 and 3 reuse the key / value projections of layers 0 and 2; MoE with a
        # shared MLP
        "hunyuan": {"attention_bias": False, "moe_topk": 2, "num_experts": 4, "num_shared_expert": 1,
                    "use_mixed_mlp_moe": True, "use_qk_norm": True, "use_cla": True, "cla_share_factor": 2,
                    "rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"}},
        # Mamba-2 and attention side by side in every layer; tied, so its head scales the logits
        "falcon_h1": {"mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8,
                      "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_expand": 2, "mamba_chunk_size": 4,
                      "tie_word_embeddings": True, "lm_head_multiplier": 0.5, "embedding_multiplier": 2.0},
        # two MLA sublayers per layer (a CacheList of their KV), MoE with 2 zero (identity) experts beside 4
        "longcat_flash": {"attention_method": "MLA", "zero_expert_type": "identity", "ffn_hidden_size": intermediate,
                          "moe_topk": 2, "expert_ffn_hidden_size": moe, "n_routed_experts": 4, "zero_expert_num": 2,
                          "num_layers": 4, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8,
                          "qk_nope_head_dim": 16, "v_head_dim": 16, "routed_scaling_factor": 1.0,
                          "mla_scale_q_lora": True, "mla_scale_kv_lora": True, "attention_bias": False},
        # wrappers (text_config): deepseek_v3's MLA and MoE under kimi_k25
        "kimi_k25": _mla(moe),
        # sparse attention (an indexer's keys beside the KV in each layer's CacheList) in layers 1 and 3, blocks
        # of 2 keys, the top 2 blocks kept, so the sparse path runs within a few positions; MoE (a shared expert) in 1-3
        "minimax_m3_vl": {"num_local_experts": 4, "num_experts_per_tok": 2, "dense_intermediate_size": intermediate,
                          "shared_intermediate_size": moe, "layer_types": ["full_attention", "minimax_m3_sparse"] * 2,
                          "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "index_n_heads": 2,
                          "index_head_dim": 16, "index_block_size": 2, "index_topk_blocks": 2},
        # chunked local attention (chunks of 4) in layers 0-2, global in 3 (every 4th); MoE every 2nd layer
        "llama4": {"attention_chunk_size": 4, "interleave_moe_layer_step": 2, "intermediate_size_mlp": intermediate,
                   "num_local_experts": 4, "num_experts_per_tok": 1, "use_qk_norm": True, "rope_scaling": None,
                   "attention_bias": False},
        # text model backbone: Mamba-2, attention, MLP, MoE layers by the pattern (caches in the first two only)
        "nemotron_h": {"hybrid_override_pattern": "ME*-", "attention_bias": False, "mamba_num_heads": 4,
                       "mamba_head_dim": 16, "mamba_proj_bias": False, "ssm_state_size": 8, "conv_kernel": 4,
                       "n_groups": 1, "mlp_bias": False, "layer_norm_epsilon": 1e-5, "use_bias": False,
                       "use_conv_bias": True, "moe_intermediate_size": moe,
                       "moe_shared_expert_intermediate_size": moe, "n_group": 1, "n_routed_experts": 4,
                       "n_shared_experts": 1, "topk_group": 1, "num_experts_per_tok": 2, "norm_topk_prob": True,
                       "routed_scaling_factor": 1.0},
        # hyper-connections (4 residual streams); a window of 4 beside rows pooled 4 to 1 in every layer, each
        # layer its own compressed-KV and index source (so no state crosses a stage boundary), top 2 of them
        "deepseek_v41": {"q_lora_rank": 32, "qk_rope_head_dim": 8, "o_groups": 2, "o_lora_rank": 32,
                         "moe_intermediate_size": moe, "n_routed_experts": 4, "num_experts_per_tok": 2,
                         "sliding_window": 4, "compress_ratios": [4] * 4, "kv_source_layer_ids": list(range(4)),
                         "index_source_layer_ids": list(range(4)), "index_n_heads": 2, "index_head_dim": 16,
                         "index_topk": 2, "hc_sinkhorn_iters": 4},
        "step3p5": {"num_attention_groups": 2, "sliding_window": 4, "moe_num_experts": 4, "moe_top_k": 2,
                    "moe_intermediate_size": moe, "share_expert_dim": moe},
    }
    if family not in fields:
        raise ValueError(f"family must be one of {', '.join(RANDOM_FAMILIES + IN_PROCESS_FAMILIES)}, got {family!r}")
    return fields[family]


TIED = {"qwen2", "qwen3", "gemma3_text", "gemma4_text", "ministral3"}  # families whose checkpoints share the embedding as the head


def _config(family: str, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int,
            intermediate: int | None, head_dim: int | None) -> dict:
    head_dim = head_dim or hidden // heads
    intermediate = intermediate or hidden * 2
    config = {
        "model_type": family,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": family in TIED,
        "bos_token_id": None,
        "eos_token_id": 2,
    }
    config.update(_family_fields(family, hidden, head_dim, intermediate))
    _per_layer(config, layers)
    if family in WRAPPERS:  # the text model's fields nest under text_config, as in a real wrapper's config
        text = {**config, "model_type": WRAPPERS[family]}
        return {"model_type": family, "text_config": text, "tie_word_embeddings": config["tie_word_embeddings"],
                "eos_token_id": config["eos_token_id"], "bos_token_id": None}
    return config


def _per_layer(config: dict, layers: int) -> None:
    """Fields listed per layer follow ``layers``: the family's two kinds (sliding / full, convolution or
    Mamba / attention, linear / MLA) alternating, as at 4."""
    if "layer_types" in config:
        pair = config["layer_types"][:2]
        config["layer_types"] = [pair[i % 2] for i in range(layers)]
    if "hybrid_override_pattern" in config:  # nemotron_h: the pattern repeated to ``layers``
        pattern = config["hybrid_override_pattern"]
        config["hybrid_override_pattern"] = (pattern * layers)[:layers]
    if "kv_source_layer_ids" in config:  # deepseek_v41: every layer compresses and indexes its own rows
        config.update(compress_ratios=[4] * layers, kv_source_layer_ids=list(range(layers)),
                      index_source_layer_ids=list(range(layers)))
    if "num_layers" in config:  # longcat_flash counts its layers so
        config["num_layers"] = layers
    if "mlp_layer_types" in config:  # minimax_m3_vl: layer 0 dense, MoE after it
        config["mlp_layer_types"] = ["dense"] + ["sparse"] * (layers - 1)
    linear = config.get("linear_attn_config")
    if linear is not None:
        config["linear_attn_config"] = {**linear, "kda_layers": [i + 1 for i in range(layers) if i % 2 == 0]}


def make_random_checkpoint(
    out_dir: str | Path,
    *,
    family: str = "llama",
    layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    quantize_bits: int | None = None,
    intermediate: int | None = None,
    vocab: int = 320,
    dtype: str = "float32",
    head_dim: int | None = None,
    group_size: int = 32,
    overrides: dict[str, Any] | None = None,
    template: str = "plain",
) -> Path:
    """Write config.json, model.safetensors and tokenizer files for a random model; return the dir.

    The tokenizer knows 259 tokens; a larger ``vocab`` (e.g. 49152 for SmolLM2's shape) only
    widens the embedding and head, which is what benchmarks of a model's shape need. ``dtype``
    (float32, bfloat16, float16) is that of every weight, and of a quantized model's scales and
    biases, so a "4-bit bfloat16" model computes in bfloat16 like a real one; ``head_dim``
    defaults to hidden / heads (Qwen3-0.6B: hidden 1024, 16 heads, head_dim 128). ``family`` is
    one of ``RANDOM_FAMILIES`` or ``IN_PROCESS_FAMILIES``. ``overrides`` replaces or adds config.json fields after the family's
    tiny defaults (e.g. ``{"num_experts": 128, "num_experts_per_tok": 8}`` for a Qwen3-30B-A3B shape).
    ``template`` picks the chat template and its marker tokens (``random_templates.TEMPLATES``).
    """
    from mlx_lm.utils import _get_classes

    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {', '.join(TEMPLATES)}, got {template!r}")
    chat_template, specials = TEMPLATES[template]
    if vocab < 259 + len(specials):
        raise ValueError(f"vocab must cover the tokenizer's {259 + len(specials)} tokens, got {vocab}")
    if vocab < 259:
        raise ValueError(f"vocab must cover the tokenizer's 259 tokens, got {vocab}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if head_dim is None and hidden % heads:
        raise ValueError(f"hidden ({hidden}) is not a multiple of heads ({heads}): give head_dim")
    fixed = {"model_type", "num_hidden_layers", "hidden_size", "vocab_size"} & set(overrides or {})
    if fixed:
        raise ValueError(f"give {', '.join(sorted(fixed))} with its own flag, not as an override")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(family, layers, hidden, heads, kv_heads, vocab, intermediate, head_dim)
    if template in STOPS:  # the template's own end tokens: after the 259 base tokens, in ``specials`` order
        config["eos_token_id"] = [config["eos_token_id"], *(259 + specials.index(t) for t in STOPS[template])]
    config.update(overrides or {})
    if dtype != "float32":  # float32 checkpoints stay as they always were
        config["torch_dtype"] = dtype
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    model.set_dtype(DTYPES[dtype])  # before quantizing: scales and biases take the weights' dtype
    if quantize_bits:
        nn.quantize(model, group_size=group_size, bits=quantize_bits)
        config["quantization"] = {"group_size": group_size, "bits": quantize_bits}
    weights = dict(tree_flatten(model.parameters()))
    if family in ("gemma3_text", "gemma4_text") and "lm_head.weight" in weights:  # tied as real gemma checkpoints: no lm_head, which mlx-lm's sanitize then drops
        weights.pop("lm_head.weight")
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "tokenizer.json").write_text(json.dumps(_tokenizer_json(specials)))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": chat_template,
        "eos_token": "<|im_end|>",
        "bos_token": None,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
    }, indent=2))
    return out
