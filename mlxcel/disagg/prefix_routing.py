"""Prefix-aware choice of a prefill node over plain data (docs/disagg.md §6, "Prefix-aware selection").

No sockets, threads, clocks or locks: the router calls it under its own lock.

- ``PromptKey.of(tokens, key)``: a prompt's chained block hashes. Block ``i``'s hash is keyed BLAKE2b
  (``key``: random per router process) over block ``i-1``'s hash and the ``BLOCK_TOKENS`` token ids of
  block ``i``; a trailing partial block is not hashed. So a hash names a whole prefix, and nobody
  without the key can make two different prefixes collide.
- ``PrefixIndex``: per prefill node, the block hashes of prompts that node prefilled for this router
  (learned when it handed one off or its request finished), an LRU bounded to ``max_blocks`` entries per
  node; a node that goes down or restarts is forgotten whole, and a failed attempt's blocks are dropped
  from its node.
- ``choose(...)``: the node with the longest matched prefix among those up whose prefill load (attempts
  not handed off yet) is at most ``slack`` above the least-loaded one's; ties (and no match at all) go
  to the least loaded, then round-robin. A node only gains entries for prompts the router itself sent
  it, so no member can add entries for another, and none can draw more than ``slack`` requests above
  the least-loaded node however much it matches.
"""

from __future__ import annotations

import hashlib
import os
import sys
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Generic, Hashable, Sequence, TypeVar

Node = TypeVar("Node", bound=Hashable)

BLOCK_TOKENS = 64  # token ids per hashed block
DEFAULT_INDEX_BLOCKS = 32768  # block hashes kept per prefill node (16-byte keys: ~3 MiB per node in CPython)
DEFAULT_LOAD_SLACK = 2  # a matching node is preferred while its load is at most this above the least loaded
KEY_BYTES = 32
_DIGEST = 16


def new_key() -> bytes:
    """A random hashing key (one per router process: its hashes mean nothing to anyone else)."""
    return os.urandom(KEY_BYTES)


@dataclass(frozen=True)
class PromptKey:
    """A prompt's chained block hashes (``blocks[i]`` names its first ``(i + 1) * BLOCK_TOKENS`` tokens)."""

    blocks: tuple[bytes, ...]

    @classmethod
    def of(cls, tokens: Sequence[int], key: bytes, block: int = BLOCK_TOKENS) -> "PromptKey":
        ids = array("q", tokens)
        if sys.byteorder == "big":
            ids.byteswap()  # the ids hash as 8-byte little-endian everywhere
        data = ids.tobytes()
        step, prev, out = block * 8, b"", []
        for start in range(0, (len(tokens) // block) * step, step):
            h = hashlib.blake2b(prev, digest_size=_DIGEST, key=key)
            h.update(data[start:start + step])
            prev = h.digest()
            out.append(prev)
        return cls(tuple(out))


class PrefixIndex(Generic[Node]):
    """Per node, an LRU set of block hashes bounded to ``max_blocks`` entries."""

    def __init__(self, max_blocks: int = DEFAULT_INDEX_BLOCKS):
        if max_blocks < 1:
            raise ValueError(f"the prefix index needs at least 1 block per node, got {max_blocks}")
        self.max_blocks = max_blocks
        self._nodes: dict[Node, OrderedDict[bytes, None]] = {}

    def size(self, node: Node) -> int:
        return len(self._nodes.get(node, ()))

    def match(self, node: Node, key: PromptKey) -> int:
        """How many leading blocks of ``key`` ``node`` holds."""
        entries = self._nodes.get(node)
        if not entries:
            return 0
        n = 0
        for h in key.blocks:
            if h not in entries:
                break
            n += 1
        return n

    def learn(self, node: Node, key: PromptKey) -> None:
        """``node`` prefilled this prompt: its blocks (the first ``max_blocks``) become the node's most recent,
        its first block the newest; the least recent beyond the bound go."""
        entries = self._nodes.setdefault(node, OrderedDict())
        for h in reversed(key.blocks[:self.max_blocks]):  # the first blocks last: the deepest ones go first
            entries[h] = None
            entries.move_to_end(h)
        while len(entries) > self.max_blocks:
            entries.popitem(last=False)

    def unlearn(self, node: Node, key: PromptKey) -> None:
        """``node`` failed an attempt of this prompt: it is not counted on to hold it any more."""
        entries = self._nodes.get(node)
        if entries:
            for h in key.blocks:
                entries.pop(h, None)

    def forget(self, node: Node) -> None:
        """``node`` went down or restarted: its cache is gone."""
        self._nodes.pop(node, None)


@dataclass(frozen=True)
class Choice(Generic[Node]):
    """The prefill node picked and how many of the prompt's blocks it is expected to hold."""

    node: Node
    matched: int


def choose(nodes: Sequence[Node], index: PrefixIndex[Node], key: PromptKey, load: Callable[[Node], int],
           tie_break: Callable[[Callable[[Node], bool]], Node | None], slack: int = DEFAULT_LOAD_SLACK
           ) -> Choice[Node] | None:
    """The node (of ``nodes``, those up) most likely to hold ``key``'s longest prefix within the load bound;
    ``tie_break(eligible)`` picks among the best equals (the role's round-robin). None: ``nodes`` is empty."""
    if not nodes:
        return None
    loads = {n: load(n) for n in nodes}
    bound = min(loads.values()) + slack
    matched = {n: index.match(n, key) for n in nodes if loads[n] <= bound}
    best = max(matched.values())
    if best == 0:  # no match: the least loaded
        least = min(loads.values())
        best_nodes = {n for n in nodes if loads[n] == least}
    else:
        top = [n for n, k in matched.items() if k == best]
        least = min(loads[n] for n in top)
        best_nodes = {n for n in top if loads[n] == least}
    node = tie_break(best_nodes.__contains__)
    assert node is not None  # best_nodes is a non-empty subset of nodes up
    return Choice(node, best)
