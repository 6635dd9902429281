"""A contiguous slice of a model: embedding? + layers[start:end] + final norm and head?

Pipeline stages (remote ones, or ``InProcessPipeline`` for ``mlxcel generate --pp-size``)
run one slice each; a single device runs mlx-lm's whole model, not a slice. Slices wrap
mlx-lm's modules without copying them.

A slice re-implements the part of a family's forward pass around its decoder
layers, over mlx-lm's common module structure (``model.model.embed_tokens``,
``model.model.layers``, ``model.model.norm``, ``model.lm_head`` or the tied
embedding, ``model.make_cache``). Where a family differs, a small hook in its
``Family`` row says how: the embedding (gemma3 scales it by sqrt(hidden)), the
kind of attention of a layer by its ABSOLUTE index (full, sliding window of n,
or linear attention; a slice of layers [start, end) asks for start + i), and
masks as arrays (deepseek_v3's MLA), the cache a mask is built from (deepseek_v32's
CacheList), a check refusing a layer range that cannot be one slice (gemma4_text's
KV-shared layers apart from the layer whose KV they read), and a ``Flow``
(``mlxcel.engine.flows``): what one forward pass carries from layer to layer and
across a stage boundary (kimi_k3's attention-residual blocks, gemma4_text's
per-layer inputs and deepseek_v41's residual streams cross it beside or instead of h, a bounded
width each stage checks: ``ModelSlice.input_width``), and which layers own a cache (nemotron_h's
MLP and MoE layers own none: a slice holds the caches of its own layers). MoE blocks, attention
sinks and dense leading layers live inside mlx-lm's layers and need no hook. The rows are
keyed by the mlx-lm module that implements the family (a checkpoint's
``model_type`` may map onto one, e.g. mistral onto llama), each tested against
the whole model (tests/engine/test_families.py). Any other family is refused by
name: gemma2, for one, soft-caps its logits, which a generic slice would
silently get wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import KVCache

from mlxcel.engine.flows import (BailingHybridFlow, DeepseekV41Flow, FalconH1Flow, Flow, Gemma4Flow, HunyuanFlow,
                                 KimiK3Flow, Llama4Flow, Ministral3Flow, MuseSparkFlow)
# LINEAR: the attention kind of a linear-attention (state-space) layer: an SSM mask, no window
from mlxcel.engine.slice_rule import (  # noqa: F401 - lm_head: importers' name
    LINEAR, cache_attention, embedding, lm_head, norm_and_head, rule_parts, text_model)
from mlxcel.models.errors import ModelError

MLX_LM_MODELS = "mlx_lm.models."


def _embed_tokens(model: Any, inputs: mx.array) -> mx.array:
    """The text model's token embedding (``slice_rule.embedding``: embed_tokens, or bailing_hybrid's
    word_embeddings; a wrapper's inside its language_model)."""
    return embedding(model)(inputs)


def _norm_and_head(model: Any, h: mx.array) -> mx.array:
    """Final norm, then lm_head, or the embedding as the head where the model has no lm_head (tied)."""
    h = text_model(model).norm(h)
    head = lm_head(model)
    return head(h) if head is not None else embedding(model).as_linear(h)


def _full_attention(model: Any, index: int) -> Hashable:
    return None


@dataclass(frozen=True)
class Family:
    """How one mlx-lm family's forward pass differs from the generic one around its decoder layers."""

    embed: Callable[[Any, mx.array], mx.array] = _embed_tokens  # (model, token ids [B, L]) -> hidden [B, L, D]
    head: Callable[[Any, mx.array], mx.array] = _norm_and_head  # (model, hidden) -> logits (final norm included)
    # (model, absolute layer index) -> the layer's attention kind: None (full), a sliding window's size, or LINEAR
    attention: Callable[[Any, int], Hashable] = _full_attention
    array_masks: bool = False  # masks as arrays, never "causal" (as the family's own forward asks for them)
    mask_cache: Callable[[Any], Any] = lambda cache: cache  # the cache a layer's mask is built from
    flow: type[Flow] = Flow
    # the text model's modules besides embed_tokens that ``embed`` reads (the first stage loads them, no other)
    embed_modules: tuple[str, ...] = ()
    # (model, start, end) -> None, or ModelError naming why layers [start, end) cannot be one slice
    check_slice: Callable[[Any, int, int], None] = lambda model, start, end: None
    # (model, absolute layer index) -> whether make_cache gives the layer a cache: where some layers own none
    # (nemotron_h's MLP and MoE layers), a slice holds the caches of its own layers, in order, and its
    # layers without one run with neither cache nor mask
    owns_cache: Callable[[Any, int], bool] = lambda model, index: True
    # whether make_cache's first cache is the embedding's, not a layer's (longcat_flash_ngram keeps the last
    # ids its n-grams read): the first slice holds it before its layers' caches, and ``embed`` takes it as a
    # third argument (model, token ids, that cache or None)
    embed_cache: bool = False


