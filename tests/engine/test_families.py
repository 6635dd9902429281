"""Every family ModelSlice claims, one row each: pipeline slices give the whole model's logits and tokens.

Each row is a tiny ``mlxcel models make-random`` checkpoint (mlx-lm's own classes, the real tokenizer
files), loaded as a real one, and the cache types its layers must get (which says the family's
layer kinds: sliding windows, global and linear attention, chosen by absolute layer index). For each:
2 and 3 stages (split by ``plan_stages`` over the checkpoint's headers), chained in process, give
the whole model's float32 logits within 1e-4 over a prompt and a few decode steps over their caches,
with the same greedy tokens; and ``mlxcel generate --pp-size 2`` prints the text it prints without.
Adding a family is one row here (plus its fields in ``random_checkpoint._family_fields`` and, where
its forward differs from the generic one, a hook in ``model_slice.FAMILIES``).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import (ArraysCache, CacheList, ChunkedKVCache, KVCache, RotatingKVCache,
                                 make_prompt_cache)

from mlxcel.cli import main
from mlxcel.engine.model_slice import FAMILIES, ModelSlice, family_of
from mlxcel.models.loading import load_checkpoint
from mlxcel.models.random_checkpoint import IN_PROCESS_FAMILIES, RANDOM_FAMILIES, make_random_checkpoint
from mlxcel.topology.partition import layer_costs, plan_stages
from tests.family_checkpoints import family_checkpoint  # noqa: F401  (fixture)

from mlx_lm.models.deepseek_v41 import LayerCache as LAYER  # noqa: E402 - deepseek_v41's own cache

KV, ROT, SSM, CL, CHUNK = KVCache, RotatingKVCache, ArraysCache, CacheList, ChunkedKVCache
# family (model_type) -> the cache type of each of its 4 layers
TABLE: dict[str, list[type]] = {
    "llama": [KV] * 4,
    "qwen2": [KV] * 4,
    "qwen3": [KV] * 4,
    "qwen3_moe": [KV] * 4,
    "mixtral": [KV] * 4,
    "phi3": [KV] * 4,
    "gemma3_text": [ROT, KV, ROT, KV],  # every 2nd layer global, the others a window of 4
    "deepseek_v3": [KV] * 4,  # MLA; layer 0 dense (first_k_dense_replace 1), the others MoE
    "gpt_oss": [ROT, KV, ROT, KV],  # sliding / full alternating, attention sinks
    "glm4_moe": [KV] * 4,  # layer 0 dense, the others MoE
    "qwen3_next": [SSM, KV, SSM, KV],  # gated delta net (linear attention) / full attention
    "qwen3_5": [SSM, KV, SSM, KV],  # gated delta net / full attention, dense MLPs
    "qwen3_5_moe": [SSM, KV, SSM, KV],  # the same with MoE blocks and a shared expert
    "ernie4_5": [KV] * 4,
    "ernie4_5_moe": [KV] * 4,  # layer 0 dense, the others MoE with a shared expert
    "hunyuan_v1_dense": [KV] * 4,  # query/key norms, dynamic NTK-alpha rope
    "minimax": [KV] * 4,  # MoE, partial rotary, query/key norms over all heads
    "ministral3": [ROT, KV, ROT, KV],  # sliding / full alternating, llama 4's position-dependent query scale
    "deepseek_v32": [CL] * 4,  # MLA + the lightning indexer's keys (top 4 of them), one CacheList per layer
    "gemma4_text": [ROT, KV, ROT, KV],  # sliding / full, k = v in the full layers, MoE beside each MLP, softcap
    # Kimi Delta Attention / MLA; attention residuals over blocks of 2 layers, so 1 or 2 block summaries
    # cross each stage boundary beside h
    "kimi_k3": [SSM, KV, SSM, KV],
    # IN_PROCESS_FAMILIES (tested in process only): plain decoders sliced by rule (no FAMILIES row), or a row for a scaled embedding / scaled or capped logits
    "gemma2": [KV] * 4,  # row: embedding scaled by sqrt(hidden), logits soft-capped, array masks
    "olmo2": [KV] * 4,
    "olmo3": [ROT, KV, ROT, KV],  # sliding (a window of 4) / full alternating
    "cohere2": [ROT, KV, ROT, KV],  # row: logit_scale; every 2nd layer global
    "granitemoe": [KV] * 4,  # row: embedding_multiplier, logits_scaling
    "smollm3": [KV] * 4,  # NoPE layers (every 4th) chosen inside each layer
    "seed_oss": [KV] * 4,
    "apertus": [KV] * 4,  # query/key norms, xIELU
    "lfm2": [SSM, KV, SSM, KV],  # short convolutions / full attention; final norm named embedding_norm
    "jamba": [SSM, KV, SSM, KV],  # Mamba / attention (MoE in the attention layers)
    "granitemoehybrid": [SSM, KV, SSM, KV],  # row: Mamba-2 / attention with the multipliers of granitemoe
    # families mlx-lm pipelines (PipelineMixin): by rule, or a row
    "deepseek_v2": [KV] * 4,  # MLA; layer 0 dense, the others MoE
    "glm4_moe_lite": [KV] * 4,  # MLA, array masks (read from its forward's source)
    "mistral4": [KV] * 4,  # row: MLA with ministral3's llama 4 query scale passed to each layer
    "exaone_moe": [ROT, KV, ROT, KV],  # sliding / full alternating; layer 0 dense
    "step3p5": [ROT, KV, ROT, KV],  # sliding / full alternating; MoE after layer 0 with a shared expert
    # row: cross-layer attention (layers 1, 3 reuse the K/V projections of 0, 2), carried beside h inside a group
    "hunyuan": [KV] * 4,
    "falcon_h1": [CL] * 4,  # row: Mamba-2 beside attention in each layer (a CacheList of both), scaled tied head
    "longcat_flash": [CL] * 4,  # row: two MLA sublayers per layer, a CacheList of their KV; zero experts
    # multimodal wrappers (text_config): the text model inside language_model sliced, the wrapper's head
    "kimi_k25": [KV] * 4,  # deepseek_v3's MLA and MoE
    "minimax_m3_vl": [CL] * 4,  # KV (+ the indexer's keys in the sparse layers 1 and 3), blocks of 2, top 2
    "llama4": [CHUNK, CHUNK, CHUNK, KV],  # chunked local attention (chunks of 4), every 4th layer global
    # row: text model backbone; Mamba-2, MoE, attention, MLP ("ME*-"): caches for layers 0 and 2 only, so a
    # stage's caches are its own layers' (the model's list from the slice's first), not the list at its indices
    "nemotron_h": [SSM, KV],
    # row: hyper-connections (4 residual streams and their mix cross each boundary, hc x hidden + hc wide);
    # its own LayerCache per layer (a window of 4, rows pooled 4 to 1 and their index keys), made by the text model
    "deepseek_v41": [LAYER] * 4,
}
# rows whose split rule keeps 4 layers from making 3 stages (each stage holds an MLA layer):
# tests/engine/test_slice_rule.py checks them on the splits they allow, and the refusal
SPLIT_BOUND = {"bailing_hybrid"}
PROMPT = [[5, 17, 90, 3, 42, 7], [7, 7, 1, 60, 33, 2]]
STEPS = 5  # decode steps after the prompt: 11 positions, so the windows of 4 wrap


def test_table_is_every_sliceable_family_and_every_random_one():
    """A family sliced but untested, or built by make-random but not sliced, fails here; a family
    without a FAMILIES row is one the rule slices."""
    from mlxcel.engine.slice_rule import rule_break

    models = {family: load_model(family) for family in TABLE}
    modules = {type(model).__module__.rsplit(".", 1)[1] for model in models.values()}
    assert set(FAMILIES) - SPLIT_BOUND <= modules
    assert all(rule_break(models[family]) is None for family in modules - set(FAMILIES))
    assert set(TABLE) == set(RANDOM_FAMILIES) | set(IN_PROCESS_FAMILIES)


_checkpoints: dict[str, Path] = {}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    def get(family: str) -> Path:
        if family not in _checkpoints:
            _checkpoints[family] = make_random_checkpoint(tmp_path_factory.mktemp(family), family=family, layers=4)
        return _checkpoints[family]

    yield get
    _checkpoints.clear()


def load_model(family: str):
    """The family's mlx-lm Model built in memory (the table check needs only its class)."""
    from mlx_lm.utils import _get_classes

    from mlxcel.models.random_checkpoint import _config

    config = _config(family, 4, 64, 4, 2, 320, None, None)
    model_cls, args_cls = _get_classes(config)
    return model_cls(args_cls.from_dict(config))


