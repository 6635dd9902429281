"""The one ``SamplingParams`` codec: a protocol's ``params`` object to and from ``SamplingParams``.

Each protocol that carries sampling parameters (the stage protocol's PREPARE, docs/pipeline.md §3.5;
the disaggregated GENERATE and KV handoff, docs/disagg.md §3) describes its ``params`` object once, as
a ``ParamsFormat``: which fields travel, their defaults and bounds and the wording of a refusal. The
checks are ``mlxcel.strict_json``'s: a mistyped or out-of-bounds field, or an unknown one, raises its
``FieldError``; a value ``SamplingParams`` itself refuses raises ``SamplingError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from mlxcel import strict_json as strict
from mlxcel.engine.sampling import SamplingParams

_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))


@dataclass(frozen=True)
class Param:
    """One field of a ``params`` object: its JSON kind (``strict_json.field``'s), default and bounds."""

    kind: type
    default: Any = strict.ABSENT  # absent: the field is required
    optional: bool = False  # null stands for a missing field
    bounds: dict[str, Any] = field(default_factory=dict)  # lo, hi, max_chars, text


@dataclass(frozen=True)
class ParamsFormat:
    """A protocol's ``params`` object: its fields in wire order; ``order``, the order they are checked in
    (the wire order when empty); ``unknown``, the refusal of unknown keys (a template over ``names``)."""

    fields: dict[str, Param]
    unknown: str = "unknown field(s) {names}"
    order: tuple[str, ...] = ()


def params_doc(params: SamplingParams, fmt: ParamsFormat, **extra: Any) -> dict[str, Any]:
    """``params`` as ``fmt``'s object; ``extra`` gives the fields that are not SamplingParams' (``top_logprobs``)."""
    doc = {}
    for name in fmt.fields:
        value = extra[name] if name in extra else getattr(params, name)
        doc[name] = list(value) if isinstance(value, tuple) else value
    return doc


def params_from_doc(raw: Any, fmt: ParamsFormat) -> tuple[SamplingParams, dict[str, Any]]:
    """(SamplingParams, the other fields by name) of a checked ``params`` object; raises ``FieldError``
    or ``SamplingError``."""
    if not isinstance(raw, dict):
        raise strict.FieldError("params", "params must be an object")
    unknown = strict.unknown_keys(raw, fmt.fields)
    if unknown:
        raise strict.FieldError("params", fmt.unknown.format(names=", ".join(unknown)))
    values = {name: _read(raw, name, fmt.fields[name]) for name in fmt.order or fmt.fields}
    params = SamplingParams(**{k: v for k, v in values.items() if k in _SAMPLING_FIELDS})
    return params, {k: v for k, v in values.items() if k not in _SAMPLING_FIELDS}


def _read(raw: dict[str, Any], name: str, param: Param) -> Any:
    return strict.field(raw, name, param.kind, default=param.default, optional=param.optional, **param.bounds)
