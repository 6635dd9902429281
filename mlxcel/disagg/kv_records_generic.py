"""Record kind STATE (8): a cache class carried by mlx-lm's cache state contract (docs/disagg.md §4.1).

A class qualifies when it is on ``ALLOWED`` (mlx-lm cache classes, named here, never taken from the
wire: a record carries the class's code, which must equal the one this model's own layout gives) and
keeps the contract: its ``state`` is a tuple of arrays, and ``from_state`` (or a ``state`` setter on an
instance made without ``__init__``) rebuilds it. Each array either keeps its shape whatever the prompt
(a fixed-size state) or holds one position per token along the class's ``grows`` axis, so the decode
node computes every shape from the prompt's length and compares the sender's records with its own.

A class with neither ``from_state`` nor a ``state`` setter cannot be rebuilt and is refused by name
(``contract_refusal``); deepseek_v41's ``LayerCache`` is one, carried by its own record kind instead
(``kv_records_dsv41``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxcel.disagg.kv_codec import HandoffError, LayerSpec, TensorSpec, dtype_code
from mlxcel.disagg.wire import MAX_KV_ARRAYS, CacheKind


@dataclass(frozen=True)
class StateClass:
    """One allow-listed class: its wire code, its name in ``mlx_lm.models.cache``, its positions axis."""

    code: int
    name: str
    grows: int  # the axis of every state array that holds one position per token (-1: fixed shapes)


#: the mlx-lm cache classes record kind STATE carries (codes are wire values: never reuse one)
ALLOWED: tuple[StateClass, ...] = (StateClass(1, "ConcatenateKVCache", 2),)
_BY_CODE = {c.code: c for c in ALLOWED}


def _cache_class(entry: StateClass) -> type:
    from mlx_lm.models import cache

    return getattr(cache, entry.name)


def allowed(cls: type) -> StateClass | None:
    """The allow-list entry of ``cls`` (the class object itself, not one of the same name), else None."""
    for entry in ALLOWED:
        if cls is _cache_class(entry):
            return entry
    return None


def _has_setter(cls: type) -> bool:
    prop = getattr(cls, "state", None)
    return isinstance(prop, property) and prop.fset is not None


def contract_refusal(cls: type) -> str:
    """Why a class that no record kind names cannot travel (``unsupported_cache``'s words)."""
    if not hasattr(cls, "from_state") and not _has_setter(cls):
        return (f"keeps a {cls.__name__}, whose class has neither from_state nor a state setter (mlx-lm's cache "
                "state contract), so a decode node cannot rebuild it")
    return f"keeps a {cls.__name__}, which is not on the allow-list of cache classes a handoff carries"


def spec_of(entry: StateClass, state: Any) -> LayerSpec:
    """The STATE layer spec of a cache of ``entry``'s class after one token (ValueError: cannot travel)."""
    arrays = _arrays(entry.name, state)
    if entry.grows >= 0 and any(a.ndim <= entry.grows or a.shape[entry.grows] != 1 for a in arrays):
        raise ValueError(f"a {entry.name}'s arrays do not hold one position along axis {entry.grows} after a token")
    specs = tuple(TensorSpec(dtype_code(str(a.dtype).rpartition(".")[2]), tuple(a.shape)) for a in arrays)
    return LayerSpec(CacheKind.STATE, arrays=specs, state_class=entry.code, grows=entry.grows)


def _arrays(name: str, state: Any) -> list:
    import mlx.core as mx

    if not isinstance(state, (tuple, list)) or not 1 <= len(state) <= MAX_KV_ARRAYS:
        raise ValueError(f"a {name}'s state is not 1..{MAX_KV_ARRAYS} arrays")
    for i, a in enumerate(state):
        if not isinstance(a, mx.array) or a.ndim == 0 or a.shape[0] != 1:
            what = type(a).__name__ if not isinstance(a, mx.array) else f"shape {list(a.shape)}"
            raise ValueError(f"a {name}'s state entry {i} is {what}, not one sequence's array [1, ...]")
    return list(state)


def export_arrays(name: str, state: Any, spec: LayerSpec, length: int) -> list:
    """One STATE layer's tensors in wire order (the layout's shapes are checked by the caller)."""
    try:
        arrays = _arrays(name, state)
    except ValueError as exc:
        raise HandoffError(str(exc)) from None
    if spec.grows >= 0:
        held = {a.shape[spec.grows] for a in arrays}
        if held != {length}:
            raise HandoffError(f"a {name} holds {sorted(held)} positions, the prompt has {length}")
    return arrays


def rebuild(spec: LayerSpec, arrays: list) -> Any:
    """The cache of a decoded STATE layer: ``from_state`` of the allow-listed class, else its state setter."""
    cls = _cache_class(_BY_CODE[spec.state_class])
    if hasattr(cls, "from_state"):
        return cls.from_state(tuple(arrays))
    obj = cls.__new__(cls)
    obj.state = tuple(arrays)
    return obj
