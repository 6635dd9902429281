"""Pipeline slicing by rule (mlxcel.engine.slice_rule): which families slice without a FAMILIES row, which are
refused and why, that every family mlx-lm itself distributes is one or the other, and that a sliced cache
handed off (disaggregated prefill) goes on exactly as on one node. The families' 2- and 3-stage logits are
tests/engine/test_families.py's rows."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxcel.engine.model_slice import FAMILIES, REFUSED, ModelSlice, family_of
from mlxcel.engine.slice_rule import rule_break
from mlxcel.models.errors import ModelError
from mlxcel.models.random_checkpoint import IN_PROCESS_FAMILIES, RANDOM_FAMILIES, _config

PROMPT = [[5, 17, 90, 3, 42, 7]]


def build(family: str, extra: dict | None = None, layers: int = 4, base: str | None = None):
    """``family``'s mlx-lm Model with random weights, in memory (make-random's tiny config of ``family`` or
    ``base``, then ``extra``)."""
    from mlx_lm.utils import _get_classes

    base = base or (family if family in RANDOM_FAMILIES + IN_PROCESS_FAMILIES else "llama")
    config = {**_config(base, layers, 64, 4, 2, 320, None, None), "model_type": family, **(extra or {})}
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(0)
    return model_cls(args_cls.from_dict(config))


def hooked_modules() -> set[str]:
    """Every mlx_lm.models module whose Model mlx-lm can distribute: a shard() or a PipelineMixin model."""
    import mlx_lm.models
    from mlx_lm.models.pipeline import PipelineMixin

    out = set()
    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        try:
            module = importlib.import_module(f"mlx_lm.models.{info.name}")
        except (ImportError, SystemExit):  # olmo wants ai2-olmo; such a module cannot load here at all
            continue
        model = getattr(module, "Model", None)
        pipelined = any(inspect.isclass(c) and issubclass(c, PipelineMixin) and c.__module__ == module.__name__
                        for c in vars(module).values())
        if model is not None and (pipelined or hasattr(model, "shard")):
            out.add(info.name)
    return out


def test_every_family_mlx_lm_distributes_is_sliced_or_refused_by_name():
    """An mlx-lm upgrade that adds a distributable family fails here until it is sliced (row or rule, with a
    make-random row in test_families) or refused with a reason."""
    hooked = hooked_modules()
    assert {"deepseek_v2", "step3p5", "kimi_k25", "mistral4", "llama", "qwen3"} <= hooked  # the scan finds them
    ruled = {family for family in RANDOM_FAMILIES + IN_PROCESS_FAMILIES if family not in FAMILIES}
    inherited = {"glm_moe_dsa", "prism_hadamard_qwen35", "solar_open"}  # subclasses (or aliases) of a row's Model
    unhandled = hooked - set(FAMILIES) - ruled - set(REFUSED) - inherited
    assert not unhandled, f"mlx-lm distributes {sorted(unhandled)}: slice them (row or rule) or refuse by name"
    assert all(REFUSED[name] for name in REFUSED)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_family_is_refused_by_name_with_its_reason(name):
    model = type("Model", (), {"__module__": f"mlx_lm.models.{name}", "model_type": name})()
    with pytest.raises(ModelError) as info:
        family_of(model)
    assert str(info.value) == f"model family '{name}' cannot be sliced into pipeline stages: {REFUSED[name]}"


def _breaking_subclass(model, inner_call=None, outer_call=None):
    """``model`` as an instance of a Model subclass (same mlx-lm module) whose forward is the one given."""
    cls = type(model)
    outer = type("Model", (cls,), {"__module__": cls.__module__, **({"__call__": outer_call} if outer_call else {})})
    inner_cls = type(model.model)
    if inner_call is not None:
        model.model.__class__ = type(inner_cls.__name__, (inner_cls,), {"__call__": inner_call})
    model.__class__ = outer
    return model


def test_a_soft_capped_head_is_refused_not_sliced_wrong():
    """An outer forward that soft-caps its logits (gemma2's, without its row) breaks the rule: refused, so a
    generic slice never silently drops the cap."""
    def capped(self, inputs, cache=None):
        out = self.lm_head(self.model(inputs, cache))
        return mx.tanh(out / 30.0) * 30.0

    model = _breaking_subclass(build("olmo2"), outer_call=capped)
    assert rule_break(model) == "it soft-caps its logits"
    with pytest.raises(ModelError, match="'olmo2' cannot be sliced into pipeline stages: it soft-caps its logits"):
        family_of(model)


def test_a_scaled_embedding_or_an_own_mask_is_refused():
    def scaled(self, inputs, cache=None):
        h = self.embed_tokens(inputs)
        h = h * 2.0
        for layer, c in zip(self.layers, cache or [None] * len(self.layers)):
            h = layer(h, None, cache=c)
        return self.norm(h)

    def own_mask(self, inputs, cache=None):
        h = self.embed_tokens(inputs)
        mask = make_my_mask(h)  # noqa: F821 - never run: the source is what the rule reads
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, cache=c)
        return self.norm(h)

    assert rule_break(_breaking_subclass(build("olmo2"), inner_call=scaled)) == "it scales its embedding"
    assert rule_break(_breaking_subclass(build("olmo2"), inner_call=own_mask)) == (
        "it builds its masks with make_my_mask, not create_attention_mask / create_ssm_mask")


def test_a_plain_decoder_slices_by_rule_and_fails_without_it():
    """olmo3 has no row: the rule reads its sliding / full layers from its caches. Forcing every layer to full
    attention (what a generic slice without the rule did) changes the logits once the window of 4 is passed."""
    from mlxcel.engine.model_slice import Family

    model = build("olmo3")
    assert "olmo3" not in FAMILIES and rule_break(model) is None
    x = mx.array([[5, 17, 90, 3, 42, 7, 8, 9]])
    whole = model(x, cache=make_prompt_cache(model))
    first, second = ModelSlice(model, 0, 2), ModelSlice(model, 2, 4)
    assert first.kinds == [4, None] and second.kinds == [4, None]
    got = second(first(x, first.make_cache()), second.make_cache())
    assert float(mx.abs(got - whole).max()) <= 1e-4
    for piece in (first, second):
        piece.family, piece.kinds = Family(), [None, None]
    blind = second(first(x, first.make_cache()), second.make_cache())
    assert float(mx.abs(blind - whole).max()) > 1e-3


def test_a_subclass_of_a_row_s_model_uses_the_row():
    from mlx_lm.models import glm_moe_dsa

    assert glm_moe_dsa.Model.__call__ is glm_moe_dsa.DSV32Model.__call__
    model = build("glm_moe_dsa", base="deepseek_v32", extra={
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1, "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    assert type(model) is glm_moe_dsa.Model and family_of(model) is FAMILIES["deepseek_v32"]
    x = mx.array(PROMPT)
    got = ModelSlice(model, 2, 4)(ModelSlice(model, 0, 2)(x))
    assert float(mx.abs(got - model(x)).max()) <= 1e-4


# -- disaggregated handoff of a sliced cache ------------------------------------------------------------------


def through_the_wire(model, cache: list, length: int) -> list:
    from mlxcel.disagg.kv_cache import export_cache, import_cache, probe_layout
    from mlxcel.disagg.kv_codec import HandoffDecoder, encode_chunks, encode_header

    layout = probe_layout(model)
    assert layout.unsupported is None
    dec = HandoffDecoder(layout, 2048)
    prompt = tuple(range(length))
    for part in [encode_header({}, prompt, layout), *encode_chunks(export_cache(cache, layout, length), 64)]:
        dec.feed(part)
    return import_cache(dec.result())


@pytest.mark.parametrize("family", ["olmo2", "olmo3", "lfm2", "jamba"])  # KV, rotating, convolution, Mamba
def test_a_handed_off_sliced_cache_continues_exactly_like_one_node(family):
    """Prefill through 2 stages (olmo3: past its window of 4), hand the stages' caches off as one sequence,
    split them back per stage: decoding on them gives the whole model's logits, as on the caches never sent."""
    model = build(family)
    slices = [ModelSlice(model, 0, 1), ModelSlice(model, 1, 4)]
    caches = [piece.make_cache() for piece in slices]
    whole = make_prompt_cache(model)
    x = mx.array([[5, 17, 90, 3, 42, 7, 8, 9]])
    expected = model(x, cache=whole)
    got = x
    for piece, cache in zip(slices, caches):
        got = piece(got, cache)
    assert float(mx.abs(got - expected).max()) <= 1e-4
    back = through_the_wire(model, [c for cache in caches for c in cache], x.shape[1])
    received = [back[:1], back[1:]]
    for _ in range(3):
        x = mx.argmax(expected[:, -1], axis=-1)[:, None]
        expected = model(x, cache=whole)
        for chain in (caches, received):
            got = x
            for piece, cache in zip(slices, chain):
                got = piece(got, cache)
            assert float(mx.abs(got - expected).max()) <= 1e-4


def test_stages_loaded_as_remote_ones_of_a_rule_family_decode_as_the_whole_model(tmp_path):
    """jamba (Mamba / attention, its final norm named final_layernorm): what ``load_stage_runner`` loads
    per stage (the last stage that norm and the head, no other layer) decodes as the whole model."""
    from mlxcel.engine.executor import whole_model_runner
    from mlxcel.models.loading import load_checkpoint
    from mlxcel.models.random_checkpoint import make_random_checkpoint
    from mlxcel.pipeline.slice_loading import load_stage_runner
    from tests.engine.test_families import stage_tokens

    path = make_random_checkpoint(tmp_path, family="jamba")
    prompts = {"a": PROMPT[0], "b": PROMPT[0][:4]}
    whole = stage_tokens([whole_model_runner(load_checkpoint(path).model, max_rows=4)], prompts, 3)
    runners = [load_stage_runner(path, a, b, max_rows=4)[0] for a, b in ((0, 2), (2, 4))]
    assert stage_tokens(runners, prompts, 3) == whole


# bailing_hybrid at a tiny scale: layer_group_size 2, so GLA (linear attention) in layers 0, 2, ... and MLA in 1, 3, ...
BAILING = {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "num_shared_experts": 1,
           "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "layer_group_size": 2, "group_norm_size": 1,
           "routed_scaling_factor": 1.0, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8,
           "qk_nope_head_dim": 16, "v_head_dim": 16, "head_dim": 16}


def decode_alike(model, slices, steps: int = 4, tol: float = 1e-4) -> float:
    """The largest logit difference of ``slices`` chained against the whole model, over a prompt and ``steps``
    greedy decode steps on their caches."""
    caches, whole_cache = [piece.make_cache() for piece in slices], make_prompt_cache(model)
    x, worst = mx.array(PROMPT), 0.0
    for _ in range(steps + 1):
        expected, got = model(x, cache=whole_cache), x
        for piece, cache in zip(slices, caches):
            got = piece(got, cache)
        worst = max(worst, float(mx.abs(got - expected).max()))
        x = mx.argmax(expected[:, -1], axis=-1)[:, None]
    return worst


@pytest.mark.parametrize("ranges", [[(0, 2), (2, 4)], [(0, 2), (2, 4), (4, 6)], [(0, 4), (4, 6)]])
def test_bailing_hybrid_slices_by_its_embedding_and_the_offset_its_mla_layer_gives(ranges):
    """bailing_hybrid's embedding is word_embeddings (found as the text model's one Embedding) and its GLA layers
    rope at the offset the forward reads from an MLA layer's cache: each stage reads it from its own."""
    from mlxcel.engine.slice_rule import embedding_name

    model = build("bailing_hybrid", BAILING, layers=ranges[-1][1])
    assert embedding_name(model) == "word_embeddings"
    assert rule_break(model) == "its forward hands each layer more than (hidden, mask, cache) (e.g. a position offset)"
    slices = [ModelSlice(model, a, b) for a, b in ranges]
    assert [type(c).__name__ for c in slices[0].make_cache()][:2] == ["ArraysCache", "KVCache"]
    assert decode_alike(model, slices) <= 1e-4


def test_bailing_hybrid_stages_need_the_mla_offset_and_one_mla_layer_each():
    from mlxcel.engine.flows import Flow

    model = build("bailing_hybrid", BAILING)
    slices = [ModelSlice(model, 0, 2), ModelSlice(model, 2, 4)]
    for piece in slices:  # without the offset (the generic flow): GLA ropes every decode step at position 0
        piece.family = type(piece.family)(attention=piece.family.attention, array_masks=True, flow=Flow)
    assert decode_alike(model, slices) > 1e-3
    with pytest.raises(ModelError, match=r"bailing_hybrid layers 2-2 hold no MLA layer \(every 2th layer\): its "
                                         "linear-attention layers read the position from an MLA layer's cache"):
        ModelSlice(model, 2, 3)


# -- muse_spark: a wrapper whose layers run mlx-lm's Metal kernels (CPU stand-ins here: tests/engine/muse_spark_cpu.py)


@pytest.mark.parametrize("ranges", [[(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)], [(0, 3), (3, 4)]])
def test_muse_spark_slices_its_language_model_as_the_whole_model(ranges):
    """Its text model is model.model.language_model; each layer hands the next its normed input, which a
    stage after the first remakes from the stream (pre_norm); the head casts the bfloat16 norm to lm_head's
    dtype, scales and soft-caps: 2 and 3 stages give the whole model's logits over a prompt and decode steps."""
    from mlxcel.engine.slice_rule import text_model
    from tests.engine.muse_spark_cpu import build_muse_spark, cpu_kernels

    with cpu_kernels():
        model = build_muse_spark()
        assert text_model(model) is model.model.language_model
        slices = [ModelSlice(model, a, b) for a, b in ranges]
        assert [type(c).__name__ for piece in slices for c in piece.make_cache()] == ["RotatingKVCache",
                                                                                     "KVCache"] * 2
        assert decode_alike(model, slices) <= 1e-4


def test_muse_spark_needs_its_head_and_its_flow():
    """Without its head (a plain norm and lm_head: no scale, no cap) or its flow (layers called as the generic
    ones, no normed input handed on) the slices are wrong or fail."""
    from mlxcel.engine.model_slice import norm_and_head
    from tests.engine.muse_spark_cpu import build_muse_spark, cpu_kernels

    with cpu_kernels():
        model = build_muse_spark()
        slices = [ModelSlice(model, 0, 2), ModelSlice(model, 2, 4)]
        for piece in slices:
            piece.family = type(piece.family)(embed=piece.family.embed, head=norm_and_head,
                                              attention=piece.family.attention, flow=piece.family.flow)
        assert decode_alike(model, slices, steps=1) > 1e-3
        for piece in slices:
            piece.family = type(piece.family)(embed=piece.family.embed, attention=piece.family.attention)
        with pytest.raises(TypeError):
            decode_alike(model, slices, steps=1)
