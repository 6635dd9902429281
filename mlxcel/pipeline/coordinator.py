"""The coordinator's side of the pipeline: an ``Executor`` whose steps run on remote stages.

A decode step is one exchange of 3 frames: RUN_ENTRY (coordinator -> first stage, token ids),
ACTIVATION (stage -> stage, hidden states, carrying the exchange nonce) and RUN_RESULT (last
stage -> coordinator, the sampled token ids). Up to one step per stage is in flight, so with two
micro-batches both stages work at once.

What the coordinator accepts (docs/pipeline.md §4): ACK, STATE and ERROR for a command only from
the stage it addressed; a RUN_RESULT only from the last stage, only with the fresh nonce of an
open exchange, only for that exchange's request ids and micro-batch, and only with one token per
row (or logits of shape [rows, vocab]); ERROR for an exchange from any stage of the pipeline.
Everything else is dropped with a warning while the exchange keeps waiting for its absolute
deadline. A stage that stops answering heartbeats marks the cluster degraded and fails every open
exchange at once; it is used again as soon as it answers.

Resuming (docs/pipeline.md §5.6): a step that failed because a stage died, froze or restarted is
``resumable``; the scheduler then prepares the sequence again (``check_peers`` first, so a restart is
seen before the sequence is placed on the new process) with its prompt plus the tokens streamed, and
PREPARE's ``draws`` starts the last stage's sampler after the tokens already sampled.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

import mlx.core as mx

from mlxcel.cluster.attribution import AttributionOnly, transport_options
from mlxcel.cluster.errors import ClusterError, HandshakeError
from mlxcel.cluster.exchanges import Exchange, ExchangeTable, new_nonce
from mlxcel.cluster.health import PeerMonitor
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.messages import Message
from mlxcel.cluster.ratelimit import WarnClass, cluster_warnings
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.cluster.transport import Transport
from mlxcel.cluster.wire import FRAME_OVERHEAD, Kind
from mlxcel.config import MAX_PREFIX_TOKENS, MAX_TOKENS_LIMIT
from mlxcel.engine.batch_rows import OneRow
from mlxcel.engine.executor import Done, ExecutorBase, ExecutorError, Step
from mlxcel.engine.resume_policy import ResumePolicy
from mlxcel.engine.logits import replayed
from mlxcel.engine.runner import RowSampler, Sampled, sample_rows
from mlxcel.engine.sampling import SamplingParams
from mlxcel.error_codes import ErrorCode
from mlxcel.models.token_ids import check_token_ids
from mlxcel.topology.cluster_config import ClusterConfig, Node
from mlxcel.cluster.outbox import Outbox, fast_handoffs
from mlxcel.pipeline.params import count_from_wire, params_to_wire
from mlxcel.pipeline.protocol import (
    MsgType,
    ProtocolError,
    StageMessage,
    check_state,
    decode,
    encode,
)
from mlxcel.models.facts import ModelFacts
from mlxcel.pipeline.tensors import ids_to_wire
from mlxcel.strict_json import is_int, is_number

if TYPE_CHECKING:
    from mlxcel.pipeline.takeover import StageReplacer

log = logging.getLogger("mlxcel.pipeline.coordinator")
COMMAND_TIMEOUT_S = 10.0
_PREPARE = "prepare"  # the context of a PREPARE's exchange: failed at once when its stage goes down


class PipelineExecutor(ExecutorBase):
    """Drives the stages of a cluster; an ``mlxcel.engine.executor.ExecutorBase``.

    Start-up, the Executor interface and reply validation live here; the open exchanges
    (``ExchangeTable``) and stage health (``PeerMonitor``) are the cluster layer's shared pieces.
    """

    def __init__(self, cluster: ClusterConfig, secret: ClusterSecret, model: ModelFacts, *,
                 max_batch_size: int, micro_batch_size: int | None = None, return_logits: bool = False,
                 stop_stages_on_close: bool = False, replacer: StageReplacer | None = None,
                 one_row: OneRow | None = None, _attribution: AttributionOnly | None = None):
        self.cluster = cluster
        self.model = model
        self.depth = len(cluster.stages)
        self.one_row = one_row  # the model's caches cannot merge (executor.cap_rows): one row per micro-batch
        self.micro_batch_size = 1 if one_row else min(micro_batch_size or cluster.micro_batch(max_batch_size), cluster.max_batch_size)
        self.fill_micro_batches = fill_micro_batches(cluster)
        self.return_logits = return_logits
        self.resume_policy = ResumePolicy(cluster.max_resumes, cluster.timeouts.resume_s)
        self.stop_stages_on_close = stop_stages_on_close  # SHUTDOWN every stage when this coordinator stops
        self._started = False
        self.exchange_s = cluster.timeouts.exchange_s
        self.first = cluster.stages[0].address
        self.last = cluster.stages[-1].address
        self.stage_addrs = frozenset(n.address for n in cluster.stages)
        self._nodes = {n.address: n for n in cluster.stages}
        # _attribution: bench code's unsealed frames (mlxcel/cluster/attribution.py); roles never pass it
        self.transport = Transport(cluster.coordinator.address, secret,
                                   transport_options(_attribution, who="the pipeline coordinator",
                                                     base=cluster.transport_options()))
        self.outbox = Outbox(self.transport)
        self.exchanges = ExchangeTable(self._expired, on_tick=self._on_tick, name="mlxcel-coordinator-timer")
        self.monitor = PeerMonitor(self._nodes, interval_s=cluster.timeouts.heartbeat_s, probe=self._probe,
                                   check=self._check_state, on_up=self._stage_up, on_down=self._stage_down,
                                   on_restart=self._stage_restarted)
        self.replacer = replacer
        self._takeover = None
        if replacer is not None:
            from mlxcel.pipeline.takeover import Takeover

            self._takeover = Takeover(self, replacer)
        self._lock = threading.Lock()
        self._samplers: dict[str, RowSampler] = {}
        self._prepared: set[str] = set()  # request ids prepared on every stage
        self._lost: set[str] = set()  # prepared before a stage restarted: their state is gone
        self._wire: dict[str, str] = {}  # request id -> its id on the wire (another one after a resume)
        self.prefix_on = cluster.prefix_cache_mb > 0  # the stages keep prefix caches: send prompts and tokens
        self.prefix_hits = 0  # sequences that every stage started from a cached prefix
        self.prefix_tokens = 0  # prompt tokens those sequences did not prefill
        self.received_frames = 0
        self.received_bytes = 0

    # -- start-up -----------------------------------------------------------------------------------

    def start(self, timeout: float | None = None) -> None:
        """Listen, then wait until every stage answers with the same model; raises ExecutorError."""
        fast_handoffs()
        self.transport.serve(self._on_message)
        deadline = time.monotonic() + (timeout or self.cluster.timeouts.startup_s)
        for node in self.cluster.stages:
            self._await_stage(node, deadline)
        self.exchanges.start()
        self._started = True
        log.info("pipeline ready: %s", ", ".join(f"{self._nodes[p].id} {_layers(s.state)} at {p}"
                                                  for p, s in self.monitor.status.items()))

    def _await_stage(self, node: Node, deadline: float) -> None:
        last: BaseException | None = None
        while time.monotonic() < deadline:
            try:
                self.transport.connect(node.address)
                state = self.command(node.address, MsgType.GET_STATE, {}, timeout=min(COMMAND_TIMEOUT_S, self.exchange_s))
                problems = self._stage_problems(node, state.header)
                if problems:
                    raise ExecutorError(f"stage {node.id} at {node.address}: " + "; ".join(problems), ErrorCode.MISMATCH)
                self.monitor.observe(node.address, state.header)
                return
            except HandshakeError as exc:  # wrong secret, identity: retrying cannot help
                raise ExecutorError(f"cannot join stage {node.id} at {node.address}: {exc}",
                                    ErrorCode.UNAUTHORIZED) from None
            except ExecutorError as exc:
                if exc.code is ErrorCode.MISMATCH:
                    raise
                last = exc
            except ClusterError as exc:
                last = exc
            time.sleep(0.5)
        raise ExecutorError(f"stage {node.id} at {node.address} did not answer within "
                            f"{self.cluster.timeouts.startup_s:g}s: {last}", ErrorCode.UNREACHABLE)

    def _stage_problems(self, node: Node, state: dict[str, Any]) -> list[str]:
        """What makes a STATE not the stage the cluster TOML names (empty: it is)."""
        try:
            check_state(state)
        except ValueError as exc:
            return [str(exc)]
        index = self.cluster.stage_index(node.id)
        problems = []
        if state.get("node_id") != node.id or state.get("stage") != index:
            problems.append(f"it is {state.get('node_id')!r} (stage {state.get('stage')})")
        if state.get("cluster") != self.cluster.name:
            problems.append(f"its cluster name is {state.get('cluster')!r}, not {self.cluster.name!r}")
        if state.get("model_identity") != self.model.identity:
            problems.append("it holds a different model (identity mismatch: compare `mlxcel models info` on both hosts)")
        if node.layers is not None and tuple(state["layers"]) != node.layers:
            problems.append(f"it serves layers {state.get('layers')}, the cluster TOML says {list(node.layers)}")
        return problems

    # -- the Executor interface (scheduler thread) ----------------------------------------------------

    def prepare(self, rid: str, params: SamplingParams, top_logprobs: int, prompt: Sequence[int], *,
                draws: int = 0, attempt: int = 0) -> int:
        down = [self._nodes[p].id for p in self.monitor.down()]
        if down:
            raise ExecutorError(f"pipeline stage {', '.join(down)} is unreachable; retry shortly", ErrorCode.UNREACHABLE)
        # a resumed sequence goes on the wire under a fresh id: a frozen stage that thaws still forwards
        # the steps it held of the old one, and those must not touch the new sequence (they fail not_found)
        wire = rid if attempt == 0 else f"{rid}#{attempt}"
        with self._lock:
            self._wire[rid] = wire
        header: dict[str, Any] = {"request_id": wire, "params": params_to_wire(params, top_logprobs, prompt, draws),
                                  "return": "logits" if self.return_logits else "token"}
        if self.prefix_on and len(prompt) > 1:
            header["prompt"] = list(prompt[:MAX_PREFIX_TOKENS])
        if draws:  # a resumed sequence: the last stage's sampler goes on after the tokens already sampled
            header["draws"] = min(draws, MAX_TOKENS_LIMIT)
        try:
            cached = self._agree(header, self._prepare_on(self.cluster.stages, header))
        except BaseException:
            self.release(rid)  # a stage that acknowledged frees what it allocated; the others ignore the id
            raise
        with self._lock:
            self._prepared.add(rid)
            self._lost.discard(rid)
        if self.return_logits:
            self._samplers[rid] = RowSampler(params, top_logprobs, context=prompt,
                                             replay=replayed(params, prompt, draws))
            self._samplers[rid].skip(draws)
        if cached:
            self.prefix_hits += 1
            self.prefix_tokens += cached
        return cached

    def _prepare_on(self, nodes: Sequence[Node], header: dict[str, Any]) -> dict[PeerId, int]:
        """PREPARE on ``nodes`` at once; per stage, the ``cached`` of its ACK (absent: 0, no cache there)."""
        most = min(max(len(header.get("prompt", ())) - 1, 0), header.get("max_cached", MAX_PREFIX_TOKENS))
        waits = [(n, self._command_async(n.address, MsgType.PREPARE, header, context=_PREPARE)) for n in nodes]
        held: dict[PeerId, int] = {}
        for node, ex in waits:
            ack = self._wait(ex, node.address, COMMAND_TIMEOUT_S)
            try:
                held[node.address] = count_from_wire(ack.header.get("cached", 0), "cached", most)
            except ValueError as exc:
                raise ExecutorError(f"stage {node.id} answered PREPARE with a bad count: {exc}", ErrorCode.INTERNAL) from None
        return held

    def _agree(self, header: dict[str, Any], held: dict[PeerId, int]) -> int:
        """The prefix length every stage starts from: stages that hold more than the shortest are prepared
        again, capped by ``max_cached``, until all hold the same (each round lowers it; 0 always agrees)."""
        while True:
            low = min(held.values())
            over = [self._nodes[addr] for addr, n in held.items() if n != low]
            if not over:
                return low
            held.update(self._prepare_on(over, {**header, "max_cached": low}))

    def submit(self, step: Step, done: Done) -> None:
        with self._lock:
            lost = any(r in self._lost for r in step.rids)
        if lost:
            done(step, ExecutorError("a pipeline stage restarted and lost this request's state", ErrorCode.UNREACHABLE))
            return
        # a step may be answered by the last stage (RUN_RESULT) or fail at any stage (ERROR)
        ex = self.exchanges.open(self.exchange_s, senders=self.stage_addrs, context=step,
                                 then=lambda e: done(step, e.error if e.error is not None else e.reply))
        header = {"nonce": ex.nonce, "phase": step.kind, "micro_batch": max(step.slot, 0),
                  "request_ids": self._wire_ids(step.rids), "sample": step.sample}
        payload = encode(MsgType.RUN_ENTRY, header, {"input_ids": ids_to_wire(step.tokens)})
        self.outbox.send(self.first, Kind.TENSOR_DATA, payload, self._undeliverable(ex.nonce, "the first stage"),
                         wanted=lambda: self.exchanges.is_open(ex.nonce))

    def resumable(self, exc: BaseException) -> bool:
        """Whether a failed step lost its sequences to a stage failure (resume them) rather than failed on
        them: a stage unreachable, silent, restarted or unavailable, or a stage that no longer knows the
        sequence (a restarted process answers ``not_found`` before the monitor saw its new boot id)."""
        if not isinstance(exc, ExecutorError):
            return False
        return exc.code.retryable or exc.peer_code is ErrorCode.NOT_FOUND

    def check_peers(self) -> None:
        """GET_STATE on every stage now, through the monitor (a new boot id is a restart: what it held is
        lost); raises ExecutorError (unreachable) if one does not answer within two heartbeats."""
        down = [self._nodes[p].id for p in self.monitor.down()]
        if down:  # known down: no round trip (a dead stage's delivery would take the dial budget)
            raise ExecutorError(f"pipeline stage {', '.join(down)} is unreachable", ErrorCode.UNREACHABLE)
        timeout = max(2 * self.monitor.interval_s, 1.0)
        waits = [(n, self._command_async(n.address, MsgType.GET_STATE, {}, timeout=timeout)) for n in self.cluster.stages]
        for node, ex in waits:
            try:
                state = self._wait(ex, node.address, timeout)
            except ExecutorError as exc:
                raise ExecutorError(f"pipeline stage {node.id} does not answer: {exc}", ErrorCode.UNREACHABLE) from None
            if not self.monitor.observe(node.address, state.header):
                raise ExecutorError(f"pipeline stage {node.id} answers as another stage", ErrorCode.UNREACHABLE)

    def release(self, rid: str, tokens: Sequence[int] | None = None) -> None:
        """RELEASE on every stage; stages do not answer it, so no exchange stays open for it."""
        wire = self._forget(rid)
        header: dict[str, Any] = {"request_id": wire, "nonce": new_nonce()}
        if tokens is not None and self.prefix_on:  # each stage keeps its slice's KV under these tokens
            header["tokens"] = list(tokens[:MAX_PREFIX_TOKENS])
        payload = encode(MsgType.RELEASE, header)
        for node in self.cluster.stages:
            self.outbox.send(node.address, Kind.CONTROL, payload)

    def cancel(self, rid: str) -> None:
        """CANCEL on every stage (a request whose client gave up): like RELEASE, but each stage ACKs it,
        and a stage that does not is logged; nothing waits for the answers."""
        wire = self._forget(rid)
        for node in self.cluster.stages:
            def answered(ex: Exchange, node: Node = node) -> None:
                if ex.error is not None and not self.exchanges.closing:
                    log.warning("stage %s did not confirm CANCEL of %s: %s", node.id, rid, ex.error)
            self._command_async(node.address, MsgType.CANCEL, {"request_id": wire}, then=answered)

    def _forget(self, rid: str) -> str:
        """This coordinator's own state of a sequence that ends (released or cancelled); its id on the wire."""
        self._samplers.pop(rid, None)
        with self._lock:
            self._prepared.discard(rid)
            self._lost.discard(rid)
            return self._wire.pop(rid, rid)

    def _wire_ids(self, rids: Sequence[str]) -> list[str]:
        """The ids the stages know these sequences by (a resumed one's carries its attempt: ``req-7#1``)."""
        with self._lock:
            return [self._wire.get(r, r) for r in rids]

    def stop_stages(self, timeout: float = COMMAND_TIMEOUT_S) -> list[str]:
        """SHUTDOWN every stage (the operator asked the coordinator to stop the cluster); returns the ids of
        the stages that confirmed. Each stage exits 0 after its ACK."""
        waits = [(n, self._command_async(n.address, MsgType.SHUTDOWN, {}, timeout=timeout)) for n in self.cluster.stages]
        stopped = []
        for node, ex in waits:
            try:
                self._wait(ex, node.address, timeout)
                stopped.append(node.id)
            except ExecutorError as exc:
                log.warning("stage %s did not confirm SHUTDOWN: %s", node.id, exc)
        log.info("stopped pipeline stages: %s", ", ".join(stopped) or "none")
        return stopped

    def stats(self) -> dict[str, float]:
        frames = self.outbox.frames + self.received_frames
        nbytes = self.outbox.bytes + self.received_bytes
        for peer, s in self.monitor.status.items():
            if peer != self.last:
                frames += int(s.state.get("sent_frames", 0))
                nbytes += int(s.state.get("sent_bytes", 0))
        return {"stages_down": float(len(self.monitor.down())), "wire_frames": float(frames), "wire_bytes": float(nbytes),
                "prefix_hits": float(self.prefix_hits), "prefix_tokens": float(self.prefix_tokens),
                "prefix_bytes": self._stages_total("prefix_bytes"), "stage_overlapped": self._stages_total("overlapped")}

    def _stages_total(self, field: str) -> float:
        """An integer STATE field summed over the stages' last STATEs (0 where a stage leaves it out)."""
        return float(sum(int(s.state.get(field, 0)) for s in self.monitor.status.values()))

    def health(self) -> dict[str, Any]:
        nodes = self._nodes
        stages = [{"id": nodes[p].id, "address": str(p), "up": s.up, "layers": s.state.get("layers")}
                  for p, s in self.monitor.status.items() if p in nodes]
        body: dict[str, Any] = {"status": "ok" if all(s["up"] for s in stages) else "degraded", "stages": stages}
        body.update({"batching": self.one_row.batching} if self.one_row is not None else {})
        if self.replacer is not None:
            body["spares"] = self.replacer.status()
            body["reassigned"] = dict(self.replacer.reassigned)
        return body

    def close(self) -> None:
        if self.stop_stages_on_close and self._started:
            self.stop_stages()
        self.exchanges.close(lambda ex: ExecutorError("the coordinator is shutting down", ErrorCode.UNAVAILABLE))
        self.outbox.close()
        self.transport.close()

    # -- commands ---------------------------------------------------------------------------------------

    def command(self, stage: PeerId, mtype: MsgType, header: dict, timeout: float = COMMAND_TIMEOUT_S) -> StageMessage:
        """Send a command to one stage and wait for its ACK or STATE; raises ExecutorError on ERROR/timeout."""
        return self._wait(self._command_async(stage, mtype, header), stage, timeout)

    def _command_async(self, stage: PeerId, mtype: MsgType, header: dict, *,
                       then: Callable[[Exchange], None] | None = None,
                       timeout: float = COMMAND_TIMEOUT_S, context: Any = None) -> Exchange:
        ex = self.exchanges.open(timeout, senders=(stage,), then=then, context=context)
        self.outbox.send(stage, Kind.CONTROL, encode(mtype, {**header, "nonce": ex.nonce}),
                         self._undeliverable(ex.nonce, f"stage {stage}"),
                         wanted=lambda: self.exchanges.is_open(ex.nonce))
        return ex

    def _undeliverable(self, nonce: str, what: str) -> Callable[[BaseException], None]:
        return lambda exc: self.exchanges.fail(nonce, ExecutorError(f"cannot reach {what}: {exc}", ErrorCode.UNREACHABLE))

    def _wait(self, ex: Exchange, stage: PeerId, timeout: float) -> StageMessage:
        if not self.exchanges.wait(ex, timeout):
            raise ExecutorError(f"stage {stage} did not answer within {timeout:g}s", ErrorCode.TIMEOUT)
        if ex.error is not None:
            raise ex.error if isinstance(ex.error, ExecutorError) else ExecutorError(str(ex.error))
        assert isinstance(ex.reply, StageMessage)
        return ex.reply

    # -- replies (transport reader threads) --------------------------------------------------------------

    def _on_message(self, msg: Message) -> None:
        self.received_frames += 1
        self.received_bytes += len(msg.payload) + FRAME_OVERHEAD
        try:
            m = decode(msg.payload)
        except ProtocolError as exc:
            self._drop(msg.peer, f"a malformed message ({exc})")
            return
        ex = self.exchanges.get(m.nonce)
        if ex is None:
            self._drop(msg.peer, f"{m.type.name} for no open exchange")
        elif not ex.accepts(msg.peer):
            self._drop(msg.peer, f"{m.type.name} from a node this exchange does not involve")
        elif m.type is MsgType.ERROR:
            self.exchanges.resolve(ex, error=_stage_error(msg.peer, m))
        elif isinstance(ex.context, Step):
            self._on_result(msg.peer, m, ex)
        elif m.type in (MsgType.ACK, MsgType.STATE):
            self.exchanges.resolve(ex, reply=m)
        else:
            self._drop(msg.peer, f"{m.type.name}, which the coordinator does not accept for a command")

    def _on_result(self, peer: PeerId, m: StageMessage, ex: Exchange) -> None:
        step: Step = ex.context
        if m.type is not MsgType.RUN_RESULT or peer != self.last:
            self._drop(peer, f"{m.type.name} for a step, not a RUN_RESULT from the last stage")
            return
        h = m.header
        if not result_is_for(h, self._wire_ids(step.rids), max(step.slot, 0), phase=step.kind, sample=step.sample):
            self._drop(peer, "a RUN_RESULT for other requests, another micro-batch, phase or sample flag")
            return
        try:
            outcome = self._outcome(step, m)
        except (ValueError, TypeError) as exc:
            self._drop(peer, f"a RUN_RESULT of the wrong shape ({exc})")
            return
        self.exchanges.resolve(ex, reply=outcome)

    def _outcome(self, step: Step, m: StageMessage) -> list[Sampled] | None:
        h = m.header
        if not step.sample:
            if h.get("tokens") is not None or m.tensors:
                raise ValueError("an intermediate prompt chunk returns nothing")
            return None
        if self.return_logits:
            logits = m.tensors.get("logits")
            if logits is None or logits.shape != (step.rows, self.model.vocab_size) or m.dtypes["logits"] != "float32":
                raise ValueError(f"logits must be float32 [{step.rows}, {self.model.vocab_size}]")
            rows = [self._samplers.get(r) or RowSampler(SamplingParams()) for r in step.rids]
            return sample_rows(mx.array(logits), rows)
        return result_tokens(h, step.rows, self.model.vocab_size)

    def _drop(self, peer: PeerId, what: str) -> None:
        cluster_warnings.warning(WarnClass.DIAGNOSTIC, "coordinator: dropping %s from %s", what, peer)

    # -- deadlines and health ----------------------------------------------------------------------------

    def _expired(self, ex: Exchange) -> ExecutorError:
        what = "the pipeline" if isinstance(ex.context, Step) else f"stage {', '.join(map(str, ex.senders))}"
        return ExecutorError(f"no answer from {what} before the exchange deadline", ErrorCode.TIMEOUT)

    def _on_tick(self, now: float) -> None:
        self.monitor.beat(now)
        if self._takeover is not None:
            self._takeover.tick(now)

    # -- a spare takes over a stage (docs/pipeline.md §5.7) ----------------------------------------------

    def node_at(self, addr: PeerId) -> Node | None:
        return self._nodes.get(addr)

    def move_stage(self, old: PeerId, new: PeerId) -> None:
        """Stage ``old`` is served at ``new`` from now on (a spare took its layers; its neighbours were told with
        RELOCATE): it counts as down until it answers GET_STATE as that stage."""
        node = self._nodes[old]
        stages = tuple(replace(n, address=new) if n.address == old else n for n in self.cluster.stages)
        self.cluster = replace(self.cluster, stages=stages)
        self._nodes = {n.address: n for n in stages}
        self.first, self.last = stages[0].address, stages[-1].address
        self.stage_addrs = frozenset(self._nodes)
        self.monitor.replace(old, new)
        log.warning("pipeline stage %s moved from %s to %s; it is used once it answers", node.id, old, new)

    def _probe(self, addr: PeerId, answered: Callable[..., None]) -> None:
        """GET_STATE with a deadline of two heartbeats; the answer marks the stage up, its absence down."""

        def then(ex: Exchange) -> None:
            if self.exchanges.closing:
                return
            if ex.reply is not None:
                answered(ex.reply.header)
            else:
                answered(None, str(ex.error) if ex.error else "no answer to a heartbeat")

        self._command_async(addr, MsgType.GET_STATE, {}, then=then, timeout=max(2 * self.monitor.interval_s, 1.0))

    def _check_state(self, addr: PeerId, state: dict[str, Any]) -> None:
        """A stage that answers must still be the same stage (ValueError otherwise)."""
        node = self._nodes.get(addr)
        if node is None:  # a spare took its stage over meanwhile (§5.7)
            raise ValueError(f"{addr} is no longer a stage of this cluster")
        problems = self._stage_problems(node, state)
        if problems:
            cluster_warnings.warning(WarnClass.DIAGNOSTIC, "coordinator: not using %s: %s", addr, "; ".join(problems))
            raise ValueError("; ".join(problems))

    def _stage_up(self, addr: PeerId, returned: bool) -> None:
        node = self._nodes.get(addr)
        if returned and node is not None:
            log.warning("pipeline stage %s at %s answers again; the cluster is healthy", node.id, addr)

    def _stage_restarted(self, addr: PeerId) -> None:
        """A restarted stage lost every sequence: fail their open steps, and any later step, at once."""
        node = self._nodes.get(addr)
        if node is None:
            return
        with self._lock:
            self._lost |= self._prepared
            self._prepared = set()
        if self._takeover is not None:
            self._takeover.restarted(node)
        log.warning("pipeline stage %s restarted; its sequences are lost and their requests fail", node.id)
        self._fail_steps(f"pipeline stage {node.id} restarted")
        self._fail_prepares(addr, f"pipeline stage {node.id} restarted")

    def _stage_down(self, addr: PeerId, why: str) -> None:
        node = self._nodes.get(addr)
        if node is None:
            return
        log.warning("pipeline stage %s at %s is unreachable (%s); failing its open exchanges, /health says degraded",
                    node.id, addr, why)
        self.transport.drop(addr)  # the next heartbeat dials afresh instead of waiting on a stalled connection
        self._fail_steps(f"pipeline stage {node.id} at {addr} is unreachable")
        self._fail_prepares(addr, f"pipeline stage {node.id} at {addr} is unreachable")

    def _fail_prepares(self, addr: PeerId, message: str) -> None:
        """The PREPAREs awaiting ``addr`` fail at once, not at their deadline: the process that would answer is gone."""
        for ex in self.exchanges.where(lambda e: e.context is _PREPARE and addr in e.senders):
            self.exchanges.resolve(ex, error=ExecutorError(message, ErrorCode.UNREACHABLE))

    def _fail_steps(self, message: str) -> None:
        """Every step runs through every stage: one stage lost fails them all."""
        for ex in self.exchanges.where(lambda e: isinstance(e.context, Step)):
            self.exchanges.resolve(ex, error=ExecutorError(message, ErrorCode.UNREACHABLE))