def run_slices(slices, caches, x):
    for piece, cache in zip(slices, caches):
        x = piece(x, cache)
    return x


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("family", sorted(TABLE))
def test_slices_give_the_whole_models_logits_and_tokens(checkpoints, family, stages):
    path = checkpoints(family)
    model = load_checkpoint(path).model
    family_of(model)  # claimed, not refused
    ranges = [(s.start, s.end) for s in plan_stages(layer_costs(path), stages)]
    assert len(ranges) == stages and ranges[0][0] == 0 and ranges[-1][1] == 4
    slices = [ModelSlice(model, a, b) for a, b in ranges]
    caches = [s.make_cache() for s in slices]
    whole_cache = make_prompt_cache(model)
    assert [type(c) for cache in caches for c in cache] == [type(c) for c in whole_cache] == TABLE[family]
    x = mx.array(PROMPT)
    whole_tokens, sliced_tokens = [], []
    for _ in range(STEPS + 1):
        expected = model(x, cache=whole_cache)
        got = run_slices(slices, caches, x)
        assert got.dtype == expected.dtype == mx.float32
        assert got.shape == expected.shape == (2, x.shape[1], 320)
        assert float(mx.abs(got - expected).max()) <= 1e-4
        whole_tokens.append(mx.argmax(expected[:, -1], axis=-1))
        sliced_tokens.append(mx.argmax(got[:, -1], axis=-1))
        x = sliced_tokens[-1][:, None]
    assert np.array_equal(np.array(mx.stack(sliced_tokens)), np.array(mx.stack(whole_tokens)))


