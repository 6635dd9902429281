"""What one forward pass through a model slice carries from layer to layer and across a stage boundary.

The generic ``Flow`` carries the hidden state [B, L, D] and calls ``layer(h, mask, cache=c)``, as
most mlx-lm families' forward passes do. A family whose layers take or return more has its own
(``model_slice.FAMILIES`` names it): ministral3 passes llama 4's position-dependent query scale,
gemma4_text hands each layer its per-layer input and KV-shared layers an earlier layer's KV (the
per-layer inputs of later layers cross a stage boundary packed beside h), and kimi_k3 carries its
attention residuals, whose block summaries cross a stage boundary packed beside h ([B, L, (1 +
blocks) * D]; docs/pipeline.md §3.3). ``Flow.width`` is the exact width a stage takes, which it checks.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def hidden_size(model: Any) -> int:
    """The model's hidden size, read from its final norm (wrapper configs such as kimi_k3's nest it; jamba
    and lfm2 name it otherwise: ``slice_rule.final_norm_name``)."""
    from mlxcel.engine.slice_rule import final_norm_name, text_model

    return int(getattr(text_model(model), final_norm_name(model)).weight.shape[0])


class Flow:
    """What one forward pass through a slice carries from layer to layer: here, the hidden state alone.

    Built per forward pass from the slice's first layer index, the embedding (first slice) or what the
    previous stage sent (``width(model, start)`` wide in its last axis), and the slice's caches;
    ``layer`` runs one layer on it; ``leave`` returns what the next stage receives (``width(model,
    end)`` wide) or, from the last slice, the hidden state the head reads. A family whose layers pass
    more subclasses it.
    """

    def __init__(self, model: Any, start: int, carried: mx.array, cache: list):
        self.model = model
        self.h = carried

    @staticmethod
    def width(model: Any, boundary: int) -> int:
        """The last dimension of what crosses the boundary before layer ``boundary``."""
        return hidden_size(model)

    def layer(self, index: int, layer: Any, mask: Any, cache: Any) -> None:
        self.h = layer(self.h, mask, cache=cache)

    def pending(self) -> list[mx.array]:
        """What the layers so far computed (queued early by ``ModelSlice``'s ``overlap``)."""
        return [self.h]

    def leave(self, last: bool) -> mx.array:
        return self.h


class Ministral3Flow(Flow):
    """ministral3 scales its queries by llama 4's factor of the absolute position, one per forward pass."""

    def __init__(self, model: Any, start: int, carried: mx.array, cache: list):
        from mlx_lm.models.ministral3 import _get_llama_4_attn_scale

        super().__init__(model, start, carried, cache)
        rope = model.args.rope_parameters
        offset = cache[0].offset if cache and cache[0] is not None else 0
        self.scale = _get_llama_4_attn_scale(carried.shape[1], offset, rope["llama_4_scaling_beta"],
                                             rope["original_max_position_embeddings"]).astype(carried.dtype)

    def layer(self, index: int, layer: Any, mask: Any, cache: Any) -> None:
        self.h = layer(self.h, self.scale, mask, cache=cache)


class Llama4Flow(Flow):
    """llama4 (text): chunked local attention in the layers whose attention uses rope (all but every 4th),
    global attention in the others. As ``LlamaModel`` does per forward pass, each chunked cache is first
    trimmed to its chunk, then one chunk mask is built from the first chunked cache's kept start and offset
    (0 and 0 without caches), and one global mask from the first global layer's cache."""

    def __init__(self, model: Any, start: int, carried: mx.array, cache: list):
        from mlx_lm.models.base import create_attention_mask

        from mlxcel.engine.slice_rule import text_model

        super().__init__(model, start, carried, cache)
        inner = text_model(model)
        self.chunked = [bool(inner.layers[start + i].self_attn.use_rope) for i in range(len(cache))]
        local = [c for c, chunked in zip(cache, self.chunked) if chunked and c is not None]
        for c in local:
            c.maybe_trim_front()
        begin, offset = (local[0].start_position, local[0].offset) if local else (0, 0)
        end = offset + carried.shape[1]
        keys, queries = mx.arange(begin, end), mx.arange(offset, end)[:, None]
        size = inner.attention_chunk_size
        self.chunk_mask = (mx.abs(keys // size - queries // size) == 0) & (keys <= queries)
        glob = next((c for c, chunked in zip(cache, self.chunked) if not chunked), None)
        self.global_mask = create_attention_mask(carried, glob)
        self.start = start

    def layer(self, index: int, layer: Any, mask: Any, cache: Any) -> None:
        own = self.chunk_mask if self.chunked[index - self.start] else self.global_mask
        self.h = layer(self.h, own, cache=cache)


class BailingHybridFlow(Flow):
    """bailing_hybrid: its linear-attention (GLA) layers rope their queries and keys at the position offset,
    which the forward reads once from the first MLA layer's KV cache: a stage reads it from its own first
    MLA layer's (``model_slice`` refuses a stage without one, as mlx-lm's pipeline split does)."""

    def __init__(self, model: Any, start: int, carried: mx.array, cache: list):
        from mlxcel.engine.slice_rule import text_model

        super().__init__(model, start, carried, cache)
        layers = text_model(model).layers
        mla = next((c for i, c in enumerate(cache) if layers[start + i].is_global and c is not None), None)
        self.offset = mla.offset if mla is not None else 0

    def layer(self, index: int, layer: Any, mask: Any, cache: Any) -> None:
        self.h = layer(self.h, mask, cache, offset=self.offset)


class MuseSparkFlow(Flow):
    """muse_spark: each layer returns the fp32 stream and the next layer's normed attention input (its norm
    fused with the layer's last add); a stage after the first makes its first layer's from the stream it
    receives with ``pre_norm`` (equal to the fused norm), as mlx-lm's own pipeline does, so only the stream
    crosses a boundary."""

    def __init__(self, model: Any, start: int, carried: mx.array, cache: list):
        from mlx_lm.models import muse_spark

        from mlxcel.engine.slice_rule import text_model

        super().__init__(model, start, carried, cache)
        self.layers = text_model(model).layers
        self.attn_input = None
        if start:
            norm = self.layers[start].input_layernorm
            self.attn_input = muse_spark.pre_norm(carried, norm, dtype=norm.weight.dtype)

    def layer(self, index: int, layer: Any, mask: Any, cache: Any) -> None:
        following = self.layers[index + 1].input_layernorm if index + 1 < len(self.layers) else None
        self.h, self.attn_input = layer(self.h, mask=mask, cache=cache, attn_input=self.attn_input,
                                        next_norm=following)


def _cla_width(model: Any, boundary: int) -> int:
    """hunyuan: the width of the shared key and value projections crossing a boundary inside a group of
    ``cla_share_factor`` layers (2 x key/value heads x head dim), 0 at a group's start or without CLA."""
    from mlxcel.engine.slice_rule import text_model

    args, layers = model.args, text_model(model).layers
    factor = args.cla_share_factor if args.use_cla else 1
    if boundary % factor == 0 or boundary >= len(layers):
        return 0
    return 2 * int(layers[boundary - boundary % factor].self_attn.k_proj.weight.shape[0])


class HunyuanFlow(Flow):
    """hunyuan with cross-layer attention (``use_cla``): the first layer of each group of ``cla_share_factor``
    projects keys and values that the group's later layers reuse in the same forward pass. A boundary inside
    a group carries them beside h: [B, L, D + 2 * KV] (h, keys, values; KV = key/value heads x head dim)."""

    def __init__(self, model: Any, start: int, carried: mx.array, cache: list):
        super().__init__(model, start, carried, cache)
        self.shared, self.next = None, start
        extra = _cla_width(model, start)
        if extra:
            d = hidden_size(model)
            self.h = carried[..., :d]
            self.shared = (carried[..., d:d + extra // 2], carried[..., d + extra // 2:])

    @staticmethod
    def width(model: Any, boundary: int) -> int:
        return hidden_size(model) + _cla_width(model, boundary)

    def layer(self, index: int, layer: Any, mask: Any, cache: Any) -> None:
        args = self.model.args
        if not args.use_cla or index % args.cla_share_factor == 0:  # as HunYuanModel: a group's first projects
            self.shared = None
        self.h, self.shared = layer(self.h, mask, cache, self.shared)
        self.next = index + 1

    def leave(self, last: bool) -> mx.array:
        if last or not _cla_width(self.model, self.next):
            return self.h
        return mx.concatenate([self.h, *(kv.astype(self.h.dtype) for kv in self.shared)], axis=-1)


class FalconH1Flow(Flow):
    """falcon_h1: each layer runs Mamba-2 and attention side by side over a CacheList (ArraysCache, KVCache)
    and takes both masks by keyword; as FalconH1Model, one of each per forward pass from the first layer's
    caches (the stage's first)."""

    def __init__(self, model: Any, start: int, carried: mx.array, cache: list):
        from mlx_lm.models.base import create_attention_mask, create_ssm_mask

        super().__init__(model, start, carried, cache)
        first = cache[0] if cache and cache[0] is not None else (None, None)
        self.mamba_mask = create_ssm_mask(carried, first[0])
        self.attn_mask = create_attention_mask(carried, first[1])

    def layer(self, index: int, layer: Any, mask: Any, cache: Any) -> None:
        self.h = layer(self.h, cache=cache if cache is not None else (None, None), attn_mask=self.attn_mask,
                       mamba_mask=self.mamba_mask)


def _per_layer_width(model: Any) -> int:
    """gemma4_text: the width P of each layer's per-layer input (gemma-4 E2B/E4B), 0 without them."""
    return int(model.model.hidden_size_per_layer_input or 0)


class Gemma4Flow(Flow):
    """gemma4_text's layers take a per-layer input and an earlier layer's KV, and return (h, kv, offset).

    Per-layer inputs (E2B/E4B: ``hidden_size_per_layer_input`` P > 0) come from the first slice's
    embedding hook, packed after h; each layer takes its own and a boundary carries those of the
    layers after it: [B, L, D + (layers - boundary) * P]. A KV-shared layer (the model's last
    ``num_kv_shared_layers``) attends over the keys, values and offset the layer ``previous_kvs``
    names returned in this forward pass, which the slice check keeps in the same slice; the others
    run on their own cache, as in Gemma4TextModel.
    """

    def __init__(self, model: Any, start: int, carried: mx.array, cache: list):
        super().__init__(model, start, carried, cache)
        self.start, self.ran = start, 0
        self.kvs: dict[int, tuple] = {}  # layer index -> the (keys, values) and offset it returned
        self.per_layer = None
        width = _per_layer_width(model)
        if width:
            d = hidden_size(model)
            self.h = carried[..., :d]
            self.per_layer = carried[..., d:].reshape(*carried.shape[:2], -1, width)  # [B, L, layers left, P]

    @staticmethod
    def width(model: Any, boundary: int) -> int:
        return hidden_size(model) + (len(model.model.layers) - boundary) * _per_layer_width(model)

    def layer(self, index: int, layer: Any, mask: Any, cache: Any) -> None:
        kvs, offset = self.kvs.get(self.model.model.previous_kvs[index], (None, None))
        own = self.per_layer[:, :, index - self.start, :] if self.per_layer is not None else None
        self.h, kvs, offset = layer(self.h, mask, cache, per_layer_input=own, shared_kv=kvs, offset=offset)
        self.kvs[index] = (kvs, offset)
        self.ran += 1

    def leave(self, last: bool) -> mx.array:
        if last or self.per_layer is None:
            return self.h
        rest = self.per_layer[:, :, self.ran:, :]
        return mx.concatenate([self.h, rest.reshape(*self.h.shape[:2], -1)], axis=-1)


def _residual_blocks(model: Any, boundary: int) -> int:
    """kimi_k3: the attention-residual blocks begun before layer ``boundary`` (a block starts every
    attn_res_block_size layers, at layer 0 first); 0 without attention residuals."""
    size = model.model.args.attn_res_block_size
    return -(-boundary // size) if size else 0


class KimiK3Flow(Flow):
    """kimi_k3 with attention residuals: each layer mixes the summaries of the blocks begun so far
    (``ResidualBlocks``) into its input, and the final norm's input too. A stage boundary carries those
    summaries beside h, packed along the last axis: [B, L, (blocks + 1) * D], blocks first, as
    mlx-lm's own pipeline packs them (its recv of [in_blocks + 1, B, L, D])."""

    def __init__(self, model: Any, start: int, carried: mx.array, cache: list):
        from mlx_lm.models.kimi_k3 import ResidualBlocks

        super().__init__(model, start, carried, cache)
        args = model.model.args
        self.dtype = carried.dtype
        self.blocks = ResidualBlocks(args.rms_norm_eps) if args.attn_res_block_size else None
        count = _residual_blocks(model, start)
        if self.blocks is not None and count:
            d = hidden_size(model)
            packed = carried.reshape(*carried.shape[:2], count + 1, d)
            self.h = packed[..., count, :]
            self.blocks.raw = packed[..., :count, :].transpose(2, 0, 1, 3)  # [blocks, B, L, D]
            xf = self.blocks.raw.astype(mx.float32)
            self.blocks.inv_rms = mx.rsqrt((xf * xf).mean(axis=-1) + args.rms_norm_eps)

    @staticmethod
    def width(model: Any, boundary: int) -> int:
        return hidden_size(model) * (_residual_blocks(model, boundary) + 1)

    def layer(self, index: int, layer: Any, mask: Any, cache: Any) -> None:
        self.h, self.blocks = layer(self.h, mask=mask, cache=cache, blocks=self.blocks)

    def leave(self, last: bool) -> mx.array:
        if self.blocks is None or self.blocks.raw is None:
            return self.h
        if last:  # as KimiK3TextModel: the output mix of every block and h, then the final norm (the head)
            from mlx_lm.models.kimi_k3 import _attn_res_mix

            inner = self.model.model
            w_eff = inner.output_attn_res_norm.weight.astype(mx.float32) * inner.output_attn_res_proj.weight.reshape(-1)
            return _attn_res_mix(self.blocks, self.h, w_eff, inner.args.rms_norm_eps)
        raw = self.blocks.raw.transpose(1, 2, 0, 3)  # [B, L, blocks, D]
        packed = mx.concatenate([raw, self.h[..., None, :]], axis=2).astype(self.dtype)
        return packed.reshape(*self.h.shape[:2], -1)


def _streams(model: Any) -> int:
    """deepseek_v41: the residual streams its hyper-connections mix (hc_mult)."""
    from mlxcel.engine.slice_rule import text_model

    return int(text_model(model).args.hc_mult)


def _activation_itemsize(model: Any) -> int:
    """The bytes of one element of the hidden state: the token embedding's output dtype (its scales' where
    quantized)."""
    from mlxcel.engine.slice_rule import embedding

    table = embedding(model)
    return int(getattr(table, "scales", table.weight).dtype.size)


class DeepseekV41Flow(Flow):
    """deepseek_v41: hyper-connections carry ``hc_mult`` residual streams [B, L, hc, D] from layer to layer,
    with the float32 mix [B, L, hc] that the next layer collapses them by (``pre_mix``); each layer also
    takes the position, the window rows it attends to, and the state its attention shares with later
    layers (compressed KV, index keys, top-k, candidates: ``model_slice`` refuses a boundary any of it
    would cross). A boundary carries the streams and the mix packed along the last axis, the mix's float32
    bits as activation-dtype lanes: [B, L, hc * D + hc * 4 / itemsize], as mlx-lm's own pipeline sends
    both; the last slice collapses them by the mix for the final norm."""

    def __init__(self, model: Any, start: int, carried: mx.array, cache: list):
        from mlx_lm.models.deepseek_v41 import LayerCache, _window_indices

        from mlxcel.engine.slice_rule import text_model

        super().__init__(model, start, carried, cache)
        self.args = args = text_model(model).args
        self.fresh = lambda: LayerCache(args.sliding_window)  # a layer run without a cache of its own
        first = cache[0] if cache and cache[0] is not None else self.fresh()
        batch, length = carried.shape[:2]
        self.start_pos = first.offset
        previous = 0 if first.window is None else first.window.shape[1]  # every layer's window holds the same rows
        window = _window_indices(previous=previous, length=length, window=args.sliding_window)
        self.window_idx = mx.broadcast_to(window, (batch, *window.shape))
        hc, d = args.hc_mult, args.hidden_size
        if start == 0:  # the embedding, as TextModel: every stream a copy of it, the first one collapsed
            self.streams = mx.broadcast_to(carried[:, :, None, :], (batch, length, hc, d))
            self.pre_mix = mx.zeros((batch, length, hc), dtype=mx.float32)
            self.pre_mix[..., 0] = 1.0
        else:
            self.streams = carried[..., :hc * d].reshape(batch, length, hc, d)
            self.pre_mix = carried[..., hc * d:].view(mx.float32)
        self.shared: dict[str, Any] = {}

    @staticmethod
    def width(model: Any, boundary: int) -> int:
        return _streams(model) * hidden_size(model) + _streams(model) * 4 // _activation_itemsize(model)

    def layer(self, index: int, layer: Any, mask: Any, cache: Any) -> None:
        self.streams, self.pre_mix = layer(self.streams, self.pre_mix, start_pos=self.start_pos,
                                           window_idx=self.window_idx, cache=cache if cache is not None else
                                           self.fresh(), shared=self.shared)

    def pending(self) -> list[mx.array]:
        return [self.streams]

    def leave(self, last: bool) -> mx.array:
        from mlx_lm.models.deepseek_v41 import _collapse

        if last:
            return _collapse(self.streams, self.pre_mix)
        batch, length = self.streams.shape[:2]
        flat = self.streams.reshape(batch, length, -1)
        return mx.concatenate([flat, self.pre_mix.view(flat.dtype)], axis=-1)