def _llama_attention(model: Any, index: int) -> Hashable:
    """llama's layer_types may mark layers "sliding_attention" (TransformerBlock.use_sliding)."""
    return model.model.sliding_window if model.model.layers[index].use_sliding else None


def _gemma3_embed(model: Any, inputs: mx.array) -> mx.array:
    h = model.model.embed_tokens(inputs)
    return h * mx.array(model.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)  # as Gemma3Model: via bfloat16


def _gemma3_attention(model: Any, index: int) -> Hashable:
    """Every sliding_window_pattern-th layer (counting from 1) is global; the others slide."""
    pattern = model.args.sliding_window_pattern
    return None if index % pattern == pattern - 1 else model.args.sliding_window


def _gpt_oss_attention(model: Any, index: int) -> Hashable:
    return model.model.window_size if model.model.layer_types[index] == "sliding_attention" else None


def _linear_or_full(model: Any, index: int) -> Hashable:
    """Hybrid linear-attention families (qwen3_next): the layer's own is_linear, set from its absolute index."""
    return LINEAR if model.model.layers[index].is_linear else None


def _sliding_or_full(model: Any, index: int) -> Hashable:
    """ministral3: the layer's own use_sliding, set from its absolute index."""
    return model.model.sliding_window if model.model.layers[index].use_sliding else None


def _gemma4_embed(model: Any, inputs: mx.array) -> mx.array:
    """The scaled embedding; with per-layer inputs (gemma-4 E2B/E4B), every layer's packed after it
    ([B, L, D + layers * P]), computed from the token ids and the embedding as Gemma4TextModel does, for
    ``Gemma4Flow`` to hand each layer its own and the next stage those of its layers."""
    inner = model.model
    h = inner.embed_tokens(inputs) * inner.embed_scale
    if not inner.hidden_size_per_layer_input:
        return h
    per_layer = inner._project_per_layer_inputs(h, inner._get_per_layer_inputs(inputs))  # [B, L, layers, P]
    return mx.concatenate([h, per_layer.reshape(*h.shape[:2], -1).astype(h.dtype)], axis=-1)


def _gemma4_head(model: Any, h: mx.array) -> mx.array:
    from mlx_lm.models.gemma4_text import logit_softcap

    out = _norm_and_head(model, h)
    cap = model.final_logit_softcapping
    return logit_softcap(cap, out) if cap is not None else out


def _gemma4_attention(model: Any, index: int) -> Hashable:
    return model.model.window_size if model.model.layers[index].layer_type == "sliding_attention" else None


# the per-layer input tables of gemma-4 E2B/E4B, which only the embedding hook reads
GEMMA4_PER_LAYER_MODULES = ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")


def _gemma4_slice_check(model: Any, start: int, end: int) -> None:
    """A KV-shared layer (the last num_kv_shared_layers) attends over the keys and values an earlier layer
    of its kind computes in the same forward pass (``previous_kvs``): both must be in one slice."""
    for index in range(start, end):
        source = model.model.previous_kvs[index]
        if source < start:
            raise ModelError(f"gemma4_text layer {index} reuses the KV cache of layer {source} (num_kv_shared_layers "
                             f"{model.args.num_kv_shared_layers}), which a stage of layers {start}-{end - 1} does "
                             f"not hold: a stage boundary cannot fall between layers {source} and {index}; put "
                             f"layers {source}-{index} on one stage")


def _gemma2_embed(model: Any, inputs: mx.array) -> mx.array:
    return model.model.embed_tokens(inputs) * (model.args.hidden_size**0.5)  # as GemmaModel: a Python float


