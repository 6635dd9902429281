"""Fixtures of the disaggregated tests: tiny checkpoints of every cache type a handoff meets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def _edit_config(path: Path, **changes: object) -> Path:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _model_checkpoint(tmp_path_factory: pytest.TempPathFactory, name: str, config: dict, seed: int) -> Path:
    """A checkpoint of ``config`` built with mlx-lm's own classes (seeded random weights), with the tokenizer
    files of a tiny llama from ``make_random_checkpoint``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from mlxcel.models.random_checkpoint import make_random_checkpoint

    path = make_random_checkpoint(tmp_path_factory.mktemp(name), family="llama", layers=1)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture(scope="session")
def tiny_sliding(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer llama whose odd layers attend over an 8-token sliding window (RotatingKVCache)."""
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    path = make_random_checkpoint(tmp_path_factory.mktemp("tiny-sliding"), family="llama", layers=4, seed=3)
    return _edit_config(path, sliding_window=8,
                        layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"])


@pytest.fixture(scope="session")
def tiny_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bfloat16 qwen3: its KV travels as raw bfloat16 bits."""
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    return make_random_checkpoint(tmp_path_factory.mktemp("tiny-bf16"), family="qwen3", layers=2, dtype="bfloat16")


@pytest.fixture(scope="session")
def tiny_mamba(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer mamba: a recurrent ArraysCache per layer (conv and SSM state), which travels whole."""
    config = {"model_type": "mamba", "vocab_size": 320, "hidden_size": 32, "intermediate_size": 64,
              "state_size": 4, "num_hidden_layers": 2, "conv_kernel": 4, "use_bias": False,
              "use_conv_bias": True, "time_step_rank": 4, "tie_word_embeddings": True,
              "max_position_embeddings": 2048, "eos_token_id": 2}
    return _model_checkpoint(tmp_path_factory, "tiny-mamba", config, 0)


@pytest.fixture(scope="session")
def tiny_llama4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer llama4: layers 0-2 chunked attention (ChunkedKVCache: CHUNKED records), layer 3 global (mlx-lm's
    llama4 reads cache[3] for its global mask, so fewer layers cannot run with a cache)."""
    text = {"attention_bias": False, "attention_chunk_size": 8, "head_dim": 16, "hidden_size": 32,
            "interleave_moe_layer_step": 4, "intermediate_size": 32, "intermediate_size_mlp": 64,
            "max_position_embeddings": 2048, "model_type": "llama4_text", "num_attention_heads": 2,
            "num_experts_per_tok": 1, "num_hidden_layers": 4, "num_key_value_heads": 1, "num_local_experts": 2,
            "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 10000.0, "use_qk_norm": False,
            "vocab_size": 320}
    config = {"model_type": "llama4", "text_config": text, "eos_token_id": 2, "max_position_embeddings": 2048}
    return _model_checkpoint(tmp_path_factory, "tiny-llama4", config, 0)


#: a 3-layer deepseek_v41 with a window of 8 rows: layer 0 pools 1 token into a compressed row, layer 1 pools 4
#: (compressed rows, index keys, an open group), layer 2 reads layer 1's (its LayerCache keeps the window alone)
DEEPSEEK_V41 = {"model_type": "deepseek_v41", "vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 3,
                "num_attention_heads": 4, "head_dim": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "o_groups": 2,
                "o_lora_rank": 32, "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
                "sliding_window": 8, "compress_ratios": [1, 4, 4], "kv_source_layer_ids": [0, 1],
                "index_source_layer_ids": [1, 2], "candidate_source_layer_id": 1, "candidate_topk_blocks": 1,
                "candidate_block_size": 2, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 2,
                "eos_token_id": 2, "max_position_embeddings": 2048}


@pytest.fixture(scope="session")
def tiny_deepseek_v41(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer deepseek_v41 (``DEEPSEEK_V41``): each layer keeps a LayerCache (window, compressed rows, index
    keys, open group), which a handoff carries as record kind DSV41."""
    return _model_checkpoint(tmp_path_factory, "tiny-deepseek-v41", DEEPSEEK_V41, 0)


@pytest.fixture(scope="session")
def tiny_deepseek_v32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer deepseek_v32 built with mlx-lm's own classes: every layer keeps a CacheList of two KVCaches
    (MLA's latents, the indexer's keys), and its indexer keeps 4 positions of longer prompts."""
    from mlxcel.models.random_checkpoint import _config

    config = {**_config("deepseek_v3", 4, 64, 4, 4, 320, None, None), "model_type": "deepseek_v32",
              "index_head_dim": 16, "index_n_heads": 2, "index_topk": 4}
    return _model_checkpoint(tmp_path_factory, "tiny-deepseek-v32", config, 7)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer gemma3_text built with mlx-lm's own classes: layers 0 and 2 keep an 8-token
    RotatingKVCache (gemma3's sliding layers), layers 1 and 3 a KVCache."""
    config = {"model_type": "gemma3_text", "vocab_size": 320, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
              "query_pre_attn_scalar": 16, "sliding_window": 8, "sliding_window_pattern": 2,
              "max_position_embeddings": 2048, "eos_token_id": 2}
    return _model_checkpoint(tmp_path_factory, "tiny-gemma3", config, 5)
