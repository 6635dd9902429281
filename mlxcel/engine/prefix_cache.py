"""Reuse the KV cache of earlier prompts that share a prefix with a new one (system prompt, chat template).

Finished sequences leave their per-sequence KV caches here (LRU, bounded in
bytes); a new prompt starts from a copy of the longest matching prefix and
only its remaining tokens are prefilled. Only plain ``KVCache`` layers are
reused (rotating and recurrent caches cannot be cut at an arbitrary length).
Entries are kept per ``scope`` (a pipeline stage: the identity that released them), and a lookup
sees only its own scope's, so nobody starts from KV that another identity stored.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Hashable, Sequence

from mlx_lm.models.cache import KVCache

MIN_PREFIX = 4  # shorter matches are not worth a copy


def reusable(cache: list) -> bool:
    return bool(cache) and all(type(c) is KVCache and c.keys is not None for c in cache)


def _cut(cache: list, n: int) -> list:
    """New KVCache layers holding the first n positions (slices: the stored entry stays intact)."""
    out = []
    for c in cache:
        new = KVCache()
        new.keys, new.values, new.offset = c.keys[..., :n, :], c.values[..., :n, :], n
        out.append(new)
    return out


class PrefixCache:
    """LRU map from (scope, token prefix) to KV caches, one byte bound across every scope."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[Hashable, tuple[int, ...]], list] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def store(self, tokens: Sequence[int], cache: list, scope: Hashable = None) -> None:
        if self.max_bytes <= 0 or not reusable(cache):
            return
        n = min(len(tokens), cache[0].offset)
        if n < MIN_PREFIX:
            return
        key = (scope, tuple(tokens[:n]))
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        entry = _cut(cache, n)
        size = sum(c.keys.nbytes + c.values.nbytes for c in entry)
        if size > self.max_bytes:
            return
        self._entries[key] = entry
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= sum(c.keys.nbytes + c.values.nbytes for c in old)

    def lookup(self, prompt: Sequence[int], limit: int | None = None, scope: Hashable = None) -> tuple[list | None, int]:
        """(cache of the longest stored prefix, its length); at least one prompt token is left to prefill.

        ``limit`` caps the length (a pipeline stage trims to the prefix every stage holds); only entries
        stored under ``scope`` are candidates.
        """
        best_key, best = None, 0
        prompt = list(prompt)
        for key in self._entries:
            if key[0] != scope:
                continue
            n = len(os.path.commonprefix([prompt, list(key[1])]))
            if n > best:
                best_key, best = key, n
        best = min(best, len(prompt) - 1, best if limit is None else limit)
        if best_key is None or best < MIN_PREFIX:
            return None, 0
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.reused_tokens += best
        return _cut(self._entries[best_key], best), best