def _gemma2_head(model: Any, h: mx.array) -> mx.array:
    cap = model.final_logit_softcapping
    return mx.tanh(_norm_and_head(model, h) / cap) * cap


def _granite_embed(model: Any, inputs: mx.array) -> mx.array:
    return model.model.embed_tokens(inputs) * model.model.embedding_multiplier


def _granite_head(model: Any, h: mx.array) -> mx.array:
    return _norm_and_head(model, h) / model.logits_scaling


def _cohere2_head(model: Any, h: mx.array) -> mx.array:
    return _norm_and_head(model, h) * model.model.args.logit_scale


def _mla_or_linear(model: Any, index: int) -> Hashable:
    """bailing_hybrid: MLA in its global layers (every layer_group_size-th, and the tail), GLA in the others."""
    return None if text_model(model).layers[index].is_global else LINEAR


def _bailing_slice_check(model: Any, start: int, end: int) -> None:
    """bailing_hybrid's linear-attention layers read the position from an MLA layer's cache of their stage."""
    if not any(layer.is_global for layer in text_model(model).layers[start:end]):
        raise ModelError(f"bailing_hybrid layers {start}-{end - 1} hold no MLA layer (every "
                         f"{model.args.layer_group_size}th layer): its linear-attention layers read the position "
                         f"from an MLA layer's cache, so each stage must hold one")


def _nemotron_h_owns_cache(model: Any, index: int) -> bool:
    """nemotron_h: make_cache gives its Mamba ("M") and attention ("*") layers a cache, not its MLP ("-") and
    MoE ("E") ones (its forward's cache_counter)."""
    return text_model(model).layers[index].block_type in ("M", "*")


def _nemotron_h_attention(model: Any, index: int) -> Hashable:
    """nemotron_h: attention ("*") layers full, Mamba ("M") layers an SSM mask (the MLP / MoE ones none)."""
    return None if text_model(model).layers[index].block_type == "*" else LINEAR


def _deepseek_v41_slice_check(model: Any, start: int, end: int) -> None:
    """deepseek_v41's attention shares state with later layers in the same forward pass (compressed KV and
    index keys of a source layer, the top-k of an index layer, the candidate blocks); mlx-lm's pipeline
    sends it beside the streams, in shapes that grow with the position, which a stage boundary here does
    not carry: no stage may start where a later layer reads such state from an earlier one."""
    from mlx_lm.models.deepseek_v41 import _crossing

    crossing = _crossing(text_model(model).args, start) if start else {}
    if crossing:
        key, source = next(iter(crossing.items()))
        raise ModelError(f"deepseek_v41 layers from {start} on read the {key} that layer {source} computes in the "
                         f"same forward pass (compress_ratios, kv_source_layer_ids, index_source_layer_ids, "
                         f"candidate_source_layer_id), which a stage boundary does not carry: a stage cannot "
                         f"start at layer {start}")


def _falcon_h1_head(model: Any, h: mx.array) -> mx.array:
    """As falcon_h1's Model: a tied head scales by lm_head_multiplier / embedding_multiplier (an untied
    lm_head has them folded in by sanitize)."""
    out = norm_and_head(model, h)
    args = model.args
    return out * (args.lm_head_multiplier / args.embedding_multiplier) if lm_head(model) is None else out


def _ngram_embed(model: Any, inputs: mx.array, cache: Any) -> mx.array:
    """longcat_flash_ngram: the token embedding plus its n-gram tables, reading (and keeping in ``cache``, an
    ArraysCache of one) the previous emb_neighbor_num - 1 ids of each row, as LongcatFlashNgramModel."""
    return text_model(model).ngram_embeddings(inputs, cache=cache)


def _muse_spark_embed(model: Any, inputs: mx.array) -> mx.array:
    """muse_spark: the normed token embedding, as the fp32 stream its layers carry."""
    return text_model(model).embed(inputs).astype(mx.float32)


def _muse_spark_head(model: Any, h: mx.array) -> mx.array:
    """As muse_spark's forward: the final norm in bfloat16, cast to lm_head's dtype, scaled by
    output_multiplier in float32 and soft-capped."""
    text = model.args.text
    out = model.lm_head(text_model(model).norm(h).astype(mx.bfloat16).astype(model.lm_head.weight.dtype))
    out = out.astype(mx.float32) * text.output_multiplier
    return mx.tanh(out / text.final_logit_softcapping) * text.final_logit_softcapping


