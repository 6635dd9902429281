"""deepseek_v41 in pipeline stages: its hyper-connections carry several residual streams and their mix across a
stage boundary, packed along the last axis; a boundary its shared attention state would cross is refused by name.
Its 2- and 3-stage logits are tests/engine/test_families.py's TABLE row."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxcel.engine.model_slice import ModelSlice
from mlxcel.models.errors import ModelError
from mlxcel.models.loading import load_checkpoint
from tests.engine.test_families import PROMPT, run_slices, stage_tokens
from tests.engine.test_slice_rule import build
from tests.family_checkpoints import family_checkpoint  # noqa: F401  (fixture)

HC, D = 4, 64  # make-random's deepseek_v41: hc_mult 4 streams of hidden 64


def test_a_boundary_carries_the_streams_and_their_mix_and_both_are_read(family_checkpoint):  # noqa: F811
    """[B, L, 4 x 64 + 4]: the 4 streams, then the float32 mix the next layer collapses them by. Blanking either
    changes the second stage's logits: they are read, not just passed."""
    model = load_checkpoint(family_checkpoint("deepseek_v41")).model
    first, second = ModelSlice(model, 0, 2), ModelSlice(model, 2, 4)
    assert second.input_width == HC * D + HC
    x = mx.array([PROMPT[0]])
    carried, whole = first(x), model(x)
    assert carried.shape == (1, 6, HC * D + HC)
    assert float(mx.abs(second(carried) - whole).max()) <= 1e-4
    blank_mix = mx.concatenate([carried[..., :HC * D], mx.zeros_like(carried[..., HC * D:])], axis=-1)
    one_stream = mx.concatenate([mx.zeros_like(carried[..., :HC * D]), carried[..., HC * D:]], axis=-1)
    for broken in (blank_mix, one_stream):
        assert float(mx.abs(second(broken) - whole).max()) > 1e-3


def test_the_mix_crosses_as_its_float32_bits_in_a_16_bit_activation():
    """In a bfloat16 model the mix is carried as its float32 bits in 2 bfloat16 lanes each (width 4 x 64 + 8),
    so the next stage reads exactly the mix the last layer made, not one rounded to bfloat16."""
    from mlxcel.engine.flows import DeepseekV41Flow

    model = build("deepseek_v41", {"hc_mult": HC})
    model.model.embed_tokens.weight = model.model.embed_tokens.weight.astype(mx.bfloat16)
    assert DeepseekV41Flow.width(model, 2) == HC * D + HC * 2
    flow = DeepseekV41Flow(model, 0, mx.zeros((1, 3, D), dtype=mx.bfloat16), [None] * 2)
    flow.streams = mx.random.normal((1, 3, HC, D)).astype(mx.bfloat16)
    flow.pre_mix = mx.random.uniform(shape=(1, 3, HC)) + 1e-6  # float32 values bfloat16 cannot hold
    carried = flow.leave(False)
    assert carried.dtype == mx.bfloat16 and carried.shape == (1, 3, HC * D + HC * 2)
    after = DeepseekV41Flow(model, 2, carried, [None] * 2)
    assert mx.array_equal(after.pre_mix, flow.pre_mix) and mx.array_equal(after.streams, flow.streams)
    assert after.pre_mix.dtype == mx.float32


def test_a_boundary_shared_attention_state_would_cross_is_refused_by_name():
    """Index layers 0 and 2 only: layers 1 and 3 attend over the top-k rows layers 0 and 2 pick in the same
    forward pass, so a stage cannot start at layer 1 or 3; 0-1 | 2-3 carries nothing else and decodes as the
    whole model."""
    model = build("deepseek_v41", {"index_source_layer_ids": [0, 2]})
    with pytest.raises(ModelError, match=r"deepseek_v41 layers from 3 on read the topk_idx that layer 2 computes in "
                                         r"the same forward pass .* a stage cannot start at layer 3"):
        ModelSlice(model, 3, 4)
    with pytest.raises(ModelError, match="a stage cannot start at layer 1"):
        ModelSlice(model, 1, 2)
    slices = [ModelSlice(model, 0, 2), ModelSlice(model, 2, 4)]
    caches, whole_cache, x = [s.make_cache() for s in slices], make_prompt_cache(model), mx.array(PROMPT)
    for _ in range(4):
        expected = model(x, cache=whole_cache)
        assert float(mx.abs(run_slices(slices, caches, x) - expected).max()) <= 1e-4
        x = mx.argmax(expected[:, -1], axis=-1)[:, None]
    assert whole_cache[1].compress_kv.shape[1] == caches[0][1].compress_kv.shape[1] == 2  # rows pooled and used


