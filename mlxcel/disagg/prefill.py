"""The prefill service: run a prompt, sample its first token, hand the KV cache to a decode node.

A GENERATE from a router (any authenticated member) goes through these checks before any prefill
work, each failure answered to the router with an ERROR: the model's cache can be handed off (else
UNSUPPORTED), the decode target (``decode_target``, else the first ``--decode-peers``) is in
``MLXCEL_DECODE_ALLOWLIST`` (else UNAUTHORIZED, and no connection is made), and it can be dialled
(else UNREACHABLE). Then the prompt runs on this node's scheduler as a one-token request; the
executor exports the sequence's KV when the scheduler releases it (``export_on_finish``), the service
reads it (``request_finished``) and a worker streams header, chunks and end record to the decode node
(``kv_codec``), then tells the router HANDED_OFF with the bytes and the seconds the stream took; the
export is freed once the stream ended, sent or not (``finished_sending``). A CANCEL frees the
sequence wherever it is, and aborts a stream in progress so the decode node frees what it buffered.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from mlxcel.cluster.errors import ClusterError
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.disagg import messages as m
from mlxcel.disagg.allowlist import Allowlist
from mlxcel.disagg.flags import NodeConfig
from mlxcel.disagg.host_staging import shared_staging
from mlxcel.disagg.kv_cache import export_cache, probe_layout
from mlxcel.disagg.kv_codec import chunk_parts, encode_header
from mlxcel.disagg.kv_split import total_bytes
from mlxcel.disagg.split_send import send_split
from mlxcel.disagg.lanes import LanePicker
from mlxcel.disagg.loop import LoopThread
from mlxcel.disagg.service import RoleService
from mlxcel.disagg.wire import PROGRESS_INTERVAL_S, MsgType
from mlxcel.engine.executor import KVExport, LocalExecutor
from mlxcel.engine.interface import EngineError, EngineRequest, FinishEvent, TokenEvent
from mlxcel.engine.scheduler import Scheduler
from mlxcel.error_codes import ErrorCode
from mlxcel.models.token_ids import model_vocab_size

log = logging.getLogger("mlxcel.disagg.prefill")


@dataclass(eq=False)
class Job:
    """One GENERATE on this node."""

    gen: m.Generate
    router: PeerId
    target: PeerId
    params: Any  # the request's sampling parameters, seed resolved
    stream: Any = None
    task: Any = None  # the asyncio task running it
    cancelled: bool = False
    started: float = field(default_factory=time.perf_counter)

    @property
    def nonce(self) -> str:
        return self.gen.nonce

    def prefill_request(self) -> EngineRequest:
        """The request this node runs: the prompt and one token, no stop strings, EOS kept."""
        return EngineRequest(self.gen.prompt, replace(self.params, max_tokens=1, stop=()),
                             self.gen.top_logprobs, ignore_eos=True, request_id=self.nonce, draws=self.gen.draws)


class PrefillService(RoleService):
    """A prefill node: GENERATE in, a KV handoff out to the decode node, HANDED_OFF or ERROR to the router."""

    role = "prefill"

    def __init__(self, cfg: NodeConfig, model: Any, tokenizer: Any, *, secret: ClusterSecret, identity: str,
                 context_length: int, parallel: int, max_batch_size: int, max_queue: int, warmup: bool = True,
                 prefix_cache_bytes: int = 0, allowlist: Allowlist | None = None):
        super().__init__(cfg, identity, secret)
        self.layout = probe_layout(model)
        self.allowlist = allowlist if allowlist is not None else Allowlist.from_env()
        self.context_length = context_length
        self.vocab_size = model_vocab_size(model)  # every GENERATE's prompt ids are below it
        self.staging = shared_staging(cfg.handoff_staging)  # page-locked copies of the KV to seal from (CUDA)
        contiguous = self.staging is not None
        self.executor = LocalExecutor(model, max_batch_size=max_batch_size, prefix_cache_bytes=prefix_cache_bytes,
                                      exporter=lambda cache, length: export_cache(cache, self.layout, length,
                                                                                  contiguous))
        # a prompt's last token runs alone (no batched tails): the KV it exports is the sequence's own cache
        self.scheduler = Scheduler(self.executor, tokenizer, context_length=context_length, parallel=parallel,
                                   max_queue=max_queue, warmup=warmup, batch_tails=False)
        self.eos = frozenset(tokenizer.eos_token_ids)  # a first token that ends the request is not sent early
        self.loop = LoopThread("mlxcel-prefill-loop")
        self.workers = ThreadPoolExecutor(max_workers=parallel + 1, thread_name_prefix="mlxcel-handoff")
        self.lanes = LanePicker(cfg.handoff_lanes)  # concurrent handoffs to one decode node on their own connections
        # a large handoff's part streams, one per lane, each sealed on its own thread (docs/disagg.md §4.9)
        self.part_workers = ThreadPoolExecutor(max_workers=(parallel + 1) * cfg.handoff_lanes,
                                               thread_name_prefix="mlxcel-handoff-part")
        self.jobs: dict[str, Job] = {}
        self.counters = {"requests": 0, "handoffs": 0, "handoff_bytes": 0, "handoff_seconds": 0.0,
                         "refused": 0, "failed": 0, "cancelled": 0, "split_handoffs": 0}
        if self.layout.unsupported:
            log.warning("prefill: %s; every request will be refused", self.layout.unsupported)

    def start(self) -> None:
        self.scheduler.start().wait_ready()
        self.serve()
        self.loop.submit(self._keepalive())

    async def _keepalive(self) -> None:
        """PROGRESS for every request held here (queued, prefilling, streaming), so a long prefill on a live
        node never meets the router's handoff timeout while a silent node still does."""
        while True:
            await asyncio.sleep(PROGRESS_INTERVAL_S)
            with self.lock:
                jobs = [j for j in self.jobs.values() if not j.cancelled]
            for job in jobs:
                self.send(job.router, m.Progress(job.nonce))

    # -- messages -------------------------------------------------------------------------------

    def on_control(self, peer: PeerId, kind: MsgType, doc: dict[str, Any]) -> None:
        if kind is MsgType.GENERATE:
            self._generate(peer, m.Generate.parse(doc, self.context_length, self.vocab_size))
        elif kind is MsgType.CANCEL:
            self._cancel(m.nonce_of(doc))
        else:
            raise m.MessageRefused(f"a prefill node takes GENERATE and CANCEL, not {kind.name}", ErrorCode.UNSUPPORTED)

    def _refuse(self, router: PeerId, nonce: str, code: ErrorCode, message: str, node: str | None = None) -> None:
        self.counters["refused" if code.error_class.value != "unavailable" else "failed"] += 1
        log.info("prefill: request %s: %s", nonce, message)
        self.send(router, m.Error(nonce, code, message, node))

    def _generate(self, router: PeerId, gen: m.Generate) -> None:
        self.counters["requests"] += 1
        if self.layout.unsupported:
            self._refuse(router, gen.nonce, ErrorCode.UNSUPPORTED, self.layout.unsupported)
            return
        target = gen.decode_target or (self.cfg.decode_peers[0] if self.cfg.decode_peers else None)
        if target is None:
            self._refuse(router, gen.nonce, ErrorCode.BAD_REQUEST,
                         "the request names no decode_target and this prefill node has no --decode-peers")
            return
        if gen.decode_target is not None and not self.allowlist.allows(target):
            self._refuse(router, gen.nonce, ErrorCode.UNAUTHORIZED,
                         f"decode_target {target} is not in MLXCEL_DECODE_ALLOWLIST; the KV cache stays here",
                         str(target))
            return
        params = gen.params
        if not params.greedy and params.seed is None:  # the decode node continues the same random stream
            params = replace(params, seed=int.from_bytes(os.urandom(8), "little") >> 1)
        job = Job(gen, router, target, params)
        log.debug("prefill: request %s from %s: %d prompt tokens, KV to %s", gen.nonce, router, len(gen.prompt), target)
        with self.lock:
            if gen.nonce in self.jobs:
                raise m.MessageRefused(f"request {gen.nonce} is already running here", ErrorCode.CONFLICT)
            self.jobs[gen.nonce] = job
        self.loop.submit(self._run(job))

    def _cancel(self, nonce: str) -> None:
        with self.lock:
            job = self.jobs.get(nonce)
        if job is None or job.cancelled:
            return
        job.cancelled = True
        self.counters["cancelled"] += 1
        self.loop.soon(self._stop, job)

    @staticmethod
    def _stop(job: Job) -> None:
        """On the loop: cancel the prefill (its KV is freed) and stop waiting for it."""
        if job.stream is not None:
            job.stream.cancel()
        if job.task is not None:
            job.task.cancel()  # a handoff in progress sees job.cancelled and aborts its stream

    # -- one request -----------------------------------------------------------------------------

    async def _run(self, job: Job) -> None:
        loop = asyncio.get_running_loop()
        job.task = asyncio.current_task()
        try:
            try:  # dial first: an unreachable decode node costs no prefill work
                await loop.run_in_executor(self.workers, self.transport.connection, job.target)
            except ClusterError as exc:
                self._refuse(job.router, job.nonce, ErrorCode.UNREACHABLE,
                             f"decode node {job.target} is unreachable: {exc}", str(job.target))
                return
            if job.cancelled:
                return
            first, finish = await self._prefill(job)
            if finish is None or job.cancelled:
                return
            if finish.error is not None or first is None:
                self._refuse(job.router, job.nonce, finish.code or ErrorCode.INTERNAL, finish.error or "no first token")
                return
            kv = self._exported(job)
            if kv is not None:
                self._send_first(job, first)
                await loop.run_in_executor(self.workers, self._hand_off, job, first, kv)
        except asyncio.CancelledError:
            pass  # cancelled while prefilling: the scheduler freed the sequence
        except Exception:  # noqa: BLE001 - one request fails, the node goes on
            log.exception("prefill: request %s failed", job.nonce)
            self._refuse(job.router, job.nonce, ErrorCode.INTERNAL, "the prefill node failed; see its log")
        finally:
            with self.lock:
                self.jobs.pop(job.nonce, None)
            self.executor.finished_sending(job.nonce)

    async def _prefill(self, job: Job) -> tuple[TokenEvent | None, FinishEvent | None]:
        self.executor.export_on_finish(job.nonce)
        try:
            job.stream = self.scheduler.submit(job.prefill_request())
        except EngineError as exc:
            self._refuse(job.router, job.nonce, exc.code, str(exc))
            return None, None
        if job.cancelled:
            job.stream.cancel()
            return None, None
        first = finish = None
        async for ev in job.stream:
            if isinstance(ev, TokenEvent):
                first = ev
            else:
                finish = ev
        return first, finish

    def _send_first(self, job: Job, first: TokenEvent) -> None:
        """The first token to the router now, before its KV travels (docs/disagg.md §3.1, "The first token
        early"), where it is the event a single node streams for it: no stop strings (their hold-back is the
        decode node's) and not an EOS that ends the request."""
        if job.params.stop or (first.token in self.eos and not job.gen.ignore_eos):
            return
        self.send(job.router, m.Tokens(job.nonce, (first,)))

    def _exported(self, job: Job) -> KVExport | None:
        """The KV to send for a prefilled job; None (its router told why) when the export failed."""
        why: Exception | None = None
        try:
            kv = self.executor.request_finished(job.nonce)
        except Exception as exc:  # noqa: BLE001 - this request fails, the node goes on
            kv, why = None, exc
        if kv is None:
            self._refuse(job.router, job.nonce, ErrorCode.INTERNAL, f"cannot export the KV cache: {why}")
        return kv

    def _hand_off(self, job: Job, first: TokenEvent, kv: KVExport) -> None:
        """Stream header, chunks and end record to the decode node (a worker thread)."""
        meta = m.HandoffMeta(job.nonce, job.router, job.params, first, job.gen.top_logprobs, job.gen.ignore_eos,
                             draws=0 if job.params.greedy else job.gen.draws + 1, generated=job.gen.draws + 1)
        prefill_s = time.perf_counter() - job.started
        start = time.perf_counter()
        staged = self.staging.to_host(kv.data) if self.staging is not None else None  # None: the pool is full
        try:
            with self.lanes.take() as lane:
                sent = self._stream(job, encode_header(meta.doc(), job.gen.prompt, self.layout),
                                    staged[0] if staged is not None else kv.data, lane)
        except ClusterError as exc:
            self._refuse(job.router, job.nonce, ErrorCode.UNREACHABLE,
                         f"handing the KV cache to decode node {job.target} failed: {exc}", str(job.target))
            return
        finally:
            if staged is not None:
                staged[1].release()  # every byte is in the socket or sealed in a frame by now
        if sent is None:
            return
        seconds = time.perf_counter() - start
        self.counters["handoffs"] += 1
        self.counters["handoff_bytes"] += sent
        self.counters["handoff_seconds"] += seconds
        log.debug("prefill: %s handed %d bytes (%d tokens) to %s in %.4fs", job.nonce, sent, kv.length, job.target,
                  seconds)
        self.send(job.router, m.HandedOff(job.nonce, sent, seconds, str(job.target), prefill_s))

    def _stream(self, job: Job, header: bytes, tensors: Any, lane: int) -> int | None:
        """One handoff stream on ``lane`` (split over every lane when large): the bytes sent, or None when the
        request was cancelled on the way."""
        count = self.cfg.handoff_lanes
        if count > 1 and total_bytes(tensors) >= self.cfg.split_min_bytes:
            return self._stream_split(job, header, tensors, lane, count)
        writer = self.transport.open_stream(job.target, lane)
        writer.write(header)
        sent = len(header)
        for part in chunk_parts(tensors):  # views of the exported KV, never joined
            if job.cancelled:
                writer.abort(ErrorCode.CANCELLED, "the request was cancelled")
                return None
            writer.write(part)
            sent += sum(len(p) for p in part)
        writer.close()
        return sent

    def _stream_split(self, job: Job, header: bytes, tensors: Any, lane: int, count: int) -> int | None:
        """A handoff split over ``count`` part streams (docs/disagg.md §4.9; ``split_send``)."""
        sent = send_split(self.transport, job.target, header, tensors, lane, count, self.part_workers,
                          lambda: job.cancelled)
        if sent is not None:
            self.counters["split_handoffs"] += 1
        return sent

    # -- state ------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        c = self.scheduler.counters
        return {"ready": True, "jobs": len(self.jobs), "sequences": c.running + c.waiting,
                "kv_sequences": len(self.executor.runners[0]),
                "cache_supported": self.layout.unsupported is None, "handoff_lanes": list(self.lanes.taken()),
                "prefix_hits": self.executor.prefix.hits, "prefix_tokens": self.executor.prefix.reused_tokens,
                **self.counters}

    def close(self) -> None:
        super().close()
        self.scheduler.close()
        self.workers.shutdown(wait=False, cancel_futures=True)
        self.part_workers.shutdown(wait=False, cancel_futures=True)
        self.loop.close()
