"""Sequence fields on the wire (docs/pipeline.md §3.5): PREPARE's ``params`` object, and the prefix
cache's token lists (PREPARE ``prompt``, RELEASE ``tokens``) and counts (``max_cached``, ACK ``cached``)."""

from __future__ import annotations

from typing import Any

from mlxcel.config import MAX_PREFIX_TOKENS, MAX_TOP_LOGPROBS
from mlxcel.engine.sampling import SamplingParams
from mlxcel.models.token_ids import check_token_ids
from mlxcel.pipeline.protocol import is_int, is_number

_FIELDS = ("temperature", "top_p", "top_k", "seed", "logprobs")


def params_to_wire(params: SamplingParams, top_logprobs: int) -> dict[str, Any]:
    """What the last stage needs to sample: stop strings and max_tokens stay with the coordinator."""
    out: dict[str, Any] = {k: getattr(params, k) for k in _FIELDS}
    out["top_logprobs"] = top_logprobs
    return out


def params_from_wire(raw: Any) -> tuple[SamplingParams, int]:
    """Validate and rebuild; raises SamplingError / TypeError / ValueError on bad values."""
    if not isinstance(raw, dict):
        raise TypeError("params must be an object")
    unknown = set(raw) - set(_FIELDS) - {"top_logprobs"}
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}")
    temperature = _number(raw, "temperature", 0.0)
    top_p = _number(raw, "top_p", 1.0)
    top_k = raw.get("top_k", 0)
    seed = raw.get("seed")
    logprobs = raw.get("logprobs", False)
    top = raw.get("top_logprobs", 0)
    if not is_int(top_k):
        raise TypeError("top_k must be an integer")
    if seed is not None and not is_int(seed):
        raise TypeError("seed must be an integer or null")
    if not isinstance(logprobs, bool):
        raise TypeError("logprobs must be a boolean")
    if not is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}")
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, logprobs=logprobs)
    return params, top


def _number(raw: dict[str, Any], name: str, default: float) -> float:
    value = raw.get(name, default)
    if not is_number(value):  # true is not 1.0
        raise TypeError(f"{name} must be a number")
    return float(value)


def tokens_from_wire(raw: Any, name: str, vocab_size: int) -> list[int] | None:
    """A token list (PREPARE ``prompt``, RELEASE ``tokens``): absent/null, or at most ``MAX_PREFIX_TOKENS``
    integers in [0, vocab_size); raises TypeError / ValueError (``true`` is not token 1)."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise TypeError(f"{name} must be an array of token ids")
    if len(raw) > MAX_PREFIX_TOKENS:
        raise ValueError(f"{name} holds {len(raw)} token ids; at most {MAX_PREFIX_TOKENS}")
    check_token_ids(raw, vocab_size, name)  # a TokenIdError is a ValueError
    return raw


def count_from_wire(raw: Any, name: str, most: int) -> int:
    """A token count (PREPARE ``max_cached``, ACK ``cached``): an integer from 0 to ``most``."""
    if not is_int(raw) or not 0 <= raw <= most:
        raise ValueError(f"{name} must be an integer from 0 to {most}, got {raw!r}")
    return raw
