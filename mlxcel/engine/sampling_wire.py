"""The one ``SamplingParams`` codec: a protocol's ``params`` object to and from ``SamplingParams``.

Each protocol that carries sampling parameters (the stage protocol's PREPARE, docs/pipeline.md §3.5;
the disaggregated GENERATE and KV handoff, docs/disagg.md §3) describes its ``params`` object once, as
a ``ParamsFormat``: which fields travel, their defaults and bounds and the wording of a refusal. The
checks are ``mlxcel.strict_json``'s: a mistyped or out-of-bounds field, or an unknown one, raises its
``FieldError``; a value ``SamplingParams`` itself refuses raises ``SamplingError``. ``logit_bias`` travels as
OpenAI's object (``{"token id": bias}``, at most ``MAX_LOGIT_BIAS`` entries, checked before anything else is
read from it), a token window (``context``) as a list of at most ``PENALTY_CONTEXT`` ids, a ``grammar`` as its
text (null: none; at most ``MAX_GRAMMAR_BYTES``, compiled by the receiver) and what it replays (``replay``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable

from mlxcel import strict_json as strict
from mlxcel.config import MAX_TOKENS_LIMIT
from mlxcel.engine.grammar import GrammarError, check_text
from mlxcel.engine.logits import PENALTY_CONTEXT
from mlxcel.engine.sampling import LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS, SamplingParams

_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))


@dataclass(frozen=True)
class Param:
    """One field of a ``params`` object: its JSON kind (``strict_json.field``'s), default and bounds."""

    kind: type
    default: Any = strict.ABSENT  # absent: the field is required
    optional: bool = False  # null stands for a missing field
    bounds: dict[str, Any] = field(default_factory=dict)  # lo, hi, max_chars, text
    read: Callable[[Any, str], Any] | None = None  # a check of its own instead of ``strict.field``'s for ``kind``
    write: Callable[[Any], Any] | None = None  # the JSON form of the value (default: a tuple as a list)


def logit_bias_doc(pairs: tuple[tuple[int, float], ...]) -> dict[str, float]:
    """``logit_bias`` as OpenAI's object: token id (decimal string) -> bias."""
    return {str(token): float(bias) for token, bias in pairs}


def logit_bias_from_doc(raw: Any, name: str = "logit_bias") -> tuple[tuple[int, float], ...]:
    """(id, bias) pairs, ids ascending, of a checked ``logit_bias`` object; raises ``FieldError``. The entry
    count is checked first, so an oversize object costs nothing more to refuse."""
    if not isinstance(raw, dict):
        raise strict.FieldError(name, f"{name} must be an object mapping token ids to biases")
    if len(raw) > MAX_LOGIT_BIAS:
        raise strict.FieldError(name, f"{name} holds {len(raw)} entries; at most {MAX_LOGIT_BIAS}")
    pairs = []
    for key, bias in raw.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise strict.FieldError(name, f"{name} keys must be token ids (decimal integers), got {key!r}")
        if not strict.is_number(bias) or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise strict.FieldError(name, f"{name} values must be numbers between -100 and 100, got {bias!r}")
        pairs.append((int(key), float(bias)))
    pairs.sort()
    if any(a[0] == b[0] for a, b in zip(pairs, pairs[1:])):
        raise strict.FieldError(name, f"{name} names a token id twice")
    return tuple(pairs)


def context_from_doc(raw: Any, name: str = "context") -> tuple[int, ...]:
    """A token window: a list of at most ``PENALTY_CONTEXT`` integers >= 0 (the receiver checks its vocabulary)."""
    if not isinstance(raw, list) or len(raw) > PENALTY_CONTEXT or not all(strict.is_int(t) and t >= 0 for t in raw):
        raise strict.FieldError(name, f"{name} must be a list of at most {PENALTY_CONTEXT} token ids")
    return tuple(raw)


def grammar_from_doc(raw: Any, name: str = "grammar") -> str | None:
    """A grammar's text (null: none): a string of at most ``MAX_GRAMMAR_BYTES``; the receiver compiles it."""
    if raw is None:
        return None
    try:
        return check_text(raw, name)
    except GrammarError as exc:
        raise strict.FieldError(name, str(exc)) from None


def replay_from_doc(raw: Any, name: str = "replay") -> tuple[int, ...]:
    """The tokens a grammar replays: a list of at most ``MAX_TOKENS_LIMIT`` ids (the receiver checks its vocabulary)."""
    if not isinstance(raw, list) or len(raw) > MAX_TOKENS_LIMIT or not all(strict.is_int(t) and t >= 0 for t in raw):
        raise strict.FieldError(name, f"{name} must be a list of at most {MAX_TOKENS_LIMIT} token ids")
    return tuple(raw)


#: the fields of the logits processors and min-p, shared by every ``params`` format that carries them
PROCESSOR_PARAMS = {
    "min_p": Param(float, 0.0),
    "repetition_penalty": Param(float, 1.0),
    "presence_penalty": Param(float, 0.0),
    "frequency_penalty": Param(float, 0.0),
    "logit_bias": Param(dict, {}, read=logit_bias_from_doc, write=logit_bias_doc),
    "grammar": Param(str, None, optional=True, read=grammar_from_doc),
}


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
        write = fmt.fields[name].write
        doc[name] = write(value) if write else list(value) if isinstance(value, tuple) else value
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
    if param.read is not None:
        value = raw.get(name, param.default)
        if value is strict.ABSENT:
            raise strict.FieldError(name, f"{name} is required")
        return param.read(value, name)
    return strict.field(raw, name, param.kind, default=param.default, optional=param.optional, **param.bounds)