@pytest.mark.parametrize("family", sorted(TABLE))
def test_generate_pp_size_2_prints_the_same_tokens(checkpoints, capsys, family):
    args = ["generate", "-m", str(checkpoints(family)), "-p", "hello world", "--raw", "-n", "4"]
    assert main(args) == 0
    whole = capsys.readouterr()
    assert main([*args, "--pp-size", "2"]) == 0
    piped = capsys.readouterr()
    assert "pipeline: stage 0 layers 0-1, stage 1 layers 2-3" in piped.err and "pipeline:" not in whole.err
    assert "decode: 4 tokens" in whole.err and "decode: 4 tokens" in piped.err
    assert piped.out == whole.out


def stage_tokens(runners, prompts: dict[str, list[int]], steps: int) -> dict[str, list[int]]:
    """Greedy tokens through a chain of SliceRunners (what remote stages run): each prompt prefilled
    alone, then ``steps`` decode steps of all rows in one micro-batch (batched caches, left-padded)."""
    out: dict[str, list[int]] = {}
    for rid, prompt in prompts.items():
        x = mx.array([prompt])
        for runner in runners:
            runner.prepare(rid)
            x = runner.prefill(rid, x, sample=True)
        out[rid] = [x[0].token]
    rids = list(prompts)
    for _ in range(steps):
        x = mx.array([[out[r][-1]] for r in rids])
        for runner in runners:
            x = runner.decode(0, rids, x)
        for r, s in zip(rids, x):
            out[r].append(s.token)
    return out


