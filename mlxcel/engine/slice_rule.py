"""Pipeline slicing by rule: a plain decoder slices without a ``model_slice.FAMILIES`` row.

A family's mlx-lm ``Model`` follows the rule when it has the common shape the generic slice
re-implements, read from the model object and the source of its two forward passes:

- the text model's token embedding (``model.model.embed_tokens``, else its one ``Embedding``:
  bailing_hybrid's ``word_embeddings``) embeds the token ids, unscaled, and nothing else is embedded
  (no per-layer inputs, no second embedding);
- ``model.model.layers`` is a list of layers each called ``layer(h, mask, cache)`` (nothing more, such
  as a position offset) that returns only the next hidden state (no state handed to the next layer, no other layer's cache read);
- the inner forward ends ``return self.<norm>(h)`` (its final norm, whatever its name);
- the outer forward applies ``lm_head`` or the tied embedding to that and returns it unchanged
  (no soft-cap, no logit scale);
- every mask is mlx-lm's ``create_attention_mask`` / ``create_ssm_mask``, one per layer kind, and
  ``make_cache`` (if any) gives one cache per layer, each a ``KVCache`` (full attention), a
  ``RotatingKVCache`` (a sliding window of its ``max_size``) or an ``ArraysCache`` (linear attention,
  an SSM mask): the kind of each layer's mask is read from its cache.

A family that breaks the rule is refused by name with the first reason found (``rule_parts``).
"""

from __future__ import annotations

import inspect
import re
from functools import lru_cache
from typing import Any, Callable, Hashable

import mlx.core as mx
import mlx.nn as nn

from mlxcel.models.errors import ModelError

LINEAR = "linear"  # as model_slice.LINEAR: an SSM mask, no window

# (pattern in the inner forward's source, why it breaks the rule)
INNER_BREAKS: tuple[tuple[str, str], ...] = (
    (r"per_layer", "it feeds each layer a per-layer input beside the hidden state"),
    (r"embedding_multiplier|embed_scale|hidden_size\s*\*\*\s*0\.5|h\s*=\s*h\s*\*",
     "it scales its embedding"),
    (r"^\s*\w+\s*,\s*\w+\s*=\s*layer\(", "its layers return state the next layer reads (e.g. shared KV)"),
    (r"cache\[\w+\]\[", "each layer holds several caches, each with its own mask"),
    (r"cache_counter", "some of its layers have no cache"),
    (r"=\s*layer\((?:[^(),]+,){3}", "its forward hands each layer more than (hidden, mask, cache) (e.g. a position "
                                   "offset)"),
)
OUTER_BREAKS: tuple[tuple[str, str], ...] = (
    (r"tanh|softcap", "it soft-caps its logits"),
    (r"logit_scale|logits_scaling|multiplier", "it scales its logits"),
)
_MASK_CALL = re.compile(r"mask\w*\s*=\s*(\w+)\(")
_STANDARD_MASKS = {"create_attention_mask", "create_ssm_mask"}
_FINAL_NORM = re.compile(r"return\s+self\.(\w+)\(\s*\w+\s*\)\s*$")


def _source(fn: Callable) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def cache_kind(cache: Any) -> Hashable:
    """A layer's attention kind from its cache (see ``model_slice.Family.attention``); ValueError for others."""
    from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

    if isinstance(cache, RotatingKVCache):
        return cache.max_size
    if isinstance(cache, ArraysCache):
        return LINEAR
    if type(cache) in (KVCache, QuantizedKVCache):  # full attention (--kv-bits: mlxcel.engine.kv_quant)
        return None
    raise ValueError(f"its layers' {type(cache).__name__} is not a KVCache, RotatingKVCache or ArraysCache")


def cache_attention(model: Any, index: int) -> Hashable:
    """The attention kind of layer ``index``, read from the cache the model makes for it."""
    make = getattr(model, "make_cache", None)
    return cache_kind(make()[index]) if make is not None else None


def text_model(model: Any) -> Any:
    """The text model whose layers a slice runs: ``model.model`` (multimodal wrappers such as kimi_k25 alias
    it to their language model's), else a wrapper's ``language_model.model`` (llama4 has no alias), else the
    model's one child holding a ``layers`` list (nemotron_h's ``backbone``)."""
    inner = getattr(model, "model", None)
    if inner is not None:
        return inner
    if "language_model" in model:
        return model.language_model.model
    found = [child for child in model.children().values() if isinstance(getattr(child, "layers", None), list)]
    if len(found) != 1:
        raise ModelError(f"{type(model).__module__}.Model has no model, language_model.model or one child "
                         f"holding its layers")
    return found[0]


