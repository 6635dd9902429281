"""Reuse the KV cache of earlier prompts that share a prefix with a new one (system prompt, chat template).

Finished sequences leave their per-sequence caches here (LRU, bounded in bytes); a new prompt starts
from a copy of the longest matching prefix and only its remaining tokens are prefilled.

What can be reused depends on the layers' caches (mlx-lm's classes):

- ``KVCache`` and ``QuantizedKVCache`` (``--kv-bits``) layers (and ``CacheList`` of them) can be cut at any length: an entry serves every
  prompt that shares at least ``MIN_PREFIX`` tokens with it.
- ``ArraysCache`` (linear attention, SSM state: qwen3_next, mamba) summarises every token it has seen
  in fixed-shape arrays; it cannot be cut back to fewer tokens, and ``RotatingKVCache`` (sliding
  windows) has dropped the positions before its window. An entry with such a layer is reused only
  **whole**: by a prompt that starts with every token the entry holds (a chat's next turn, which
  repeats the whole earlier conversation), never by one that diverges inside it, and never cut to
  a pipeline's shorter agreed prefix (``limit``).
- Anything else (chunked caches) is not stored.

Entries are kept per ``scope`` (a pipeline stage: the identity that released them), and a lookup
sees only its own scope's, so nobody starts from KV that another identity stored. A stored entry is
never handed out itself: a lookup gets fresh cache objects (``from_state`` over slices or the same
immutable arrays), so the sequence that continues from it cannot change it.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Hashable, Sequence

from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache, RotatingKVCache

MIN_PREFIX = 4  # shorter matches are not worth a copy
CUT, WHOLE = "cut", "whole"  # how an entry can be reused: at any length, or only at its own


def _layer_reuse(c: Any) -> str | None:
    """CUT, WHOLE, or None (not reusable) for one layer's cache."""
    if type(c) in (KVCache, QuantizedKVCache):
        return CUT if c.keys is not None else None
    if type(c) is ArraysCache:
        arrays, left_padding, lengths = c.state
        ok = arrays and all(a is not None for a in arrays) and left_padding is None and lengths is None
        return WHOLE if ok else None
    if type(c) is RotatingKVCache:
        return WHOLE if c.keys is not None else None
    if type(c) is CacheList:
        kinds = {_layer_reuse(p) for p in c.caches}
        return None if None in kinds or not kinds else (WHOLE if WHOLE in kinds else CUT)
    return None


def reuse_kind(cache: list) -> str | None:
    """How ``cache`` (one sequence's layers) can be reused: CUT, WHOLE (a layer cannot be cut), or None."""
    kinds = {_layer_reuse(c) for c in cache}
    if not cache or None in kinds:
        return None
    return WHOLE if WHOLE in kinds else CUT


def reusable(cache: list) -> bool:
    return reuse_kind(cache) is not None


def _tokens_seen(cache: list) -> int | None:
    """Tokens the cache has seen, from the first layer that counts them (None: only recurrent layers)."""
    for c in cache:
        offset = getattr(c, "offset", None)
        if offset is None and type(c) is CacheList:
            offset = _tokens_seen(list(c.caches))
        if offset is not None:
            return offset
    return None


def _copy(c: Any, n: int) -> Any:
    """A fresh cache of one layer holding its first ``n`` tokens (``n`` = all of them for WHOLE layers)."""
    if type(c) is KVCache:
        keys, values, _ = c.state
        return KVCache.from_state((keys[..., :n, :], values[..., :n, :], n))
    if type(c) is QuantizedKVCache:
        keys, values, _, group_size, bits = c.state
        return QuantizedKVCache.from_state((tuple(k[..., :n, :] for k in keys), tuple(v[..., :n, :] for v in values),
                                            n, group_size, bits))
    if type(c) is RotatingKVCache:
        keys, values, offset, keep, max_size, write = c.state
        return RotatingKVCache.from_state((keys[...], values[...], offset, keep, max_size, write))
    if type(c) is ArraysCache:
        arrays, _, _ = c.state
        return ArraysCache.from_state(([a[...] for a in arrays], None, None))
    parts = [_copy(p, n) for p in c.caches]
    return CacheList.from_state([(p.state, type(p).__name__) for p in parts])


def _cut(cache: list, n: int) -> list:
    """New caches holding the first n positions (slices: the stored entry stays intact)."""
    return [_copy(c, n) for c in cache]


def _nbytes(cache: list) -> int:
    return sum(c.nbytes for c in cache)


class PrefixCache:
    """LRU map from (scope, token prefix) to KV caches, one byte bound across every scope."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[Hashable, tuple[int, ...]], tuple[str, list]] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def store(self, tokens: Sequence[int], cache: list, scope: Hashable = None) -> None:
        """Keep ``cache`` under ``tokens`` (the tokens it holds, in order). An entry that can be reused only
        whole needs every token it has seen: one whose cache saw more than ``tokens`` is not kept."""
        kind = reuse_kind(cache) if self.max_bytes > 0 else None
        if kind is None:
            return
        seen = _tokens_seen(cache)
        n = min(len(tokens), seen if seen is not None else len(tokens))
        if n < MIN_PREFIX or (kind == WHOLE and n != (seen if seen is not None else len(tokens))):
            return
        key = (scope, tuple(tokens[:n]))
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        entry = _cut(cache, n)
        size = _nbytes(entry)
        if size > self.max_bytes:
            return
        self._entries[key] = (kind, entry)
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, (_, old) = self._entries.popitem(last=False)
            self._bytes -= _nbytes(old)

    def lookup(self, prompt: Sequence[int], limit: int | None = None, scope: Hashable = None) -> tuple[list | None, int]:
        """(cache of the longest stored prefix, its length); at least one prompt token is left to prefill.

        ``limit`` caps the length (a pipeline stage trims to the prefix every stage holds); only entries
        stored under ``scope`` are candidates. An entry that can be reused only whole counts only when the
        prompt starts with all of it and that fits under both bounds.
        """
        best_key, best = None, 0
        prompt = list(prompt)
        most = len(prompt) - 1 if limit is None else min(len(prompt) - 1, limit)
        for key, (kind, _) in self._entries.items():
            if key[0] != scope:
                continue
            n = min(len(os.path.commonprefix([prompt, list(key[1])])), most)
            if kind == WHOLE and n != len(key[1]):
                continue
            if n > best:
                best_key, best = key, n
        if best_key is None or best < MIN_PREFIX:
            return None, 0
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.reused_tokens += best
        return _cut(self._entries[best_key][1], best), best
