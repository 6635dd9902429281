"""The decode service: receive KV handoffs, admit them as prefilled sequences, stream tokens to the router.

A handoff stream (any authenticated member may send one) is decoded part by part against this model's
``KVLayout`` and context length (``HandoffDecoder``); a stream that breaks a bound is refused at that
part, its bytes dropped, and the router named in its header (if its nonce and router read) receives an
ERROR. Arriving handoffs count against admission, at most half the slots per sender IP; a stream with no
part for twice ``--handoff-timeout`` is forgotten. A handoff split over several streams (docs/disagg.md §4.9)
is joined by ``SplitIntake``: its part streams feed the header stream's one decoder, each from its own thread.
A complete handoff enters the scheduler through ``submit_prefilled``: it waits for a slot like any
request, the executor installs its cache, the prefill's first token is emitted, and decoding goes on.
Every event goes to the router as TOKENS, the end as FINISH. A CANCEL frees the sequence (running,
waiting or still arriving); a CANCEL that arrives before its handoff is remembered for a minute.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from mlxcel import envs
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.cluster.messages import Message, decode_error
from mlxcel.cluster.wire import Kind
from mlxcel.disagg import messages as m
from mlxcel.disagg.flags import NodeConfig
from mlxcel.disagg.heap import keep_freed_memory
from mlxcel.disagg.intake import Intake
from mlxcel.disagg.host_staging import shared_staging
from mlxcel.disagg.kv_cache import handoff_allocator, import_cache, probe_layout, staged_allocator
from mlxcel.disagg.kv_codec import Handoff, HandoffDecoder, HandoffError
from mlxcel.disagg.loop import LoopThread
from mlxcel.disagg.service import RoleService
from mlxcel.disagg.split_intake import SplitIntake
from mlxcel.disagg.wire import CANCEL_MEMORY_S, PROGRESS_INTERVAL_S, MsgType
from mlxcel.engine.grammar import GrammarError, check_replay
from mlxcel.engine.executor import KVImport, LocalExecutor
from mlxcel.engine.interface import EngineError, EngineRequest, TokenEvent
from mlxcel.engine.logits import replayed
from mlxcel.engine.runner import Sampled
from mlxcel.engine.scheduler import Scheduler
from mlxcel.error_codes import ErrorCode
from mlxcel.models.token_ids import model_vocab_size

log = logging.getLogger("mlxcel.disagg.decode")


def _check_grammar(meta: m.HandoffMeta, prompt: tuple[int, ...], vocab_size: int | None) -> None:
    """A handoff's grammar compiles here and accepts the tokens generated so far (``generated``: the prompt's
    tail and ``first``), checked from its header, before its KV streams in; ``MessageRefused`` or ``GrammarError``
    (both BAD_REQUEST)."""
    if meta.params.grammar is not None:
        if meta.generated > len(prompt):  # the request's own prompt holds one token at least
            raise m.MessageRefused(f"generated ({meta.generated}) must be at most the handoff's {len(prompt)} prompt "
                                   "ids (the request's own prompt has one at least)")
        check_replay(meta.params.grammar, replayed(meta.params, (*prompt, meta.first.token), meta.generated),
                     vocab_size)


@dataclass(eq=False)
class Incoming:
    """A handoff stream being received."""

    decoder: HandoffDecoder | None
    sender: PeerId | None = None
    last: float = field(default_factory=time.monotonic)  # when its last part arrived
    meta: m.HandoffMeta | None = None
    refused: bool = False
    split: bool = False  # its SPLIT was read: part streams carry its tensor bytes (docs/disagg.md §4.9)
    parts: list[Any] = field(default_factory=list)  # those part streams, once joined

    def reply_to(self, decoder: HandoffDecoder | None = None) -> tuple[str, PeerId] | None:
        """(nonce, router) of its request document once that is readable (from ``meta``, else from ``decoder``
        or the current one: a CANCEL may drop it on another thread), else None."""
        if self.meta is not None:
            return self.meta.nonce, self.meta.router
        decoder = decoder or self.decoder
        return m.reply_to(decoder.meta) if decoder is not None else None


class DecodeService(SplitIntake, RoleService):
    """A decode node: handoff streams in, tokens out to the router that dispatched each request."""

    role = "decode"

    def __init__(self, cfg: NodeConfig, model: Any, tokenizer: Any, *, secret: ClusterSecret, identity: str,
                 context_length: int, parallel: int, max_batch_size: int, max_queue: int, warmup: bool = True):
        super().__init__(cfg, identity, secret)
        self.layout = probe_layout(model)
        self.heap_kept = keep_freed_memory()  # each handoff's tensor buffers on pages the last ones faulted in
        self.staging = None if cfg.handoff_copy else shared_staging(cfg.handoff_staging)
        # tensor buffers: page-locked ones copied into MLX by DMA (CUDA), else MLX memory where numpy can write it
        self.allocate = (staged_allocator(self.staging) if self.staging is not None
                         else handoff_allocator(copy=cfg.handoff_copy))
        self.context_length = context_length
        self.vocab_size = model_vocab_size(model)  # every token id of a handoff is below it
        self.capacity = parallel + max_queue
        self.per_sender = max(1, self.capacity // 2)  # handoffs one sender IP may have arriving at once
        # MLXCEL_TEST_DECODE_STEP_DELAY_S (test only) keeps a request in flight long enough
        # to kill a node or drop a client under it
        self.executor = LocalExecutor(model, max_batch_size=max_batch_size, importer=import_cache,
                                      step_delay_s=envs.settings().test_decode_step_delay_s)
        self.scheduler = Scheduler(self.executor, tokenizer, context_length=context_length, parallel=parallel,
                                   max_queue=max_queue, warmup=warmup)
        self.loop = LoopThread("mlxcel-decode-loop")
        self.intake = Intake(cfg.intake_workers)  # handoff parts beside the reader threads (0: on them)
        self.incoming: dict[tuple[PeerId, int], Incoming] = {}
        self.running: dict[str, Any] = {}  # nonce -> (EventStream, the task relaying it)
        self.cancelled: dict[str, float] = {}  # nonce -> when forgotten
        self.last_sent: dict[str, tuple[PeerId, float]] = {}  # nonce -> (router, when it last heard of it)
        self.counters = {"handoffs": 0, "handoff_bytes": 0, "refused": 0, "aborted": 0, "cancelled": 0, "finished": 0}
        self._split_init()

    def start(self) -> None:
        self.scheduler.start().wait_ready()
        self.serve()
        self.loop.submit(self._keepalive())

    async def _keepalive(self) -> None:
        """PROGRESS for every request waiting here with nothing sent to its router for a while (a queue)."""
        while True:
            await asyncio.sleep(PROGRESS_INTERVAL_S)
            now = time.monotonic()
            with self.lock:
                stale = self._purge()
                quiet = [(nonce, router) for nonce, (router, last) in self.last_sent.items()
                         if now - last >= PROGRESS_INTERVAL_S]
            self._forget(stale)
            for nonce, router in quiet:
                self.send(router, m.Progress(nonce))

    # -- handoff streams -------------------------------------------------------------------------

    def on_stream(self, msg: Message) -> None:
        """On the reader thread: hand the part to the intake (its stream's worker, in order)."""
        key = (msg.peer, msg.id)
        if msg.kind is Kind.STREAM_DATA:
            self.intake.put(key, self._data, key, msg)
        elif msg.kind is Kind.STREAM_END:
            self.intake.put(key, self._end, key, msg)
        else:
            super().on_stream(msg)

    def _data(self, key: tuple[PeerId, int], msg: Message) -> None:
        if self._is_part_stream(key, msg.payload):
            self._part_data(key, msg)
            return
        stale: list[Incoming] = []
        with self.lock:
            inc = self.incoming.get(key)
            if inc is None:
                stale = self._purge()
                if self.layout.unsupported:
                    inc = self.incoming[key] = Incoming(None, refused=True)
                    log.warning("decode: refusing a handoff from %s: %s", msg.peer, self.layout.unsupported)
                    return
                inc = self.incoming[key] = Incoming(HandoffDecoder(self.layout, self.context_length, self.vocab_size,
                                                                   self.allocate), msg.peer)
            inc.last = time.monotonic()
        self._forget(stale)
        decoder = inc.decoder  # this thread's reference: a CANCEL (another connection's thread) may drop inc's
        if inc.refused or decoder is None:
            return
        try:
            decoder.feed(msg.payload)
        except HandoffError as exc:  # the router of a readable request document hears why
            self._refuse(inc, exc.code, f"decode node refused the KV handoff from {msg.peer}: {exc}", decoder)
            return
        if inc.meta is None:
            self._header(inc, decoder, msg.peer)
        elif decoder.state == "split" and not inc.split:
            self._split_started(key, inc, decoder)
        elif decoder.state == "done":  # END checked every byte: decode now, not at STREAM_END
            self._complete(inc, decoder, msg.peer)
            with self.lock:
                inc.decoder, inc.refused = None, True  # the rest of the stream is ignored; its STREAM_END forgets it

    def _header(self, inc: Incoming, decoder: HandoffDecoder, peer: PeerId) -> None:
        if inc.refused:  # forgotten while this part was read
            return
        try:
            meta = m.HandoffMeta.parse(decoder.meta, self.vocab_size)
            _check_grammar(meta, decoder.prompt, self.vocab_size)
        except (m.MessageRefused, GrammarError) as exc:
            self._refuse(inc, exc.code, f"decode node refused the KV handoff from {peer}: {exc}", decoder)
            return
        inc.meta = meta
        nonce = inc.meta.nonce
        with self.lock:
            arriving = [i for i in self.incoming.values() if i.meta is not None and not i.refused]
            busy = len(self.running) + len(arriving)
            mine = sum(1 for i in arriving if i.sender is not None and i.sender.host == peer.host)
            cancelled = nonce in self.cancelled or nonce in self.running
        if cancelled:
            self._refuse(inc, ErrorCode.CANCELLED, "", quiet=True)
        elif mine > self.per_sender:
            self._refuse(inc, ErrorCode.OVERLOADED, f"decode node holds {self.per_sender} handoffs arriving from "
                         f"{peer.host} already (at most half its {self.capacity} slots per sender); retry later")
        elif busy > self.capacity:
            self._refuse(inc, ErrorCode.OVERLOADED, f"decode node is at capacity ({self.capacity} sequences); retry later")

    def _end(self, key: tuple[PeerId, int], msg: Message) -> None:
        with self.lock:
            part = key in self.part_streams
            inc = self.incoming.get(key)
            if not part and not (inc is not None and inc.split and not msg.status):  # a split's parts finish it
                inc = self.incoming.pop(key, None)
        if part:
            self._part_end(key, msg)
            return
        if inc is not None and inc.split:
            if msg.status and not inc.refused:  # the sender gave up: every part stream's bytes go
                self.counters["aborted"] += 1
                self._refuse(inc, ErrorCode.CANCELLED, "", quiet=True)
            return
        decoder = inc.decoder if inc is not None else None
        if inc is None or inc.refused or decoder is None:
            return
        if msg.status:
            code, text = decode_error(msg.payload)
            self.counters["aborted"] += 1
            log.info("decode: the handoff from %s was aborted (%s: %s)", msg.peer, code.wire_name, text)
            return
        self._complete(inc, decoder, msg.peer)

    def _complete(self, inc: Incoming, decoder: HandoffDecoder, peer: PeerId) -> None:
        """A stream whose END part arrived goes to the scheduler (one that ended without it is refused).
        A CANCEL that came meanwhile wins: ``_decode`` checks it again under the lock before admitting."""
        if inc.refused:
            return
        try:
            handoff = decoder.result()
        except HandoffError as exc:
            self._refuse(inc, exc.code, f"decode node refused the KV handoff from {peer}: {exc}", decoder)
            return
        assert inc.meta is not None
        self.counters["handoffs"] += 1
        self.counters["handoff_bytes"] += handoff.nbytes
        self.loop.submit(self._decode(inc.meta, handoff))

    def _refuse(self, inc: Incoming, code: ErrorCode, message: str, decoder: HandoffDecoder | None = None, *,
                quiet: bool = False) -> None:
        """Refuse a handoff once (its buffers go now, later parts are ignored); its router hears why unless quiet."""
        with self.lock:
            if inc.refused:  # refused already (a CANCEL and a bad part, or the purge, on two threads)
                return
            reply = inc.reply_to(decoder)
            split = inc.decoder if inc.split else None
            inc.refused, inc.decoder = True, None
            for ps in inc.parts:
                ps.refused = True
        if split is not None:  # its part streams' threads hold it too
            split.abandon()
        self.counters["refused"] += 1
        if quiet:
            return
        log.warning("decode: %s", message)
        if reply is not None:
            self.send(reply[1], m.Error(reply[0], code, message))

    def _purge(self) -> list[Incoming]:
        """Forget streams with no part for twice --handoff-timeout (their sender vanished without a STREAM_END)
        and old cancellations (under the lock); returns the forgotten streams still live."""
        now = time.monotonic()
        stale = [k for k, i in self.incoming.items() if now - i.last > self.cfg.handoff_timeout_s * 2]
        live = [inc for inc in (self.incoming.pop(k) for k in stale) if not inc.refused]
        self._purge_parts(now)
        for nonce in [n for n, until in self.cancelled.items() if until < now]:
            del self.cancelled[nonce]
        return live

    def _forget(self, stale: list[Incoming]) -> None:
        for inc in stale:
            self._refuse(inc, ErrorCode.TIMEOUT, f"decode node forgot a KV handoff from {inc.sender}: no part for "
                         f"{self.cfg.handoff_timeout_s * 2:g}s (twice --handoff-timeout)")

    # -- decoding ------------------------------------------------------------------------------------

    async def _decode(self, meta: m.HandoffMeta, handoff: Handoff) -> None:
        request = EngineRequest(handoff.prompt, meta.params, meta.top_logprobs, meta.ignore_eos, request_id=meta.nonce)
        first = Sampled(meta.first.token, meta.first.logprob, meta.first.top_logprobs)
        with self.lock:
            if meta.nonce in self.cancelled or meta.nonce in self.running:
                return
        try:
            context = (*handoff.prompt, first.token)  # what the penalties look back over (engine/logits.py)
            replay = replayed(meta.params, context, meta.generated)  # a grammar's matcher goes on from here
            stream = self.scheduler.submit_prefilled(request, first, KVImport(handoff, meta.draws, context, replay))
        except EngineError as exc:
            self.send(meta.router, m.Error(meta.nonce, exc.code, str(exc)))
            return
        with self.lock:  # a CANCEL that came since the check above: it found nothing running, so it is ours to do
            cancelled = meta.nonce in self.cancelled
            if not cancelled:
                self.running[meta.nonce] = (stream, asyncio.current_task())
                self.last_sent[meta.nonce] = (meta.router, time.monotonic())
        if cancelled:
            stream.cancel()  # the scheduler frees the slot; no token of it is sent
            return
        gone = lambda exc: self.loop.soon(self._stop, meta.nonce)  # noqa: E731 - the router is gone: stop
        try:
            async for ev in stream:
                self.last_sent[meta.nonce] = (meta.router, time.monotonic())
                if isinstance(ev, TokenEvent):
                    self.send(meta.router, m.Tokens(meta.nonce, (ev,)), gone)
                else:
                    self.counters["finished"] += 1
                    self.send(meta.router, m.Finish(meta.nonce, ev), gone)
        except asyncio.CancelledError:
            pass  # cancelled: the scheduler freed the sequence and sends no finish
        finally:
            with self.lock:
                self.running.pop(meta.nonce, None)
                self.last_sent.pop(meta.nonce, None)

    def _stop(self, nonce: str) -> None:
        """On the loop: cancel a running sequence (its KV is freed) and the task relaying it."""
        with self.lock:
            entry = self.running.get(nonce)
        if entry is not None:
            stream, task = entry
            stream.cancel()
            task.cancel()

    # -- control -------------------------------------------------------------------------------------

    def on_control(self, peer: PeerId, kind: MsgType, doc: dict[str, Any]) -> None:
        if kind is not MsgType.CANCEL:
            raise m.MessageRefused(f"a decode node takes CANCEL and handoff streams, not {kind.name}",
                                   ErrorCode.UNSUPPORTED)
        nonce = m.nonce_of(doc)
        with self.lock:
            running = nonce in self.running
            self.cancelled[nonce] = time.monotonic() + CANCEL_MEMORY_S
            arriving = [i for i in self.incoming.values() if i.meta is not None and i.meta.nonce == nonce]
        self.counters["cancelled"] += 1
        for inc in arriving:
            self._refuse(inc, ErrorCode.CANCELLED, "", quiet=True)
        if running:
            self.loop.soon(self._stop, nonce)

    def state(self) -> dict[str, Any]:
        c = self.scheduler.counters
        with self.lock:
            arriving = [i for i in self.incoming.values() if i.decoder is not None]
        return {"ready": True, "sequences": len(self.running), "running": c.running, "waiting": c.waiting,
                "kv_sequences": len(self.executor.runners[0]), "incoming": len(arriving),
                "incoming_bytes": sum(i.decoder.received for i in arriving if i.decoder is not None),
                "early_part_streams": sum(len(w.streams) for w in self.waiting_parts.values()),
                "early_part_bytes": sum(w.bytes for w in self.waiting_parts.values()),
                "cache_supported": self.layout.unsupported is None, "heap_kept": self.heap_kept,
                "connections": self.transport.authenticated_connections, **self.counters}

    def close(self) -> None:
        super().close()
        self.intake.close()
        self.scheduler.close()
        self.loop.close()