# families whose rows cannot share a micro-batch on one node either: mlx-lm's ChunkedKVCache (llama4) and
# deepseek_v41's LayerCache have no batched form (no merge), so they decode one row per step; their stage runners
# are checked on one row
ONE_ROW = {"llama4", "deepseek_v41"}


@pytest.mark.parametrize("family", sorted(TABLE))
def test_stage_runners_decode_a_micro_batch_as_the_whole_model(checkpoints, family):
    from mlxcel.engine.executor import slice_runner, whole_model_runner

    model = load_checkpoint(checkpoints(family)).model
    prompts = {"a": PROMPT[0], "b": PROMPT[1][:4]}  # different lengths: the shorter row is left-padded
    if family in ONE_ROW:
        prompts.pop("b")
    whole = stage_tokens([whole_model_runner(model, max_rows=4)], prompts, STEPS)
    staged = stage_tokens([slice_runner(model, 0, 2, max_rows=4), slice_runner(model, 2, 4, max_rows=4)],
                          prompts, STEPS)
    assert staged == whole and all(len(t) == STEPS + 1 for t in whole.values())


def test_deepseek_v3_needs_array_masks(checkpoints):
    """Why its hook matters: MLA adds the mask to its scores, and the generic "causal" string cannot be added."""
    from mlxcel.engine.model_slice import Family

    whole = ModelSlice(load_checkpoint(checkpoints("deepseek_v3")).model, 0, 4)
    whole.family = Family()
    with pytest.raises(ValueError):
        whole(mx.array([PROMPT[0]]))


@pytest.fixture(scope="module")
def gemma4_e2b(family_checkpoint) -> Path:  # noqa: F811
    return family_checkpoint("gemma4_text_e2b")


@pytest.mark.parametrize("ranges", [[(0, 2), (2, 4)], [(0, 1), (1, 2), (2, 4)]])
def test_gemma4_per_layer_inputs_and_kv_shared_layers_slice(gemma4_e2b, ranges):
    """Per-layer inputs cross each boundary beside h ([B, L, D + layers left * P]); the KV-shared layer 3
    and layer 2, whose KV it reads, share a stage: 2 and 3 stages give the whole model's logits and tokens."""
    model = load_checkpoint(gemma4_e2b).model
    slices = [ModelSlice(model, a, b) for a, b in ranges]
    assert [s.input_width for s in slices[1:]] == [64 + (4 - a) * 8 for a, _ in ranges[1:]]
    caches = [s.make_cache() for s in slices]
    whole_cache = make_prompt_cache(model)
    assert [type(c) for cache in caches for c in cache] == [type(c) for c in whole_cache] == [ROT, KV, ROT]
    x = mx.array(PROMPT)
    for _ in range(STEPS + 1):
        expected, got = model(x, cache=whole_cache), run_slices(slices, caches, x)
        assert float(mx.abs(got - expected).max()) <= 1e-4
        x = mx.argmax(got[:, -1], axis=-1)[:, None]
        assert mx.array_equal(x[:, 0], mx.argmax(expected[:, -1], axis=-1))


def test_gemma4_stages_read_the_carried_per_layer_inputs(gemma4_e2b):
    """Without the carried per-layer inputs the second stage computes other logits: they are read, not just passed."""
    model = load_checkpoint(gemma4_e2b).model
    first, second = ModelSlice(model, 0, 2), ModelSlice(model, 2, 4)
    x = mx.array([PROMPT[0]])
    carried = first(x)
    assert carried.shape == (1, 6, 64 + 2 * 8)
    whole = model(x)
    assert float(mx.abs(second(carried) - whole).max()) <= 1e-4
    blanked = mx.concatenate([carried[..., :64], mx.zeros_like(carried[..., 64:])], axis=-1)
    assert float(mx.abs(second(blanked) - whole).max()) > 1e-3


