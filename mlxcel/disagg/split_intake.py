"""The decode node's side of a split handoff (docs/disagg.md §4.9): part streams joined to their header stream.

A part stream opens with a PART record naming the id of its header stream; it joins the handoff keyed by
(its own sender, that id), so it can only ever join a handoff whose header stream came from the same
authenticated identity. A part stream that arrives before its header stream's SPLIT was read waits: its
parts are kept, at most ``MAX_KV_EARLY_BYTES`` per handoff (beyond that, or once twice --handoff-timeout
passed, they are dropped and the handoff, if its header comes, is refused). Once joined, each part
stream's parts go to the handoff's one ``HandoffDecoder`` from that stream's own thread.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.messages import Message, decode_error
from mlxcel.disagg.kv_codec import HandoffDecoder, HandoffError
from mlxcel.disagg.kv_split import parse_part
from mlxcel.disagg.wire import MAX_KV_EARLY_BYTES, MAX_KV_SPLIT, Part
from mlxcel.error_codes import ErrorCode

log = logging.getLogger("mlxcel.disagg.decode")

Key = tuple[PeerId, int]


@dataclass(eq=False)
class PartStream:
    """One part stream: its handoff (the header stream's key), its index, what it holds before joining."""

    handoff: Key
    index: int
    count: int
    decoder: HandoffDecoder | None = None  # set when it joined
    early: list[Any] = field(default_factory=list)  # parts before it joined
    early_bytes: int = 0
    closed: bool = False  # its STREAM_END (status 0) came before it joined
    refused: bool = False
    waiting: "Waiting | None" = None  # the handoff's part streams waiting with it, until it joined
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(eq=False)
class Waiting:
    """Part streams of a handoff whose header stream's SPLIT has not been read yet."""

    streams: list[PartStream] = field(default_factory=list)
    since: float = field(default_factory=time.monotonic)
    bytes: int = 0
    refused: str = ""  # why its parts were dropped (the handoff is refused when its header comes)

    def drop(self, why: str) -> None:
        """Drop every kept part (under the service's lock)."""
        self.refused, self.bytes = why, 0
        for ps in self.streams:
            ps.early, ps.early_bytes, ps.refused = [], 0, True


class SplitIntake:
    """Mixed into ``DecodeService``: needs ``lock``, ``incoming``, ``counters``, ``cfg``, ``_refuse`` and
    ``_complete``."""

    lock: threading.Lock
    incoming: dict[Key, Any]
    counters: dict[str, Any]
    cfg: Any

    def _split_init(self) -> None:
        self.part_streams: dict[Key, PartStream] = {}
        self.waiting_parts: dict[Key, Waiting] = {}

    def _is_part_stream(self, key: Key, payload: Any) -> bool:
        """Whether this STREAM_DATA belongs to a part stream (one known, or a new one opening with PART)."""
        with self.lock:
            if key in self.part_streams:
                return True
            if key in self.incoming:
                return False
        view = memoryview(payload).cast("B")
        return len(view) > 0 and view[0] == Part.PART

    def _part_data(self, key: Key, msg: Message) -> None:
        with self.lock:
            ps = self.part_streams.get(key)
        if ps is None:
            self._part_open(key, msg)
            return
        with ps.lock:
            if ps.refused:
                return
            if ps.decoder is None:
                self._keep_early(ps, msg.payload)
                return
            decoder = ps.decoder
        self._feed_part(ps, decoder, msg.payload, msg.peer)

    def _part_open(self, key: Key, msg: Message) -> None:
        try:
            stream, index, count = parse_part(memoryview(msg.payload).cast("B"), HandoffError)
        except HandoffError as exc:
            self._bad_part(key, msg, exc)
            return
        ps = PartStream((msg.peer, stream), index, count)
        with self.lock:
            self.part_streams[key] = ps
            inc = self.incoming.get(ps.handoff)
            if inc is not None and inc.refused:  # its handoff was refused already: nothing of it is kept
                ps.refused = True
                return
            if inc is None or not inc.split:  # its header stream's SPLIT is not read yet: wait for it
                waiting = self.waiting_parts.setdefault(ps.handoff, Waiting())
                waiting.streams.append(ps)
                ps.refused, ps.waiting = bool(waiting.refused), waiting
                if len(waiting.streams) > MAX_KV_SPLIT and not waiting.refused:
                    waiting.drop(f"more than {MAX_KV_SPLIT} part streams")
                return
            decoder = inc.decoder
        self._join(ps, inc, decoder)

    def _bad_part(self, key: Key, msg: Message, exc: HandoffError) -> None:
        """A PART record that breaks the bounds: the part stream is ignored, and the handoff it names (by its
        sender's header stream id, when the record holds one) is refused, or will be when its header comes."""
        log.warning("decode: refusing a part stream from %s: %s", msg.peer, exc)
        view = memoryview(msg.payload).cast("B")
        handoff = (msg.peer, int.from_bytes(view[1:9], "big")) if len(view) >= 9 else None
        with self.lock:
            self.part_streams[key] = PartStream((msg.peer, -1), 0, 0, refused=True)
            inc = self.incoming.get(handoff) if handoff is not None else None
            if handoff is not None and inc is None:
                waiting = self.waiting_parts.setdefault(handoff, Waiting())
                if not waiting.refused:
                    waiting.drop(f"a bad PART record ({exc})")
        if inc is not None:
            self._refuse(inc, exc.code, f"decode node refused the KV handoff from {msg.peer}: {exc}", inc.decoder)

    def _keep_early(self, ps: PartStream, payload: Any) -> None:
        """A part of a stream not joined yet (under ``ps.lock``): kept, within the handoff's bound."""
        size = memoryview(payload).nbytes
        with self.lock:
            waiting = ps.waiting
            if waiting is None or waiting.refused or waiting.bytes + size > MAX_KV_EARLY_BYTES:
                if waiting is not None and not waiting.refused:
                    waiting.drop(f"more than {MAX_KV_EARLY_BYTES} bytes")
                ps.refused, ps.early = True, []
                return
            waiting.bytes += size
        ps.early.append(payload)
        ps.early_bytes += size

    def _split_started(self, key: Key, inc: Any, decoder: HandoffDecoder) -> None:
        """The header stream ``key``'s SPLIT was read: the part streams waiting for it join."""
        with self.lock:
            inc.split = True
            waiting = self.waiting_parts.pop(key, None)
        if waiting is None:
            return
        if waiting.refused:
            log.warning("decode: part streams from %s sent %s before their header stream", key[0], waiting.refused)
            self._refuse(inc, ErrorCode.BAD_REQUEST, f"decode node refused the KV handoff from {key[0]}: its part "
                         f"streams sent {waiting.refused} before its header stream", decoder)
            return
        for ps in waiting.streams:
            self._join(ps, inc, decoder)

    def _join(self, ps: PartStream, inc: Any, decoder: HandoffDecoder | None) -> None:
        """Part stream ``ps`` joins its handoff's decoder; the parts it kept go first (under its lock, so its
        own thread's next part waits for them)."""
        with ps.lock:
            if ps.refused or inc.refused or decoder is None:
                ps.refused = True
                return
            with self.lock:
                inc.parts.append(ps)
            try:
                decoder.start_part(ps.index, ps.count)
                for payload in ps.early:
                    decoder.feed_part(ps.index, payload)
            except HandoffError as exc:
                self._refuse(inc, exc.code, f"decode node refused the KV handoff from {ps.handoff[0]}: {exc}", decoder)
                return
            ps.early, ps.early_bytes, ps.decoder, ps.waiting = [], 0, decoder, None
            closed = ps.closed
        if closed:
            self._part_closed(ps, decoder)
        self._maybe_done(ps, decoder)

    def _feed_part(self, ps: PartStream, decoder: HandoffDecoder, payload: Any, peer: PeerId) -> None:
        with self.lock:
            inc = self.incoming.get(ps.handoff)
        if inc is None or inc.refused:
            return
        inc.last = time.monotonic()
        try:
            decoder.feed_part(ps.index, payload)
        except HandoffError as exc:
            self._refuse(inc, exc.code, f"decode node refused the KV handoff from {peer}: {exc}", decoder)
            return
        self._maybe_done(ps, decoder)

    def _maybe_done(self, ps: PartStream, decoder: HandoffDecoder) -> None:
        """The last part stream's END came: the handoff goes to the scheduler, once."""
        if decoder.state != "done":
            return
        with self.lock:
            inc = self.incoming.get(ps.handoff)
            if inc is None or inc.refused or inc.decoder is not decoder:
                return
            inc.decoder = None  # whatever still comes is ignored
            self.incoming.pop(ps.handoff, None)
            for other in inc.parts:
                other.refused = True
        self._complete(inc, decoder, ps.handoff[0])  # type: ignore[attr-defined]
        inc.refused = True

    def _part_end(self, key: Key, msg: Message) -> None:
        """A part stream's STREAM_END: status 1 (aborted) or one before its END drops the whole handoff."""
        with self.lock:
            ps = self.part_streams.pop(key, None)
        if ps is None:
            return
        with ps.lock:
            if ps.refused:
                return
            if ps.decoder is None:  # not joined yet: an abort drops it now, a clean end waits with its parts
                if msg.status:
                    ps.refused, ps.early = True, []
                else:
                    ps.closed = True
                return
            decoder = ps.decoder
        if msg.status:
            code, text = decode_error(msg.payload)
            with self.lock:
                inc = self.incoming.get(ps.handoff)
            if inc is not None:
                self.counters["aborted"] += 1
                self._refuse(inc, ErrorCode.CANCELLED, f"part {ps.index} was aborted ({code.wire_name}: {text})",
                             decoder, quiet=True)
            return
        self._part_closed(ps, decoder)

    def _part_closed(self, ps: PartStream, decoder: HandoffDecoder) -> None:
        """A part stream ended cleanly: refused unless its END part came."""
        if decoder.split is not None and ps.index in decoder.split.ended:
            return
        with self.lock:
            inc = self.incoming.get(ps.handoff)
        if inc is not None:
            self._refuse(inc, ErrorCode.BAD_REQUEST, f"decode node refused the KV handoff from {ps.handoff[0]}: part "
                         f"{ps.index} ended before its END record", decoder)

    def _purge_parts(self, now: float) -> None:
        """Forget (under the lock) part streams waiting for a header stream longer than twice --handoff-timeout."""
        limit = self.cfg.handoff_timeout_s * 2
        for key in [k for k, w in self.waiting_parts.items() if now - w.since > limit]:
            for ps in self.waiting_parts.pop(key).streams:
                ps.refused, ps.early = True, []
        for key in [k for k, ps in self.part_streams.items()
                    if ps.refused and ps.handoff not in self.incoming and ps.handoff not in self.waiting_parts]:
            del self.part_streams[key]
