"""Freeing a finished sequence on the executor: at once, or after the step in flight that still names it.

A sequence that ends while a synchronous executor runs a step naming it (its prompt chunk, its decode
group's step) is freed only when that step returns, so no stage sees it vanish mid-step; an asynchronous
executor has built its queued steps already, so the scheduler frees it at once and the queued step's
token for it is dropped. A cancelled request goes through the executor's ``cancel`` (the pipeline sends
CANCEL), any other through ``release`` with the tokens it offers the prefix cache (or None).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from mlxcel.engine.executor import ExecutorBase, Step

log = logging.getLogger("mlxcel.engine")


class Deferred(NamedTuple):
    """A release waiting for a step: a prompt chunk of ``rid`` (``slot`` None) or decode group ``slot``'s."""

    rid: str
    tokens: list[int] | None
    slot: int | None
    cancelled: bool


class Releases:
    """Frees sequences on the executor; a failing stage is logged, never raised into the scheduler."""

    def __init__(self, executor: ExecutorBase):
        self.executor = executor
        self.deferred: list[Deferred] = []

    def now(self, rid: str, tokens: list[int] | None, cancelled: bool = False) -> None:
        """Free ``rid`` on the executor: ``cancel`` for a request its client gave up, else ``release``."""
        try:
            if cancelled:
                self.executor.cancel(rid)
            else:
                self.executor.release(rid, tokens)
        except Exception as exc:  # a failing stage must not take the scheduler down
            log.warning("releasing %s failed: %s", rid, exc)

    def after(self, rid: str, tokens: list[int] | None, slot: int | None, cancelled: bool) -> None:
        """Free ``rid`` once the step in flight that names it returns (``flush``)."""
        self.deferred.append(Deferred(rid, tokens, slot, cancelled))

    def flush(self, step: Step) -> None:
        """``step`` returned: free what waited for it."""
        if not self.deferred:
            return
        ready = [d for d in self.deferred
                 if (d.slot is None and step.kind == "prefill" and d.rid == step.rids[0])
                 or (d.slot is not None and step.kind == "decode" and d.slot == step.slot)]
        for item in ready:
            self.deferred.remove(item)
            self.now(item.rid, item.tokens, item.cancelled)