def fill_micro_batches(cluster: ClusterConfig) -> bool:
    """Whether decode rows fill one micro-batch before the next (docs/pipeline.md §3.9): as configured,
    else on a CPU. There a step costs about the same for 2 rows as for 4 (the weights are read either
    way) and the stages share the host's cores, so splitting 4 streams into two micro-batches doubled
    the work per token instead of overlapping it (4 streams, loaded box: 0.61x the single node spread,
    0.95x filled in the same run; docs/benchmarks.md)."""
    if cluster.micro_batch_fill is not None:
        return cluster.micro_batch_fill
    return mx.default_device().type == mx.DeviceType.cpu


def result_is_for(h: dict[str, Any], rids: list[str], micro_batch: int, *, phase: str | None = None,
                  sample: bool | None = None) -> bool:
    """Whether a RUN_RESULT names exactly these rows and this micro-batch (an integer, not ``true``), and,
    when given, carries the step's ``phase`` and ``sample`` (the five fields a stage copies unchanged)."""
    if phase is not None and h.get("phase") != phase:
        return False
    if sample is not None and h.get("sample") is not sample:
        return False
    return h.get("request_ids") == rids and is_int(h.get("micro_batch")) and h["micro_batch"] == micro_batch


def result_tokens(h: dict[str, Any], rows: int, vocab_size: int) -> list[Sampled]:
    """The sampled rows of a RUN_RESULT (token return); ValueError/TypeError if any field is off.

    Booleans are not integers or numbers: ``"tokens": [true]`` is refused, not read as token 1.
    """
    tokens = h.get("tokens")
    if not isinstance(tokens, list) or len(tokens) != rows:
        raise ValueError(f"tokens must be {rows} token ids")
    check_token_ids(tokens, vocab_size, "tokens")  # a TokenIdError is a ValueError
    lps = h.get("logprobs")
    lps = [None] * rows if lps is None else lps
    tops = h.get("top_logprobs")
    tops = [[] for _ in range(rows)] if tops is None else tops
    if not isinstance(lps, list) or not isinstance(tops, list) or len(lps) != rows or len(tops) != rows:
        raise ValueError("logprobs do not match the rows")
    if not all(lp is None or is_number(lp) for lp in lps):
        raise ValueError("logprobs must be numbers or null")
    if not all(isinstance(top, list) and all(_is_pair(p, vocab_size) for p in top) for top in tops):
        raise ValueError("top_logprobs must be lists of [token, logprob] pairs")
    return [Sampled(t, float(lp) if lp is not None else None, tuple((int(a), float(b)) for a, b in top))
            for t, lp, top in zip(tokens, lps, tops)]


def _is_pair(pair: Any, vocab_size: int) -> bool:
    return (isinstance(pair, list) and len(pair) == 2 and is_int(pair[0]) and 0 <= pair[0] < vocab_size
            and is_number(pair[1]))


def stage_code(code: ErrorCode) -> ErrorCode:
    """A stage's ERROR code as the coordinator's own failure (docs/pipeline.md §4.4): the unavailable class
    (overloaded, timeout, unavailable, unreachable) keeps its code, a 503 the client may retry; every other
    code is internal, a 500. ``cancelled`` too: a stage cannot cancel a client's request (only the client
    can), so a client still connected must never see 499."""
    return code if code.retryable else ErrorCode.INTERNAL


def _stage_error(peer: PeerId, m: StageMessage) -> ExecutorError:
    """A stage's ERROR as this node's failure: its complaint about our message is our internal error."""
    code = ErrorCode.from_wire(m.header.get("code"))
    text = str(m.header.get("message", ""))[:500]
    return ExecutorError(f"stage {peer} ({code.wire_name}): {text}", stage_code(code), peer_code=code)


def _layers(state: dict[str, Any]) -> str:
    layers = state.get("layers") or [0, 0]
    return f"layers {layers[0]}-{layers[1] - 1}"