def embedding_name(model: Any) -> str | None:
    """The text model's token embedding, read from its attributes: ``embed_tokens``, else its one
    ``Embedding`` (quantized or not) child (bailing_hybrid's ``word_embeddings``); None if neither."""
    inner = text_model(model)
    if "embed_tokens" in inner:
        return "embed_tokens"
    found = [name for name, child in inner.children().items()
             if isinstance(child, (nn.Embedding, nn.QuantizedEmbedding))]
    return found[0] if len(found) == 1 else None


def embedding(model: Any) -> Any:
    """The text model's token embedding module (``embedding_name``)."""
    return getattr(text_model(model), embedding_name(model) or "embed_tokens")


@lru_cache(maxsize=None)
def _final_norm_of(inner_class: type) -> str:
    match = _FINAL_NORM.search(_source(inner_class.__call__).rstrip())
    return match.group(1) if match else "norm"


def final_norm_name(model: Any) -> str:
    """The inner model's final norm: the module its forward's last line applies (``norm`` if unread)."""
    return _final_norm_of(type(text_model(model)))


def lm_head(model: Any) -> Any:
    """The model's lm_head, or None where it is tied to the embedding. mlx-lm builds (or, in sanitize,
    keeps) lm_head only for untied checkpoints; multimodal wrappers (qwen3_5, kimi_k3) hold it in their
    ``language_model``."""
    holder = getattr(model, "language_model", model)
    return getattr(holder, "lm_head", None) if "lm_head" in holder else None


def norm_and_head(model: Any, h: mx.array) -> mx.array:
    """The final norm (by its name in the inner forward), then lm_head or the tied embedding."""
    inner = text_model(model)
    h = getattr(inner, final_norm_name(model))(h)
    head = lm_head(model)
    return head(h) if head is not None else embedding(model).as_linear(h)


def _shape_break(model: Any) -> str | None:
    """Why ``model`` lacks the common module structure, or None."""
    inner = getattr(model, "model", None)
    if inner is None or not isinstance(getattr(inner, "layers", None), list) or embedding_name(model) is None:
        return "its Model has no model.layers and one token embedding in model (another module structure)"
    if not inner.layers:
        return "it has no layers"
    params = list(inspect.signature(type(inner.layers[0]).__call__).parameters)[1:]
    if len(params) < 3 or params[1:3] != ["mask", "cache"]:
        return f"its layers take ({', '.join(params)}), not (hidden, mask, cache)"
    if not hasattr(inner, final_norm_name(model)):
        return "its inner forward does not end with a final norm of the hidden state"
    return None


def _source_break(model: Any) -> str | None:
    """Why the two forward passes' source departs from the rule, or None."""
    inner = _source(type(model.model).__call__)
    outer = _source(type(model).__call__)
    if not inner or not outer:
        return "its forward pass's source cannot be read"
    for pattern, why in INNER_BREAKS:
        if re.search(pattern, inner, re.MULTILINE):
            return why
    for pattern, why in OUTER_BREAKS:
        if re.search(pattern, outer):
            return why
    odd = sorted(set(_MASK_CALL.findall(inner)) - _STANDARD_MASKS)
    if odd:
        return f"it builds its masks with {', '.join(odd)}, not create_attention_mask / create_ssm_mask"
    return None


def _cache_break(model: Any) -> str | None:
    make = getattr(model, "make_cache", None)
    if make is None:
        return None
    caches = make()
    if len(caches) != len(model.model.layers):
        return f"it makes {len(caches)} caches for {len(model.model.layers)} layers"
    try:
        for cache in caches:
            cache_kind(cache)
    except ValueError as exc:
        return str(exc)
    return None


def rule_break(model: Any) -> str | None:
    """Why ``model`` cannot be sliced by rule, or None when it can."""
    return _shape_break(model) or _source_break(model) or _cache_break(model)


def rule_parts(model: Any, name: str) -> dict[str, Any]:
    """The generic slice's ``model_slice.Family`` fields, with per-layer mask kinds read from the caches;
    ModelError naming why not."""
    why = rule_break(model)
    if why is not None:
        raise ModelError(f"model family {name!r} cannot be sliced into pipeline stages: {why}")
    array = "return_array=True" in _source(type(model.model).__call__)
    return {"head": norm_and_head, "attention": cache_attention, "array_masks": array}
