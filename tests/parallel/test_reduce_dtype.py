"""``--tp-reduce-dtype``: the all-reduces carry the chosen dtype, on rank 0 and on every follower.

In one process the group has one rank, so ``all_sum`` returns its input and the cast's rounding is
what remains: a layer set to bfloat16 returns exactly the bfloat16-rounded float32 product.
"""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxcel.parallel.errors import TPError
from mlxcel.parallel.reduce import CastShardedToAllLinear, reduced_layers, set_reduce_dtype

pytestmark = [pytest.mark.timeout(180), pytest.mark.proc]


def sharded(path):
    from mlx_lm.utils import load

    model, _ = load(str(path))
    model.shard(mx.distributed.init())  # a group of one: every all_sum is the identity
    return model


def test_bfloat16_rounds_every_reduced_output(tiny_llama):
    model = sharded(tiny_llama)
    x = mx.random.normal((2, 3, model.args.hidden_size), key=mx.random.key(0))
    o_proj = model.layers[0].self_attn.o_proj
    x = x[..., : o_proj.weight.shape[1]]
    exact = o_proj(x)
    tokens = mx.array([[5, 9, 17, 33]])
    before = model(tokens)

    assert set_reduce_dtype(model, "bfloat16") == 2 * len(model.layers)
    assert all(type(getattr(p, n)) is CastShardedToAllLinear for p, n in reduced_layers(model))
    rounded = o_proj(x)
    assert rounded.dtype == mx.float32
    assert mx.array_equal(rounded, exact.astype(mx.bfloat16).astype(mx.float32))
    assert not mx.array_equal(rounded, exact)
    after = model(tokens)
    assert not mx.array_equal(after, before) and mx.allclose(after, before, atol=0.1)


def test_model_dtype_changes_nothing(tiny_llama, tmp_path):
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    model = sharded(tiny_llama)
    assert set_reduce_dtype(model, "model") == 0 and set_reduce_dtype(model, "float32") == 0
    assert all(type(getattr(p, n)) is nn.ShardedToAllLinear for p, n in reduced_layers(model))
    bf16 = sharded(make_random_checkpoint(tmp_path / "bf16", family="llama", layers=2, dtype="bfloat16"))
    assert set_reduce_dtype(bf16, "bfloat16") == 0  # already the model's dtype: no cast
    assert set_reduce_dtype(bf16, "float32") == 4  # upcast: more exact sums, twice the bytes


def test_bad_names_and_unsharded_models_are_refused(tiny_llama):
    from mlx_lm.utils import load

    with pytest.raises(TPError, match="'float8' is not one of model, bfloat16, float32"):
        set_reduce_dtype(sharded(tiny_llama), "float8")
    with pytest.raises(TPError, match="no sharded-to-all layers"):
        set_reduce_dtype(load(str(tiny_llama))[0], "bfloat16")


def test_flag_needs_tensor_parallelism(tiny_llama):
    out = subprocess.run([sys.executable, "-m", "mlxcel", "generate", "-m", str(tiny_llama), "-p", "hi", "-n", "2",
                          "--tp-reduce-dtype", "bfloat16"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "--tp-reduce-dtype needs --tp-size above 1" in out.stderr


def test_rank_0s_dtype_reaches_every_follower(tiny_llama):
    """Rank 0 sends its choice in the hello reply and a follower shards with it. It must: a follower that
    kept float32 while rank 0 reduced in bfloat16 raised no error in a tp 2 run (MLX's ring backend
    does not compare the ranks' dtypes), so the mismatch would not show as a failure."""
    from mlxcel.parallel.follower import _load
    from mlxcel.parallel.options import TPOptions
    from mlxcel.parallel.plan import check_shardable
    from mlxcel.parallel.session import RankZero

    plan = check_shardable({"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2,
                            "intermediate_size": 128, "hidden_size": 64}, 2)
    rank0 = RankZero(TPOptions(size=2, plan=plan, reduce_dtype="bfloat16"), tiny_llama, None, max_batch_size=2,
                     prefix_cache_bytes=0)
    assert rank0.settings["reduce_dtype"] == "bfloat16"
    shard = _load(tiny_llama, 1, mx.distributed.init(), rank0.settings)
    layers = reduced_layers(shard.model)
    assert len(layers) == 8 and all(type(getattr(p, n)) is CastShardedToAllLinear for p, n in layers)
    assert all(getattr(p, n).reduce_dtype == mx.bfloat16 for p, n in layers)


def test_generate_at_tp_2_in_bfloat16(tiny_llama):
    out = subprocess.run([sys.executable, "-m", "mlxcel", "generate", "-m", str(tiny_llama), "-p", "The quick brown fox",
                          "-n", "12", "--temp", "0", "--tp-size", "2", "--tp-timeout", "20", "--tp-reduce-dtype",
                          "bfloat16"], capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and "error" not in out.stderr