def test_gemma4_stages_loaded_as_remote_ones_decode_a_micro_batch_as_the_whole_model(gemma4_e2b):
    """What a stage process loads (``load_stage_runner``: the first stage the per-layer tables, the last the
    head) decodes two rows of different lengths as the whole model, on another thread as a stage service
    does (where a weight it did not load has no stream)."""
    from concurrent.futures import ThreadPoolExecutor

    from mlxcel.engine.executor import whole_model_runner
    from mlxcel.pipeline.slice_loading import load_stage_runner

    prompts = {"a": PROMPT[0], "b": PROMPT[1][:4]}
    whole = stage_tokens([whole_model_runner(load_checkpoint(gemma4_e2b).model, max_rows=4)], prompts, STEPS)
    runners = [load_stage_runner(gemma4_e2b, a, b, max_rows=4)[0] for a, b in ((0, 2), (2, 4))]
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(stage_tokens, runners, prompts, STEPS).result() == whole


def test_gemma4_generate_pp_size_2_with_per_layer_inputs_and_kv_shared_layers(gemma4_e2b, capsys):
    args = ["generate", "-m", str(gemma4_e2b), "-p", "hello world", "--raw", "-n", "4"]
    assert main(args) == 0
    whole = capsys.readouterr().out
    assert main([*args, "--pp-size", "2"]) == 0
    assert capsys.readouterr().out == whole


def test_gemma4_a_stage_boundary_between_a_kv_shared_layer_and_its_source_is_refused_by_name(gemma4_e2b):
    from mlxcel.models.errors import ModelError

    model = load_checkpoint(gemma4_e2b).model
    ModelSlice(model, 0, 2)  # layers 0-1 share nothing
    with pytest.raises(ModelError, match="gemma4_text layer 3 reuses the KV cache of layer 2 .* a stage boundary "
                                         "cannot fall between layers 2 and 3; put layers 2-3 on one stage"):
        ModelSlice(model, 3, 4)


def test_kimi_k3_stages_carry_their_residual_blocks(checkpoints):
    """Without the carried block summaries a later stage computes other logits: the carry is what makes them equal."""
    model = load_checkpoint(checkpoints("kimi_k3")).model
    first, second = ModelSlice(model, 0, 2), ModelSlice(model, 2, 4)
    assert second.input_width == 2 * 64  # h and the summary of block 0 (layers 0-1)
    x = mx.array([PROMPT[0]])
    carried = first(x)
    assert carried.shape == (1, 6, 128)
    # block 0's summary first (block 0 begins at layer 0, whose input is the embedding), then h
    assert mx.array_equal(carried[..., :64], model.model.embed_tokens(x))
    whole = model(x)
    assert float(mx.abs(second(carried) - whole).max()) <= 1e-4
    blanked = mx.concatenate([mx.zeros_like(carried[..., :64]), carried[..., 64:]], axis=-1)
    assert float(mx.abs(second(blanked) - whole).max()) > 1e-3  # the block summary is read, not just passed


def test_llama4_stages_need_the_chunk_mask_built_from_their_caches(checkpoints):
    """A prompt of 6 crosses llama4's chunk of 4: with the generic flow (one causal mask for every layer) the
    stages compute other logits; with Llama4Flow (the chunk mask from the stage's first chunked cache,
    the global one from its global layer's) the whole model's, over decode steps that trim the chunked caches."""
    from mlxcel.engine.flows import Flow

    model = load_checkpoint(checkpoints("llama4")).model
    first, second = ModelSlice(model, 0, 1), ModelSlice(model, 1, 4)  # the second stage begins at a chunked layer
    x = mx.array([PROMPT[0]])
    caches, whole_cache = [first.make_cache(), second.make_cache()], make_prompt_cache(model)
    for _ in range(STEPS + 1):
        expected, got = model(x, cache=whole_cache), run_slices([first, second], caches, x)
        assert float(mx.abs(got - expected).max()) <= 1e-4
        x = mx.argmax(got[:, -1], axis=-1)[:, None]
    assert caches[1][0].start_position == whole_cache[1].start_position > 0  # trimmed to its chunk, as the whole
    for piece in (first, second):
        piece.family = type(piece.family)(embed=piece.family.embed, head=piece.family.head, flow=Flow)
    blind = run_slices([first, second], [first.make_cache(), second.make_cache()], mx.array([PROMPT[0]]))
    assert float(mx.abs(blind - model(mx.array([PROMPT[0]]))).max()) > 1e-3