def _muse_spark_attention(model: Any, index: int) -> Hashable:
    inner = text_model(model)
    return inner.sliding_window if inner.layers[index].use_sliding else None


GENERIC = Family()

# Keyed by the mlx-lm module (mlx_lm.models.<name>) whose Model the checkpoint loads into.
FAMILIES: dict[str, Family] = {
    "llama": Family(attention=_llama_attention),
    "qwen2": GENERIC,
    "qwen3": GENERIC,
    "qwen3_moe": GENERIC,
    "mixtral": GENERIC,
    "phi3": GENERIC,
    "gemma3_text": Family(embed=_gemma3_embed, attention=_gemma3_attention),
    # MLA caches latents in a KVCache and adds the mask to its rope scores, so it must be an array; the dense
    # leading layers (first_k_dense_replace) are chosen inside each layer, by its own index
    "deepseek_v3": Family(array_masks=True),
    "gpt_oss": Family(attention=_gpt_oss_attention),  # attention sinks live in the attention module
    "glm4_moe": GENERIC,
    "qwen3_next": Family(attention=_linear_or_full),
    "qwen3_5": Family(attention=_linear_or_full),  # qwen3_5_moe's Model subclasses qwen3_5's
    "qwen3_5_moe": Family(attention=_linear_or_full),
    "ernie4_5": GENERIC,
    "ernie4_5_moe": GENERIC,  # dense leading layers (moe_layer_start_index) are chosen inside each layer
    "hunyuan_v1_dense": GENERIC,
    "minimax": GENERIC,
    "ministral3": Family(attention=_sliding_or_full, flow=Ministral3Flow),
    # the lightning indexer's cache rides beside MLA's in a CacheList; the mask comes from MLA's
    "deepseek_v32": Family(array_masks=True, mask_cache=lambda cache: cache[0] if cache else None),
    "gemma4_text": Family(embed=_gemma4_embed, head=_gemma4_head, attention=_gemma4_attention, flow=Gemma4Flow,
                          check_slice=_gemma4_slice_check, embed_modules=GEMMA4_PER_LAYER_MODULES),
    # Kimi Delta Attention (linear) and MLA layers by absolute index, MLA's masks as arrays
    "kimi_k3": Family(attention=_linear_or_full, array_masks=True, flow=KimiK3Flow),
    # plain decoders but for a scaled embedding or scaled / soft-capped logits (the rest as the rule:
    # mlxcel.engine.slice_rule, each layer's mask kind read from its cache)
    "gemma2": Family(embed=_gemma2_embed, head=_gemma2_head, array_masks=True),
    "granitemoe": Family(embed=_granite_embed, head=_granite_head),
    "granitemoehybrid": Family(embed=_granite_embed, head=_granite_head, attention=cache_attention),
    "cohere2": Family(head=_cohere2_head, attention=cache_attention),
    "mistral4": Family(flow=Ministral3Flow),  # MLA with ministral3's llama 4 query scale, passed to each layer
    # MLA (array masks) / linear attention (GLA) by each layer's is_global; the embedding is word_embeddings
    "bailing_hybrid": Family(attention=_mla_or_linear, array_masks=True, flow=BailingHybridFlow,
                             check_slice=_bailing_slice_check),
    # cross-layer attention: a group's later layers reuse its first layer's key / value projections, carried
    # beside h across a boundary inside a group (HunyuanFlow)
    "hunyuan": Family(flow=HunyuanFlow),
    # Mamba-2 beside attention in every layer (a CacheList of both), masks by keyword; a scaled tied head
    "falcon_h1": Family(head=_falcon_h1_head, flow=FalconH1Flow, mask_cache=lambda cache: None),
    # two MLA sublayers per layer, a CacheList of their two KV caches, the one mask from the first's
    "longcat_flash": Family(array_masks=True, mask_cache=lambda cache: cache[0] if cache else None),
    # longcat_flash's layers (its row) under an embedding that adds n-gram tables of the ids and owns a cache
    "longcat_flash_ngram": Family(embed=_ngram_embed, embed_cache=True, embed_modules=("ngram_embeddings",),
                                  array_masks=True, mask_cache=lambda cache: cache[0] if cache else None),
    # multimodal wrappers: the text model inside (language_model.model, its lm_head beside it) is sliced
    "kimi_k25": Family(array_masks=True),  # deepseek_v3's text model
    # each layer's CacheList holds the attention's KV (then, in sparse layers, the indexer's keys): the
    # one full-attention mask comes from the first layer's KV, as TextModel builds it
    "minimax_m3_vl": Family(mask_cache=lambda cache: cache[0] if cache else None),
    # a wrapper (model.model.language_model); each layer hands the next its normed input, remade at a boundary
    # (MuseSparkFlow); sliding / full layers; a normed embedding, a cast, scaled and soft-capped head
    "muse_spark": Family(embed=_muse_spark_embed, head=_muse_spark_head, attention=_muse_spark_attention,
                         flow=MuseSparkFlow),
    # chunked local / global attention, each with the mask the text model builds per forward pass (Llama4Flow)
    "llama4": Family(flow=Llama4Flow, mask_cache=lambda cache: None),
    # hyper-connections: hc_mult residual streams and their mix carried beside each other across a boundary
    # (DeepseekV41Flow); each layer's own LayerCache, made by the text model; boundaries that shared
    # attention state would cross are refused
    "deepseek_v41": Family(flow=DeepseekV41Flow, mask_cache=lambda cache: None,
                           check_slice=_deepseek_v41_slice_check),
    # text model backbone (embeddings, norm_f); Mamba-2 / attention / MLP / MoE layers by the pattern, caches
    # for the first two only (``owns_cache``)
    "nemotron_h": Family(head=norm_and_head, attention=_nemotron_h_attention, owns_cache=_nemotron_h_owns_cache),
}

