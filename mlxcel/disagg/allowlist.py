"""``MLXCEL_DECODE_ALLOWLIST``: the decode nodes a prefill node may hand a KV cache to (docs/disagg.md §7).

A comma-separated list of numeric ``IP:port`` entries: the full set of decode nodes any router may
choose. An entry that does not parse (a hostname, a missing port) is skipped with a warning; unset,
or no valid entry, leaves the prefill node permissive, with a warning at start-up. A ``decode_target``
outside a configured allowlist is refused before any connection is made, so the KV cache never leaves.
The prefill's own ``--decode-peers`` fallback (used when a request names no target) needs no check:
it is operator configuration, not a wire-supplied address.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

from mlxcel import envs
from mlxcel.cluster.identity import PeerId
from mlxcel.disagg.wire import ALLOWLIST_ENV

log = logging.getLogger("mlxcel.disagg.prefill")


@dataclass(frozen=True)
class Allowlist:
    """The decode targets a prefill node accepts; ``entries`` None means permissive."""

    entries: frozenset[PeerId] | None
    skipped: tuple[str, ...] = ()

    def allows(self, target: PeerId) -> bool:
        return self.entries is None or target in self.entries

    @classmethod
    def parse(cls, text: str | None) -> "Allowlist":
        """Entries of the variable's text; unparsable ones are kept in ``skipped``."""
        if text is None:
            return cls(None)
        good: set[PeerId] = set()
        skipped = []
        for raw in text.split(","):
            item = raw.strip()
            if not item:
                continue
            try:
                good.add(PeerId.parse(item))
            except ValueError:
                skipped.append(item)
        return cls(frozenset(good) if good else None, tuple(skipped))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Allowlist":
        """Read ``MLXCEL_DECODE_ALLOWLIST`` and log what it means (warnings for skipped entries and permissive)."""
        text = (envs.settings() if env is None else envs.read(env)).decode_allowlist
        allow = cls.parse(text)
        for item in allow.skipped:
            log.warning("%s: skipping %r: entries must be numeric IP:port addresses (a hostname never matches a "
                        "router-chosen target)", ALLOWLIST_ENV, item)
        if allow.entries is None:
            why = "is not set" if text is None else "has no valid entry"
            log.warning("%s %s: this prefill node hands KV caches to any decode_target a request names; set it to "
                        "every router-selectable decode node", ALLOWLIST_ENV, why)
        else:
            log.info("%s: KV handoffs go only to %s", ALLOWLIST_ENV, ", ".join(sorted(map(str, allow.entries))))
        return allow
