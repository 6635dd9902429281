"""The router's side of prefix-aware routing (docs/disagg.md §6, "Prefix-aware selection").

``PrefixRoutes`` is a part of ``RouterEngine`` (a mixin over the router's lock, policy, counters and
requests); the choice itself is ``mlxcel.disagg.prefix_routing`` over plain data. It keys each attempt's
prompt (``--route-policy prefix``; none with round-robin), picks with the prefill nodes' loads (attempts
not handed off yet), counts hits, misses and the prefix tokens a hit expects to reuse, and keeps the index:
a prompt is learned on the node the router sent it to once that node handed it off (or its request
finished), dropped from it when the node failed the attempt before its handoff, and a node's entries are
forgotten whole when it goes down or restarts. Nothing a node sends names a prompt or another node, so a
member can add entries only for prompts the router gave it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from mlxcel.cluster.identity import PeerId
from mlxcel.disagg.policy import Pick, Route
from mlxcel.disagg.prefix_routing import BLOCK_TOKENS, PromptKey, new_key
from mlxcel.disagg.routed import Routed, RouteState

PREFIX_COUNTERS = ("prefix_hits", "prefix_misses", "prefix_tokens")


class PrefixRoutes:
    """Keying, picking and learning prompts' prefixes (part of ``RouterEngine``)."""

    # the router's, which these methods share
    policy: Any
    counters: dict[str, float]
    _by_rid: dict[str, Routed]
    _prefix_key: bytes

    def _init_prefix(self) -> None:
        self._prefix_key = new_key()  # per process: its hashes mean nothing to clients or other routers
        self.counters.update(dict.fromkeys(PREFIX_COUNTERS, 0))

    def _key_of(self, tokens: Sequence[int]) -> PromptKey | None:
        """The prompt's block hashes, or None under round-robin."""
        return None if self.policy.prefix is None else PromptKey.of(tokens, self._prefix_key)

    def _prefill_load(self) -> Callable[[PeerId], int]:
        """Each prefill node's load now (under the lock): its attempts not handed off yet."""
        load: dict[PeerId, int] = {}
        for r in self._by_rid.values():
            if r.state is RouteState.PREFILLING and r.prefill is not None:
                load[r.prefill] = load.get(r.prefill, 0) + 1
        return lambda peer: load.get(peer, 0)

    def _pick(self, routed: Routed, is_up: Callable[[PeerId], bool]) -> Pick[PeerId]:
        """Nodes for ``routed``'s next attempt (under the lock), counted as a prefix hit or miss."""
        if routed.key is None:
            return self.policy.pick(is_up)
        route = self.policy.pick(is_up, routed.key, self._prefill_load())
        if isinstance(route, Route):
            self.counters["prefix_hits" if route.matched else "prefix_misses"] += 1
            self.counters["prefix_tokens"] += route.matched * BLOCK_TOKENS
        return route

    def _learn_prefix(self, routed: Routed) -> None:
        """The attempt's prefill node prefilled its prompt (handed off, or the request finished)."""
        if self.policy.prefix is not None and routed.key is not None and routed.prefill is not None:
            self.policy.prefix.learn(routed.prefill, routed.key)

    def _failed_prefix(self, routed: Routed) -> None:
        """The attempt failed before its handoff: its prefill node is not counted on for the prompt."""
        if (self.policy.prefix is not None and routed.key is not None and routed.prefill is not None
                and routed.state is RouteState.PREFILLING):
            self.policy.prefix.unlearn(routed.prefill, routed.key)

    def _forget_prefix(self, peer: PeerId) -> None:
        """``peer`` went down or restarted: its prefix cache is gone."""
        if self.policy.prefix is not None:
            self.policy.prefix.forget(peer)

    def _prefix_blocks(self, peer: PeerId) -> dict[str, int]:
        """``prefix_blocks`` of a node's /router/stats entry (prefix routing only)."""
        return {} if self.policy.prefix is None else {"prefix_blocks": self.policy.prefix.size(peer)}