# mlx-lm families with pipeline() or shard() hooks that neither the rule nor a row slices, and why (any other
# family the rule refuses gets the rule's reason; tests/engine/test_slice_rule.py checks every hooked family)
REFUSED: dict[str, str] = {
    "iquestloopcoder": "it runs all its layers twice per forward pass (loop_num 2): the second pass starts from "
                       "the first pass's last hidden state and reads every layer's first-pass keys and values, so "
                       "the activation would go round the stages a second time, which a pipeline of contiguous "
                       "layer ranges does not do",
}


def family_of(model: Any) -> Family:
    """The slicing hooks of ``model``'s family: its ``FAMILIES`` row, else the generic slice by rule
    (``mlxcel.engine.slice_rule``); ModelError naming the family and why when it is neither."""
    module = type(model).__module__
    name = module[len(MLX_LM_MODELS):] if module.startswith(MLX_LM_MODELS) else None
    kind = getattr(model, "model_type", None) or name or type(model).__name__
    if name is None or type(model).__name__ != "Model":
        raise ModelError(f"model family {kind!r} cannot be sliced into pipeline stages: it is not an mlx-lm "
                         f"Model")
    if name in REFUSED:
        raise ModelError(f"model family {kind!r} cannot be sliced into pipeline stages: {REFUSED[name]}")
    return FAMILIES.get(name) or _inherited(model) or Family(**rule_parts(model, kind))


def _inherited(model: Any) -> Family | None:
    """The row of an mlx-lm Model that ``model``'s class subclasses without its own forward (glm_moe_dsa on
    deepseek_v32, prism_hadamard_qwen35 on qwen3_5), or None."""
    for base in type(model).__mro__[1:]:
        module = base.__module__
        if base.__name__ == "Model" and module.startswith(MLX_LM_MODELS) and module[len(MLX_LM_MODELS):] in FAMILIES:
            same = base.__call__ is type(model).__call__
            return FAMILIES[module[len(MLX_LM_MODELS):]] if same else None
    return None


def make_mask(h: mx.array, cache: Any, kind: Hashable, array: bool = False) -> Any:
    """The mask mlx-lm's forward builds for layers of attention ``kind`` (see ``Family.attention``)."""
    if kind == LINEAR:
        return create_ssm_mask(h, cache)
    return create_attention_mask(h, cache, window_size=kind, return_array=array)