@pytest.mark.parametrize("family", ["kimi_k25", "llama4", "minimax_m3_vl"])
def test_wrapper_stages_loaded_as_remote_ones_decode_as_the_whole_model(checkpoints, family):
    """What a stage process loads of a wrapper (``load_stage_runner``: language_model.model.layers.N of its
    layers, the first stage the embedding, the last the final norm and language_model.lm_head) decodes as the
    whole model, on another thread as a stage service does (where a weight it did not load has no stream)."""
    from concurrent.futures import ThreadPoolExecutor

    from mlxcel.engine.executor import whole_model_runner
    from mlxcel.pipeline.slice_loading import load_stage_runner

    path = checkpoints(family)
    prompts = {"a": PROMPT[0]}
    whole = stage_tokens([whole_model_runner(load_checkpoint(path).model, max_rows=4)], prompts, STEPS)
    runners = [load_stage_runner(path, a, b, max_rows=4)[0] for a, b in ((0, 2), (2, 4))]
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(stage_tokens, runners, prompts, STEPS).result() == whole


def test_hunyuan_stages_carry_the_shared_key_value_projections(checkpoints):
    """hunyuan breaks the rule (its layers return the K/V projections a group's later layers reuse); its row
    carries them across a boundary inside a group: without them the later layer computes other logits."""
    from mlxcel.engine.slice_rule import rule_break

    model = load_checkpoint(checkpoints("hunyuan")).model
    assert rule_break(model) == "its layers return state the next layer reads (e.g. shared KV)"
    first, second = ModelSlice(model, 0, 1), ModelSlice(model, 1, 4)
    assert second.input_width == 64 + 2 * 2 * 16  # h, then layer 0's keys and values (2 KV heads of 16)
    assert ModelSlice(model, 2, 4).input_width == 64  # a group's start: h alone
    x = mx.array([PROMPT[0]])
    carried, whole = first(x), model(x)
    assert carried.shape == (1, 6, 128)
    assert float(mx.abs(second(carried) - whole).max()) <= 1e-4
    blanked = mx.concatenate([carried[..., :64], mx.zeros_like(carried[..., 64:])], axis=-1)
    assert float(mx.abs(second(blanked) - whole).max()) > 1e-3


def test_falcon_h1_needs_its_head_scale_and_both_masks(checkpoints):
    """falcon_h1 breaks the rule (its layers take both masks by keyword); its row's head scales the tied logits by
    lm_head_multiplier / embedding_multiplier, without which the last stage's logits differ."""
    from mlxcel.engine.slice_rule import norm_and_head, rule_break

    model = load_checkpoint(checkpoints("falcon_h1")).model
    assert rule_break(model).startswith("its layers take (h, cache, attn_mask, mamba_mask)")
    first, second = ModelSlice(model, 0, 2), ModelSlice(model, 2, 4)
    x = mx.array([PROMPT[0]])
    assert float(mx.abs(second(first(x)) - model(x)).max()) <= 1e-4
    second.family = type(second.family)(head=norm_and_head, flow=second.family.flow,
                                        mask_cache=second.family.mask_cache)
    assert float(mx.abs(second(first(x)) - model(x)).max()) > 1e-3


