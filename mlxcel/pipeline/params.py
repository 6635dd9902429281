"""Sampling parameters on the wire (the ``params`` object of PREPARE, docs/pipeline.md §3)."""

from __future__ import annotations

from typing import Any

from mlxcel.config import MAX_TOP_LOGPROBS
from mlxcel.engine.sampling import SamplingParams
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