@dataclass
class ModelSlice:
    """Layers [start, end) of ``model``; the first slice embeds, the last applies norm and head."""

    model: Any
    start: int
    end: int
    family: Family = field(init=False, repr=False)
    kinds: list = field(init=False, repr=False)  # each layer's attention kind (Family.attention), read once
    owners: list = field(init=False, repr=False)  # whether each layer owns a cache (Family.owns_cache)
    cache_start: int = field(init=False, repr=False)  # where the slice's caches begin in the model's list

    def __post_init__(self) -> None:
        self.family = family_of(self.model)
        total = len(text_model(self.model).layers)
        if not 0 <= self.start < self.end <= total:
            raise ModelError(f"layer range {self.start}-{self.end - 1} is outside the model's 0-{total - 1}")
        self.family.check_slice(self.model, self.start, self.end)
        self.kinds = [self.family.attention(self.model, index) for index in range(self.start, self.end)]
        self.owners = [self.family.owns_cache(self.model, index) for index in range(self.start, self.end)]
        lead = int(self.family.embed_cache and self.start > 0)  # the embedding's cache, held by the first slice
        self.cache_start = lead + sum(self.family.owns_cache(self.model, index) for index in range(self.start))

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == len(text_model(self.model).layers)

    @property
    def layers(self) -> list:
        return text_model(self.model).layers[self.start:self.end]

    @property
    def cache_count(self) -> int:
        """How many caches the slice owns, its layers' (and the first slice the embedding's, where the family's
        embedding has one): its share of the model's cache list."""
        return sum(self.owners) + int(self.family.embed_cache and self.is_first)

    def make_cache(self) -> list:
        """The caches of the slice's layers, of the types the family asks for: the model's make_cache from
        the slice's first (``cache_start``), one per layer that owns one (none for gemma4_text's KV-shared
        layers, the model's last, nor nemotron_h's MLP / MoE layers). The stages' lists, joined, are the
        model's."""
        make = getattr(self.model, "make_cache", None)
        if make is not None:
            return make()[self.cache_start:self.cache_start + self.cache_count]
        return [KVCache() for _ in self.layers]

    def _embed(self, inputs: mx.array, cache: list | None) -> tuple[mx.array, list | None]:
        """The first slice's embedding of the token ids, and the caches left for its layers (a family whose
        embedding owns a cache takes it off the front: ``Family.embed_cache``)."""
        if not self.family.embed_cache:
            return self.family.embed(self.model, inputs), cache
        return self.family.embed(self.model, inputs, cache[0] if cache else None), (cache[1:] if cache else cache)

    def _layer_caches(self, cache: list | None) -> list:
        """The slice's caches (``make_cache``'s list) laid out one per layer: None for a layer without one."""
        owned = iter(cache or ())
        return [next(owned, None) if owns else None for owns in self.owners]

    @property
    def input_width(self) -> int:
        """The last dimension of the hidden states this slice takes (not the first slice): the model's
        hidden size, or more where the family carries more across a boundary (``Flow.width``)."""
        return self.family.flow.width(self.model, self.start)

    def __call__(self, inputs: mx.array, cache: list | None = None, *, overlap: bool = False) -> mx.array:
        """Token ids [B, L] (first slice) or hidden states [B, L, input_width] -> hidden states
        [B, L, Flow.width at end] or logits. With ``overlap`` each layer's output is queued
        (``mx.async_eval``) as soon as it is built, so the device computes it while Python builds the next."""
        h, cache = self._embed(inputs, cache) if self.is_first else (inputs, cache)
        cache = self._layer_caches(cache)  # None: no cache of its own
        flow = self.family.flow(self.model, self.start, h, cache)
        masks: dict[Hashable, Any] = {}
        for index, layer, layer_cache, kind, owns in zip(range(self.start, self.end), self.layers, cache,
                                                         self.kinds, self.owners):
            if not owns:  # a layer without a cache (nemotron_h's MLP / MoE) takes no mask either
                flow.layer(index, layer, None, None)
                continue
            if kind not in masks:  # as mlx-lm: one mask per attention kind, from its first layer's cache
                masks[kind] = make_mask(flow.h, self.family.mask_cache(layer_cache), kind, self.family.array_masks)
            flow.layer(index, layer, masks[kind], layer_cache)
            if overlap:
                mx.async_eval(flow.pending())
        out = flow.leave(self.is_last)
        return self.family.head(self.model, out) if self.is_last else out
