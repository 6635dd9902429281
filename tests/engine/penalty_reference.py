"""mlx-lm's own generation with its logits processors: the reference every topology's penalized output equals."""

from __future__ import annotations

from typing import Any

from mlxcel.engine.logits import PENALTY_CONTEXT

# request fields (the HTTP names) that change a tiny random model's greedy output
PENALIZED: dict[str, Any] = {"presence_penalty": 1.5, "frequency_penalty": 0.8, "repetition_penalty": 1.3,
                             "logit_bias": {"60": 3.0, "61": -2.0}}


def mlx_lm_reference(model_dir, prompt: list[int], n: int, fields: dict[str, Any] = PENALIZED) -> str:
    """Greedy text (no EOS stop) of mlx-lm's ``generate_step`` with ``make_logits_processors`` of ``fields``."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    from mlxcel.models.loading import load_checkpoint

    loaded = load_checkpoint(model_dir)
    bias = {int(k): float(v) for k, v in fields.get("logit_bias", {}).items()} or None
    processors = make_logits_processors(
        bias, fields.get("repetition_penalty"), PENALTY_CONTEXT, fields.get("presence_penalty"), PENALTY_CONTEXT,
        fields.get("frequency_penalty"), PENALTY_CONTEXT)
    detok = loaded.tokenizer.detokenizer
    for token, _ in generate_step(mx.array(prompt), loaded.model, max_tokens=n, logits_processors=processors):
        detok.add_token(int(token))
    detok.finalize()
    return detok.text
