"""CPU stand-ins for the Metal kernels mlx-lm's muse_spark calls (mlx_lm.kernels: Metal only, so the model
cannot run on the CPU build the suite uses), for in-process tests that compare pipeline slices with the
whole model: both run the same stand-ins, each computing what its kernel's docstring says in plain MLX ops.
They are not bit-exact with the kernels; what they keep is the property a stage boundary relies on:
``pre_norm`` of a stream equals the normed sum ``norm_add_norm`` gave with it."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn

from mlxcel.commands.support import TINY_CONFIGS


def _rms(x: mx.array, eps: float) -> mx.array:
    x = x.astype(mx.float32)
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)


def _qk(qkvg: mx.array, n_heads: int, n_kv_heads: int, head_dim: int, eps: float,
        query_scale: float) -> tuple[mx.array, mx.array]:
    shape = qkvg.shape[:-1]
    q = qkvg[..., :n_heads * head_dim].reshape(*shape, n_heads, head_dim)
    k = qkvg[..., n_heads * head_dim:(n_heads + n_kv_heads) * head_dim].reshape(*shape, n_kv_heads, head_dim)
    return (_rms(q, eps) * query_scale).astype(qkvg.dtype), _rms(k, eps).astype(qkvg.dtype)


def qk_norm(qkvg: mx.array, *, n_heads: int, n_kv_heads: int, head_dim: int, eps: float,
            query_scale: float) -> list[mx.array]:
    return list(_qk(qkvg, n_heads, n_kv_heads, head_dim, eps, query_scale))


def qk_norm_rope(qkvg: mx.array, *, n_heads: int, n_kv_heads: int, head_dim: int, eps: float, query_scale: float,
                 rope_base: float, offset: int) -> list[mx.array]:
    q, k = _qk(qkvg, n_heads, n_kv_heads, head_dim, eps, query_scale)  # [B, L, H, D]: rope runs over L
    rope = [mx.fast.rope(x.swapaxes(1, 2), head_dim, traditional=False, base=rope_base, scale=1.0, offset=offset)
            for x in (q, k)]
    return [x.swapaxes(1, 2) for x in rope]


def rms_norm_sigmoid_gate(x: mx.array, gate: mx.array, *, eps: float) -> mx.array:
    B, H, L, D = x.shape
    out = _rms(x.transpose(0, 2, 1, 3), eps) * mx.sigmoid(gate.astype(mx.float32).reshape(B, L, H, D))
    return out.reshape(B, L, H * D).astype(x.dtype)


def norm_add_norm(branch: mx.array, stream: mx.array, *, alpha: mx.array, beta: mx.array,
                  post_weight: mx.array | None, post_eps: float,
                  next_norm: nn.RMSNorm | None) -> tuple[mx.array, mx.array | None]:
    scaled = branch if post_weight is None else (post_weight.astype(branch.dtype) * branch)
    new = alpha * stream.astype(mx.float32) + beta * _rms(scaled, post_eps).astype(branch.dtype).astype(mx.float32)
    return new, (None if next_norm is None else pre_norm(new, next_norm, dtype=branch.dtype))


def pre_norm(stream: mx.array, norm: nn.RMSNorm, *, dtype: mx.Dtype) -> mx.array:
    return (_rms(stream, norm.eps) * norm.weight.astype(mx.float32)).astype(dtype)


def expert_routing(logits: mx.array, expert_bias: mx.array, *, top_k: int, multiplier: float, score_eps: float,
                   route_scale: float) -> list[mx.array]:
    scores = mx.sigmoid(logits * multiplier)
    inds = mx.argsort(-(scores + expert_bias), axis=-1)[..., :top_k]
    picked = mx.take_along_axis(scores, inds, axis=-1)
    return [inds.astype(mx.uint32), picked / (picked.sum(axis=-1, keepdims=True) + score_eps) * route_scale]


def post_expert_norm_combine(experts: mx.array, weights: mx.array, *, norm_weight: mx.array,
                             eps: float) -> mx.array:
    normed = _rms(experts * norm_weight, eps)
    return (normed * weights[..., None]).sum(axis=-2).astype(experts.dtype)


STAND_INS = ("qk_norm", "qk_norm_rope", "rms_norm_sigmoid_gate", "norm_add_norm", "pre_norm", "expert_routing",
             "post_expert_norm_combine")


@contextmanager
def cpu_kernels() -> Iterator[None]:
    """mlx_lm.models.muse_spark with the stand-ins in place of its Metal kernels, restored after."""
    import mlx_lm.models.muse_spark as muse

    saved = {name: getattr(muse, name) for name in STAND_INS}
    for name in STAND_INS:
        setattr(muse, name, globals()[name])
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(muse, name, fn)


def build_muse_spark(layers: int = 4):
    """muse_spark's Model from its tiny config (``support.TINY_CONFIGS``), random weights, float32."""
    from mlx_lm.utils import _get_classes

    config = dict(TINY_CONFIGS["muse_spark"], model_type="muse_spark")
    text = dict(config["text_config"], num_hidden_layers=layers)
    text.update(layer_rope_theta=[text["layer_rope_theta"][i % 2] for i in range(layers)],
                layer_types=[text["layer_types"][i % 2] for i in range(layers)])
    config["text_config"] = text
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    model.set_dtype(mx.float32)
    return model
