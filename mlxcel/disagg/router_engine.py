"""The router: the OpenAI API's engine over prefill and decode nodes (docs/disagg.md §5-6).

Per request it picks a prefill node (prefix-aware by default: ``mlxcel.disagg.prefix_routes``) and a
decode node round-robin among the nodes the health monitor
(``PeerMonitor``: STATE probes every ``--probe-interval``, plus send errors) marks up (the pick and
retry decisions are ``mlxcel.disagg.policy.RoutePolicy``, over plain data), opens an
exchange (``ExchangeTable``: nonce, absolute deadline, the two nodes allowed to answer) and sends
GENERATE with ``decode_target`` to the prefill node. Results come back as one-way messages to this
node's listener; the demux delivers one only when its handshake-bound sender is a configured peer
(else the rate-limited router-drop warning) and the node the exchange was assigned to.

Failures: no node of a role up -> the new request is held (``mlxcel.disagg.waiting``, docs/disagg.md §6.2)
until one is, at most ``--resume-timeout``, then 503 + Retry-After (at once with resuming off or the hold
bound, ``--max-queue``, reached; never 429). A node
that goes down, refuses, or does not answer within ``--handoff-timeout`` fails the attempt: a request
that has not emitted a token yet is dispatched again to other nodes (at most ``MAX_DISPATCH_ATTEMPTS``
attempts; a down node is not picked again until a probe sees it back). One that has emitted tokens (or
that failover cannot place) is **resumed** (docs/disagg.md §6.1): a new attempt whose prompt is the
request's prompt plus the tokens streamed, with ``max_tokens`` less those, the request's seed (resolved
here when it named none) and ``draws`` = the tokens streamed, so the nodes' samplers go on where they
stopped; its text is assembled here from then on (the request's stop strings apply here), so the
client sees one unbroken stream. A resume waits up to ``--resume-timeout`` for a node of each role to
be up; at most ``--max-resumes`` per request, then a retryable error (503 + Retry-After). A cancelled
request (client gone) sends CANCEL to both of its nodes; a node's own CANCELLED for a request whose client is
still here is that node's failure (failed over, resumed, else 500), never the client's 499.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from mlxcel.cluster.exchanges import Exchange, ExchangeTable
from mlxcel.cluster.health import Answered, PeerMonitor
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.cluster.messages import Message
from mlxcel.cluster.ratelimit import WarnClass
from mlxcel.cluster.wire import Kind
from mlxcel.disagg import messages as m
from mlxcel.disagg.flags import NodeConfig
from mlxcel.disagg.holding import HeldRequests
from mlxcel.disagg.late_handoffs import Late, LateHandoffs
from mlxcel.disagg.routed import ATTEMPT_OUT, NodeInfo, Routed, RouteState, finished_state
from mlxcel.disagg.policy import GiveUp, NoneUp, Route, RoutePolicy, depends_on, node_failure
from mlxcel.disagg.prefix_routes import PrefixRoutes
from mlxcel.disagg.prefix_routing import PrefixIndex
from mlxcel.disagg.service import role_transport
from mlxcel.disagg.waiting import NodeWaits
from mlxcel.disagg.wire import PROBE_TIMEOUT_S, MsgType
from mlxcel.engine.interface import EngineRequest, EngineUnavailable, EventStream, FinishEvent, TokenEvent
from mlxcel.engine.resume import replayable
from mlxcel.engine.resume_policy import ResumePolicy
from mlxcel.error_codes import CodedError, ErrorClass, ErrorCode, code_of
from mlxcel.cluster.outbox import Outbox

log = logging.getLogger("mlxcel.disagg.router")

STARTUP_PROBE_WAIT_S = 3.0  # start() waits this long at most for every node's first probe answer


class RouterEngine(NodeWaits, PrefixRoutes):
    """The ``Engine`` of a router process (``mlxcel.engine.interface``)."""

    def __init__(self, cfg: NodeConfig, tokenizer: Any, *, secret: ClusterSecret, context_length: int, identity: str,
                 vocab_size: int | None = None):
        self.cfg = cfg
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # every token id a decode node streams is below it (None: unchecked)
        self._context_length = context_length
        self.identity = identity
        self.transport = role_transport(cfg, secret)
        self.nodes: dict[PeerId, NodeInfo] = {}
        for role, peers in (("prefill", cfg.prefill_peers), ("decode", cfg.decode_peers)):
            for i, peer in enumerate(peers):
                if peer in self.nodes:
                    raise ValueError(f"{peer} is listed as both a prefill and a decode node")
                self.nodes[peer] = NodeInfo(f"{role}-{i}", role, peer)
        self._peers = {"prefill": list(cfg.prefill_peers), "decode": list(cfg.decode_peers)}
        prefix = PrefixIndex(cfg.route_index_blocks) if cfg.route_policy == "prefix" else None
        self.policy: RoutePolicy[PeerId] = RoutePolicy(cfg.prefill_peers, cfg.decode_peers, prefix=prefix)
        self._lock = threading.RLock()
        self._probed: set[PeerId] = set()
        self._probed_all = threading.Event()
        self.monitor = PeerMonitor(list(self.nodes), interval_s=cfg.probe_interval_s, probe=self._probe,
                                   check=self._check, on_up=self._on_up, on_down=self._on_down,
                                   on_restart=self._on_restart)
        self.exchanges = ExchangeTable(self._expired, on_tick=self.monitor.beat, name="mlxcel-router-timer")
        self.outbox = Outbox(self.transport)
        self._probes = ThreadPoolExecutor(max_workers=max(1, len(self.nodes)), thread_name_prefix="mlxcel-router-probe")
        self._by_rid: dict[str, Routed] = {}
        self._late_handoffs = LateHandoffs()  # ended attempts whose HANDED_OFF may still come
        # the bounds of resuming and holding, the scheduler's (mlxcel.engine.resume_policy)
        self.resume_policy = ResumePolicy(cfg.max_resumes, cfg.resume_timeout_s)
        # new requests waiting for a node of each role (docs/disagg.md §6.2); with resuming off, 503 at once
        self.held: HeldRequests[str, Routed] = HeldRequests(cfg.resume_timeout_s, cfg.hold_limit,
                                                            enabled=self.resume_policy.enabled)
        self._hold_timer: threading.Timer | None = None
        self.counters: dict[str, float] = {
            "requests": 0, "completed": 0, "failed": 0, "cancelled": 0, "failovers": 0, "unavailable": 0,
            "dropped_frames": 0, "handoffs": 0, "handoff_bytes": 0, "handoff_seconds": 0.0,
            "handoff_bytes_last": 0, "handoff_seconds_last": 0.0, "handoff_seconds_max": 0.0, "prefill_seconds": 0.0,
            "resumed": 0, "resume_failed": 0, "early_first": 0}
        self._init_prefix()

    # -- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> "RouterEngine":
        self.transport.serve(on_message=self._demux)
        self.exchanges.start()
        self.monitor.beat()
        self._probed_all.wait(STARTUP_PROBE_WAIT_S)
        up = [i.id for p, i in self.nodes.items() if self.monitor.is_up(p)]
        log.info("router on %s: %d prefill and %d decode nodes; up: %s", self.transport.identity,
                 len(self._peers["prefill"]), len(self._peers["decode"]), ", ".join(up) or "none yet")
        return self

    def close(self) -> None:
        self.exchanges.close(lambda ex: EngineUnavailable("the router is shutting down"))
        with self._lock:
            for routed in self.held.take_all():
                self._fail(routed, ErrorCode.UNAVAILABLE, "the router is shutting down; retry later")
        self._probes.shutdown(wait=False, cancel_futures=True)
        self.outbox.close()
        self.transport.close()

    # -- the Engine interface -----------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def context_length(self) -> int:
        return self._context_length

    def submit(self, request: EngineRequest) -> EventStream:
        """Pick the nodes and dispatch; ``EngineUnavailable`` (503 + Retry-After) when no node can take it."""
        key = self._key_of(request.prompt)  # hashed outside the lock
        with self._lock:
            self.counters["requests"] += 1
            routed = Routed(request, EventStream(request, self._cancel),
                            params=replayable(request.params, self.resume_policy), key=key)
            route = self._pick(routed, self._usable) if not len(self.held) else None  # None: behind the held ones
            if isinstance(route, Route):
                self._by_rid[request.request_id] = routed
                self._dispatch(routed, route.prefill, route.decode)
            elif self.held.can_hold():
                self._hold(routed, route)
            elif route is not None:
                raise self._unavailable(route, held=len(self.held))
            else:
                self.counters["unavailable"] += 1
                raise EngineUnavailable(f"{len(self.held)} requests are held already, waiting for a prefill and a "
                                        "decode node to be up (the router's --max-queue); retry later")
        return routed.stream

    def stats(self) -> dict[str, float]:
        up = {role: sum(1 for p in peers if self.monitor.is_up(p)) for role, peers in self._peers.items()}
        held = {"held": len(self.held), "holds": self.held.holds, "hold_failed": self.held.hold_failed}
        return {**{f"router_{k}": float(v) for k, v in self.counters.items()},
                **{k: float(v) for k, v in held.items()}, **{f"router_{k}": float(v) for k, v in held.items()},
                "resumed": float(self.counters["resumed"]), "resume_failed": float(self.counters["resume_failed"]),
                "router_prefill_up": float(up["prefill"]), "router_decode_up": float(up["decode"]),
                "router_in_flight": float(len(self._by_rid))}

    def health(self) -> dict[str, Any]:
        up = {role: [self.nodes[p].id for p in peers if self._usable(p)] for role, peers in self._peers.items()}
        ok = bool(up["prefill"]) and bool(up["decode"])
        return {"status": "ok" if ok else "degraded", "prefill_up": len(up["prefill"]), "decode_up": len(up["decode"])}

    def router_stats(self, verbose: bool = False) -> dict[str, Any]:
        """``GET /router/stats``: per-node health and dispatch counts, router metrics; addresses only if verbose."""
        with self._lock:
            in_flight: dict[PeerId, int] = {}
            for r in self._by_rid.values():
                for p in (r.prefill, r.decode):
                    if p is not None:
                        in_flight[p] = in_flight.get(p, 0) + 1
            nodes = []
            for peer, info in self.nodes.items():
                status = self.monitor.status[peer]
                shown = ("draining" if status.state.get("draining") else "up") if status.up else "down"
                entry: dict[str, Any] = {"id": info.id, "role": info.role, "status": shown,
                                         "dispatched": info.dispatched, "completed": info.completed,
                                         "failures": info.failures, "in_flight": in_flight.get(peer, 0)}
                if info.role == "prefill":
                    entry.update(self._prefix_blocks(peer))
                if verbose:
                    entry["address"] = str(peer)
                    if not status.up and info.down_reason:
                        entry["down_reason"] = info.down_reason
                nodes.append(entry)
        metrics = {k: v for k, v in self.stats().items() if k.startswith("router_")}  # /metrics has the rest
        body: dict[str, Any] = {"addresses_redacted": not verbose, "nodes": nodes, "metrics": metrics}
        if verbose:
            body["router"] = str(self.transport.identity)
        return body

    # -- dispatching ------------------------------------------------------------------------------------

    def _usable(self, peer: PeerId) -> bool:
        """Up and not draining (a draining node, ``mlxcel node drain``, finishes what it holds but gets nothing new)."""
        status = self.monitor.status[peer]
        return status.up and not status.state.get("draining")

    def _unavailable(self, none: NoneUp, held: int = 0) -> EngineUnavailable:
        """Count a request no node can take and say which nodes are down (and that the hold bound is reached)."""
        self.counters["unavailable"] += 1
        full = f"; {held} requests are held already (the router's --max-queue)" if held else ""
        return EngineUnavailable(self._none_up(none) + full)

    def _dispatch(self, routed: Routed, prefill: PeerId, decode: PeerId) -> None:
        """Open the exchange of a new attempt and send GENERATE (under the lock)."""
        routed.move(RouteState.PREFILLING)
        routed.attempts += 1
        routed.prefill, routed.decode = prefill, decode
        routed.early_first, routed.decode_spoke = None, False
        ex = self.exchanges.open(self.cfg.handoff_timeout_s, senders=(prefill, decode), context=routed,
                                 then=self._ended)
        routed.exchange = ex
        self.nodes[prefill].dispatched += 1
        self.nodes[decode].dispatched += 1
        gen = self._generate(routed, ex.nonce, decode)

        def failed(exc: BaseException) -> None:
            self.monitor.lost(prefill, f"sending to it failed: {exc}")
            self.exchanges.resolve(ex, error=CodedError(f"prefill node {self.nodes[prefill].id} is unreachable",
                                                        ErrorCode.UNREACHABLE))

        self.outbox.send(prefill, Kind.CONTROL, gen.encode(), failed)

    def _generate(self, routed: Routed, nonce: str, decode: PeerId) -> m.Generate:
        """The attempt's GENERATE: the request as is, or resumed after the tokens streamed so far (their
        text is assembled here, so the nodes get no stop strings and the prompt ends with those tokens)."""
        req, params, done = routed.request, routed.params or routed.request.params, len(routed.tokens)
        if not done:
            return m.Generate(nonce, req.prompt, params, req.top_logprobs, req.ignore_eos, decode)
        params = replace(params, max_tokens=req.params.max_tokens - done, stop=())
        return m.Generate(nonce, req.prompt + tuple(routed.tokens), params, req.top_logprobs, req.ignore_eos,
                          decode, draws=done)

    def _ended(self, ex: Exchange) -> None:
        """An attempt's exchange ended: finished, failed (fail over or fail the request), or superseded."""
        routed: Routed = ex.context
        with self._lock:
            if routed.exchange is not ex or routed.state not in ATTEMPT_OUT:
                return
            self._expect_late_handoff(routed, ex)
            if ex.error is None:
                self._finish(routed, ex.reply)
                return
            code, message = code_of(ex.error), str(ex.error)
            self._failed_prefix(routed)
            self._cancel_on_nodes(routed, ex.nonce)
            for peer in (routed.prefill, routed.decode):
                if peer is not None:
                    self.nodes[peer].failures += 1
            decision = self.policy.after_failure(code, attempts=routed.attempts, emitted=routed.emitted,
                                                 closing=self.exchanges.closing, is_up=self._usable)
            if isinstance(decision, Route):
                self._fail_over(routed, message, decision)
            elif self._may_resume(routed, code):
                self._resume(routed, code, message)
            elif isinstance(decision, NoneUp):
                self._fail(routed, decision.code, f"{message}; {self._unavailable(decision)}")
            else:
                assert isinstance(decision, GiveUp)
                self._fail(routed, decision.code, message)

    def _fail_over(self, routed: Routed, message: str, route: Route[PeerId]) -> None:
        self.counters["failovers"] += 1
        log.info("router: %s: %s; trying %s and %s", routed.request.request_id, message,
                 self.nodes[route.prefill].id, self.nodes[route.decode].id)
        self._dispatch(routed, route.prefill, route.decode)

    def _relay(self, routed: Routed, ex: Exchange, events: tuple[TokenEvent, ...]) -> None:
        """Pass an attempt's token events to the client (under the lock); after a resume with text made here,
        ending the request on a stop string."""
        for event in events:
            routed.tokens.append(event.token)
            if routed.text is None:
                routed.stream.push(event)
                continue
            routed.stream.push(TokenEvent(event.token, routed.text.feed(event.token), event.logprob,
                                          event.top_logprobs))
            if routed.text.stopped:
                self._cancel_on_nodes(routed, ex.nonce)
                self.exchanges.resolve(ex, reply=FinishEvent("stop"))
                return

    def _finish(self, routed: Routed, event: FinishEvent) -> None:
        if routed.text is not None and event.error is None:  # resumed: the tail and the counts are this side's
            event = FinishEvent(event.finish_reason, routed.text.finish(), len(routed.request.prompt),
                                len(routed.tokens))
        routed.move(finished_state(event))
        self._by_rid.pop(routed.request.request_id, None)
        if event.error is None:
            self._learn_prefix(routed)
            self.counters["completed"] += 1
            for peer in (routed.prefill, routed.decode):
                if peer is not None:
                    self.nodes[peer].completed += 1
        else:
            self.counters["failed"] += 1
        routed.stream.push(event)

    def _fail(self, routed: Routed, code: ErrorCode, message: str) -> None:
        log.warning("router: request %s failed: %s", routed.request.request_id, message)
        self._finish(routed, FinishEvent("error", prompt_tokens=len(routed.request.prompt),
                                         completion_tokens=routed.emitted, error=message, code=code))

    def _cancel(self, request_id: str) -> None:
        """The client went away: end the attempt and free the KV on both nodes."""
        with self._lock:
            routed = self._by_rid.pop(request_id, None)
            if routed is None or routed.state.finished:
                return
            ex = routed.exchange  # while resuming: the failed attempt's (CANCEL again to its nodes)
            if ex is not None and routed.state in ATTEMPT_OUT:
                self._expect_late_handoff(routed, ex)
            routed.move(RouteState.FINISHED_CANCELLED)
            self.counters["cancelled"] += 1
            self.held.drop(request_id)  # a held request frees its place in the bound
        if ex is not None:
            self.exchanges.resolve(ex, error=CodedError("cancelled", ErrorCode.CANCELLED))
            self._cancel_on_nodes(routed, ex.nonce)

    def _expect_late_handoff(self, routed: Routed, ex: Exchange) -> None:
        """The attempt ``ex`` ends (under the lock): if its prefill node has not handed off yet, its HANDED_OFF
        may still come (on another connection than the FINISH) and then counts, once (docs/disagg.md §7.1)."""
        if routed.state is RouteState.PREFILLING and routed.prefill is not None:
            self._late_handoffs.expect(ex.nonce, routed.prefill)

    def _cancel_on_nodes(self, routed: Routed, nonce: str) -> None:
        for peer in (routed.prefill, routed.decode):
            if peer is not None:
                self.outbox.send(peer, Kind.CONTROL, m.cancel(nonce), lambda exc: None)

    def _expired(self, ex: Exchange) -> BaseException:
        routed: Routed = ex.context
        waiting = "its first token" if routed.emitted == 0 else "its next token"
        node = self.nodes[routed.decode].id if routed.handed_off and routed.decode else (
            f"{self.nodes[routed.prefill].id} and {self.nodes[routed.decode].id}" if routed.prefill and routed.decode
            else "its nodes")
        return CodedError(f"no answer from {node} for {waiting} within {self.cfg.handoff_timeout_s:g}s "
                          "(--handoff-timeout)", ErrorCode.TIMEOUT)

    # -- results ----------------------------------------------------------------------------------------

    def _demux(self, msg: Message) -> None:
        """A result frame: only from a configured peer, only for a request assigned to it."""
        info = self.nodes.get(msg.peer)
        if info is None:
            self.counters["dropped_frames"] += 1
            self.transport.warnings.warning(
                WarnClass.ROUTER_DROP, "router: dropping result frame from %s: not one of the configured "
                "--prefill-peers or --decode-peers", msg.peer)
            return
        if msg.kind is not Kind.CONTROL:
            log.debug("router: dropping a %s message from %s", msg.kind.name, info.id)
            return
        try:
            kind, doc = m.decode(msg.payload)
            ex = self.exchanges.get(m.nonce_of(doc))
            if ex is None:
                self._after_end(kind, doc, msg.peer, info.id)
                return
            routed: Routed = ex.context
            allowed = {MsgType.TOKENS: (routed.decode, routed.prefill), MsgType.FINISH: (routed.decode,),
                       MsgType.HANDED_OFF: (routed.prefill,), MsgType.ERROR: (routed.prefill, routed.decode),
                       MsgType.PROGRESS: (routed.prefill, routed.decode)}
            if msg.peer not in allowed.get(kind, ()):
                self.counters["dropped_frames"] += 1
                self.transport.warnings.warning(
                    WarnClass.ROUTER_DROP, "router: dropping result frame from %s: a %s for a request it was not "
                    "assigned", msg.peer, kind.name)
                return
            self._result(kind, doc, ex, routed, sender=msg.peer)
        except m.MessageRefused as exc:
            self.counters["dropped_frames"] += 1
            self.transport.warnings.warning(WarnClass.ROUTER_DROP, "router: dropping result frame from %s: %s",
                                            msg.peer, exc)

    def _result(self, kind: MsgType, doc: dict[str, Any], ex: Exchange, routed: Routed, *, sender: PeerId) -> None:
        from_prefill = sender == routed.prefill
        if kind is MsgType.TOKENS:
            tokens = m.Tokens.parse(doc)
            if not self._in_vocab(tokens, ex, routed):
                return
            with self._lock:
                if routed.state not in ATTEMPT_OUT or routed.exchange is not ex:
                    return
                events = self._first_once(routed, tokens.events, from_prefill)
                ex.deadline = time.monotonic() + self.cfg.handoff_timeout_s  # an idle bound from now on
                if events:
                    routed.emitted += len(events)
                    self._relay(routed, ex, events)
        elif kind is MsgType.PROGRESS:
            with self._lock:
                if routed.state in ATTEMPT_OUT and routed.exchange is ex:
                    ex.deadline = time.monotonic() + self.cfg.handoff_timeout_s
        elif kind is MsgType.FINISH:
            event = m.Finish.parse(doc).event
            if event.code is not None and event.code.error_class is ErrorClass.CANCELLED:  # a node's, never ours
                self.exchanges.resolve(ex, error=node_failure(event.code, event.error or "", self.nodes[sender].id))
            else:
                self.exchanges.resolve(ex, reply=event)
        elif kind is MsgType.HANDED_OFF:
            done = m.HandedOff.parse(doc)
            with self._lock:
                live = routed.state in ATTEMPT_OUT and routed.exchange is ex
                if live and routed.state is RouteState.PREFILLING:
                    routed.move(RouteState.DECODING)
                    self._learn_prefix(routed)
            if live or self._late_handoffs.claim(ex.nonce, sender) is Late.COUNT:  # the attempt ended meanwhile
                self._count_handoff(done)
        elif kind is MsgType.ERROR:
            err = m.Error.parse(doc)
            if err.code is ErrorCode.UNREACHABLE and err.node is not None:
                self._reported_down(err.node, err.message)
            self.exchanges.resolve(ex, error=node_failure(err.code, err.message, self.nodes[sender].id))

    def _first_once(self, routed: Routed, events: tuple[TokenEvent, ...], from_prefill: bool) -> tuple[TokenEvent, ...]:
        """The events of a TOKENS message to relay (under the lock). The prefill node may send its attempt's first
        token early, one event before the decode node sent anything; the decode node's own first event is then
        that token again, and is dropped. Anything else from a prefill node is dropped and counted."""
        if from_prefill:
            if routed.early_first is not None or len(events) != 1:
                self.counters["dropped_frames"] += 1
                self.transport.warnings.warning(
                    WarnClass.ROUTER_DROP, "router: dropping result frame from %s: a TOKENS from a prefill node "
                    "that is not its attempt's first token alone", routed.prefill)
                return ()
            routed.early_first = events[0].token
            self.counters["early_first"] += 1
            if routed.decode_spoke:  # the decode node's first event came first (other connection): relayed already
                log.debug("router: the early first token of %s came after the decode node's", routed.request.request_id)
                return ()
            return events
        spoke, routed.decode_spoke = routed.decode_spoke, True
        if spoke or routed.early_first is None:
            return events
        if events[0].token != routed.early_first:  # the two nodes disagree: this attempt fails and is resumed
            self.exchanges.resolve(routed.exchange, error=CodedError(
                f"decode node {self.nodes[routed.decode].id} streamed token {events[0].token} first, after its "
                f"prefill node's {routed.early_first}", ErrorCode.INTERNAL))
            return ()
        return events[1:]

    def _after_end(self, kind: MsgType, doc: dict[str, Any], peer: PeerId, node_id: str) -> None:
        """A frame for an ended attempt: dropped, but a HANDED_OFF from that attempt's prefill node that came
        after the decode node's FINISH (the two travel on different connections) still counts its handoff, once;
        one from any other node is a protocol violation (dropped, counted, logged) that changes nothing."""
        if kind is not MsgType.HANDED_OFF:
            log.debug("router: %s from %s for an ended request", kind.name, node_id)
            return
        done = m.HandedOff.parse(doc)
        late = self._late_handoffs.claim(done.nonce, peer)
        if late is Late.COUNT:
            self._count_handoff(done)
        elif late is Late.FORGED:
            self.counters["dropped_frames"] += 1
            self.transport.warnings.warning(
                WarnClass.ROUTER_DROP, "router: dropping result frame from %s: a HANDED_OFF for a request it was "
                "not assigned", peer)
        else:
            log.debug("router: HANDED_OFF from %s for an ended request", node_id)

    def _count_handoff(self, done: m.HandedOff) -> None:
        with self._lock:
            c = self.counters
            c["handoffs"] += 1
            c["handoff_bytes"] += done.nbytes
            c["handoff_seconds"] += done.seconds
            c["prefill_seconds"] += done.prefill_seconds
            c["handoff_bytes_last"], c["handoff_seconds_last"] = done.nbytes, done.seconds
            c["handoff_seconds_max"] = max(c["handoff_seconds_max"], done.seconds)

    def _in_vocab(self, tokens: m.Tokens, ex: Exchange, routed: Routed) -> bool:
        """Whether every id of a TOKENS message (sampled and top-logprob) is a token of the model; if not, the
        attempt fails (and is resumed like any failed attempt): its decode node streams what no model samples,
        and relaying the rest would leave a hole in the text."""
        ids = [i for e in tokens.events for i in (e.token, *(t for t, _ in e.top_logprobs))]
        try:
            m.in_vocab(ids, self.vocab_size, "events")
        except m.MessageRefused as exc:
            self.counters["dropped_frames"] += 1
            self.transport.warnings.warning(WarnClass.ROUTER_DROP, "router: dropping result frame from %s: %s",
                                            routed.decode, exc)
            self.exchanges.resolve(ex, error=CodedError(f"decode node {self.nodes[routed.decode].id} streamed {exc}",
                                                        ErrorCode.INTERNAL))
            return False
        return True

    def _reported_down(self, node: str, why: str) -> None:
        """A prefill node could not reach a decode node: that one is down until a probe sees it again."""
        try:
            peer = PeerId.parse(node)
        except ValueError:
            return
        if peer in self.nodes:
            self.monitor.lost(peer, why)

    # -- health -----------------------------------------------------------------------------------------

    def _probe(self, peer: PeerId, answered: Answered) -> None:
        def run() -> None:
            try:
                reply = self.transport.request(peer, m.encode(MsgType.STATE, {}), timeout=PROBE_TIMEOUT_S)
                kind, doc = m.decode(reply)
                answered(doc)
            except Exception as exc:  # noqa: BLE001 - any failure is "down"
                why = f"{type(exc).__name__}: {exc}"
                answered(None, why)
                self._still_down(peer, why)
            finally:
                self._probed.add(peer)
                if len(self._probed) == len(self.nodes):
                    self._probed_all.set()

        try:
            self._probes.submit(run)
        except RuntimeError:  # shutting down
            answered(None, "the router is shutting down")

    def _check(self, peer: PeerId, state: dict[str, Any]) -> None:
        info = self.nodes[peer]
        why = None
        if state.get("role") != info.role:
            why = f"it answers as a {state.get('role')!r} node, configured as {info.role}"
        elif state.get("model") != self.identity:
            why = "it serves another model than this router"
        elif state.get("ready") is not True:
            why = "it is not ready"
        if why is not None:
            self._still_down(peer, f"it answers as a different node or model ({why})")
            raise ValueError(why)

    def _still_down(self, peer: PeerId, why: str) -> None:
        """A probe of a node that is not up failed (the monitor reports only outages of up nodes, so a node
        that was never up would go unexplained): keep why for /router/stats, log each new reason once."""
        if self.monitor.is_up(peer):
            return
        info = self.nodes[peer]
        if info.down_reason != why:
            info.down_reason = why
            log.warning("router: %s (%s node) is down: %s", info.id, info.role, why)
        self.transport.drop(peer)  # the next probe dials afresh instead of waiting on a stalled connection

    def _on_up(self, peer: PeerId, returned: bool) -> None:
        info = self.nodes[peer]
        if returned or info.down_reason:
            log.warning("router: %s (%s) is up again", info.id, info.role)
        info.down_reason = ""
        if len(self.held):  # held requests go on at once, not at the next tick
            self._place_held()

    def _on_down(self, peer: PeerId, why: str) -> None:
        info = self.nodes[peer]
        info.down_reason = why
        log.warning("router: %s (%s node) is down: %s", info.id, info.role, why)
        with self._lock:
            self._forget_prefix(peer)
        self._fail_assigned(peer, f"{info.role} node {info.id} went down")

    def _on_restart(self, peer: PeerId) -> None:
        info = self.nodes[peer]
        log.warning("router: %s restarted; its requests in flight are lost", info.id)
        with self._lock:
            self._forget_prefix(peer)
        self._fail_assigned(peer, f"{info.role} node {info.id} restarted")

    def _fail_assigned(self, peer: PeerId, why: str) -> None:
        """Fail the attempts that depend on ``peer``: its decodes, and its prefills not handed off yet."""
        with self._lock:
            hit = [r for r in self._by_rid.values() if r.state in ATTEMPT_OUT
                   and depends_on(peer, prefill=r.prefill, decode=r.decode, handed_off=r.handed_off)]
        for routed in hit:
            if routed.exchange is not None:
                self.exchanges.resolve(routed.exchange, error=CodedError(why, ErrorCode.UNREACHABLE))