def test_stages_loaded_as_remote_ones_decode_as_the_whole_model(family_checkpoint):  # noqa: F811
    """What a stage process loads (model.layers.N of its layers, the first stage the embedding, the last the final
    norm and lm_head) decodes as the whole model, one row (its LayerCache has no batched form)."""
    from mlxcel.engine.executor import whole_model_runner
    from mlxcel.pipeline.slice_loading import load_stage_runner

    path = family_checkpoint("deepseek_v41")
    prompts = {"a": PROMPT[0]}
    whole = stage_tokens([whole_model_runner(load_checkpoint(path).model, max_rows=4)], prompts, 5)
    runners = [load_stage_runner(path, a, b, max_rows=4)[0] for a, b in ((0, 1), (1, 3), (3, 4))]
    assert stage_tokens(runners, prompts, 5) == whole


@pytest.mark.proc
@pytest.mark.timeout(300)
def test_three_remote_stages_carry_the_streams_across_processes(tmp_path, family_checkpoint):  # noqa: F811
    """Three stage processes (0 | 1-2 | 3): each boundary carries the 4 streams and their mix ([rows, n, 260] on
    the wire, the width each stage checks); the text through the coordinator equals the single device's."""
    from mlxcel.engine.executor import slice_runner
    from tests.pipeline.cluster import LocalCluster
    from tests.pipeline.test_remote import PROMPTS as REMOTE_PROMPTS, reference_tokens, remote_tokens

    path = family_checkpoint("deepseek_v41")
    model = load_checkpoint(path).model
    assert [slice_runner(model, a, b, max_rows=4).input_width for a, b in ((1, 3), (3, 4))] == [HC * D + HC] * 2
    cluster = LocalCluster(tmp_path, path, stages=3, layers=["0-0", "1-2", "3-3"]).start()
    try:
        for prompt in REMOTE_PROMPTS[:2]:  # one at a time: its LayerCache has no batched form
            assert remote_tokens(cluster.url, prompt, 6) == reference_tokens(path, prompt, 6)
    finally:
        cluster.stop()


def test_a_handed_off_cache_of_the_stages_continues_as_on_one_node(family_checkpoint):  # noqa: F811
    """Prefill through stages 0-1 | 2-3, hand their LayerCaches off as one sequence (disaggregated prefill: the
    DSV41 records), split them back by each stage's share: decoding on them gives the whole model's logits, as on
    the caches never sent."""
    from tests.engine.test_slice_rule import through_the_wire

    model = load_checkpoint(family_checkpoint("deepseek_v41")).model
    slices = [ModelSlice(model, 0, 2), ModelSlice(model, 2, 4)]
    caches, whole_cache, x = [s.make_cache() for s in slices], make_prompt_cache(model), mx.array([PROMPT[0] * 2])
    expected = model(x, cache=whole_cache)
    assert float(mx.abs(run_slices(slices, caches, x) - expected).max()) <= 1e-4
    back = through_the_wire(model, [c for cache in caches for c in cache], x.shape[1])
    received = [back[:slices[0].cache_count], back[slices[0].cache_count:]]
    assert received[1][0].compress_kv.shape == caches[1][0].compress_kv.shape == (1, 3, 16)  # 12 rows pooled 4 to 1
    for _ in range(5):
        x = mx.argmax(expected[:, -1], axis=-1)[:, None]
        expected = model(x, cache=whole_cache)
        for chain in (caches, received):
            assert float(mx.abs(run_slices(slices, chain, x) - expected).max()) <= 1e-4