def test_nemotron_h_stages_hold_the_caches_of_their_own_layers(checkpoints):
    """nemotron_h's MLP / MoE layers own no cache: a stage of layers 1-3 holds the attention layer's KV (the
    model's cache 1), and one of layers 2-3 too, not the caches at its layer indices (none: the model makes
    2). Indexed so, the attention layer runs without a cache and the logits differ from the first decode step."""
    model = load_checkpoint(checkpoints("nemotron_h")).model
    assert [layer.block_type for layer in model.backbone.layers] == ["M", "E", "*", "-"]
    slices = [ModelSlice(model, 0, 1), ModelSlice(model, 1, 3), ModelSlice(model, 3, 4)]
    assert [[type(c) for c in s.make_cache()] for s in slices] == [[SSM], [KV], []]
    assert [s.cache_start for s in slices] == [0, 1, 2]

    def worst(pieces) -> float:
        caches, whole_cache, x, out = [s.make_cache() for s in pieces], make_prompt_cache(model), mx.array(PROMPT), 0.0
        for _ in range(3):
            expected, got = model(x, cache=whole_cache), run_slices(pieces, caches, x)
            out = max(out, float(mx.abs(got - expected).max()))
            x = mx.argmax(expected[:, -1], axis=-1)[:, None]
        return out

    assert worst(slices) <= 1e-4
    halves = [ModelSlice(model, 0, 2), ModelSlice(model, 2, 4)]
    assert worst(halves) <= 1e-4
    # every layer owning a cache: the model's caches at the slice's layer indices, none for layers 2-3
    halves[1].owners, halves[1].cache_start = [True, True], 2
    assert halves[1].make_cache() == [] and worst(halves) > 1e-3


def test_nemotron_h_stages_loaded_as_remote_ones_and_a_handoff_decode_as_the_whole_model(checkpoints):
    """What a stage process loads (backbone.layers.N of its layers, the first stage backbone.embeddings, the
    last backbone.norm_f and lm_head) decodes as the whole model; and the stages' caches, handed off as one
    sequence (disaggregated prefill) and split back by each stage's share, go on as the caches never sent."""
    from mlxcel.engine.executor import slice_runner, whole_model_runner
    from mlxcel.pipeline.slice_loading import load_stage_runner
    from tests.engine.test_slice_rule import through_the_wire

    path = checkpoints("nemotron_h")
    prompts = {"a": PROMPT[0], "b": PROMPT[1][:4]}
    whole = stage_tokens([whole_model_runner(load_checkpoint(path).model, max_rows=4)], prompts, 3)
    runners = [load_stage_runner(path, a, b, max_rows=4)[0] for a, b in ((0, 2), (2, 4))]
    assert stage_tokens(runners, prompts, 3) == whole
    model = load_checkpoint(path).model
    # a stage of the MLP layer alone holds no cache at all, and still batches two rows
    runners = [slice_runner(model, a, b, max_rows=4) for a, b in ((0, 1), (1, 3), (3, 4))]
    assert stage_tokens(runners, prompts, 3) == whole
    slices = [ModelSlice(model, 0, 2), ModelSlice(model, 2, 4)]
    caches, whole_cache, x = [s.make_cache() for s in slices], make_prompt_cache(model), mx.array([PROMPT[0]])
    expected = model(x, cache=whole_cache)
    assert float(mx.abs(run_slices(slices, caches, x) - expected).max()) <= 1e-4
    back = through_the_wire(model, [c for cache in caches for c in cache], x.shape[1])
    received = [back[:slices[0].cache_count], back[slices[0].cache_count:]]
    for _ in range(3):
        x = mx.argmax(expected[:, -1], axis=-1)[:, None]
        expected = model(x, cache=whole_cache)
        for chain in (caches, received):
            assert float(mx.abs(run_slices(slices, chain, x) - expected).max()) <= 1e-4
