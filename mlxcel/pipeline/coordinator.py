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
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import mlx.core as mx

from mlxcel.cluster.errors import ClusterError, HandshakeError
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.messages import Message
from mlxcel.cluster.ratelimit import WarnClass, cluster_warnings
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.cluster.transport import Transport
from mlxcel.cluster.wire import Kind
from mlxcel.engine.executor import Done, ExecutorError, Step
from mlxcel.engine.runner import RowSampler, Sampled, sample_rows
from mlxcel.engine.sampling import SamplingParams
from mlxcel.pipeline.cluster_config import ClusterConfig, Node
from mlxcel.pipeline.outbox import FRAME_OVERHEAD, Outbox, fast_handoffs
from mlxcel.pipeline.params import params_to_wire
from mlxcel.pipeline.protocol import (
    MsgType,
    ProtocolError,
    StageMessage,
    decode,
    encode,
    new_nonce,
)
from mlxcel.pipeline.stage import ModelFacts
from mlxcel.pipeline.tensors import ids_to_wire

log = logging.getLogger("mlxcel.pipeline.coordinator")
COMMAND_TIMEOUT_S = 10.0
TICK_S = 0.05


@dataclass(eq=False)
class _Exchange:
    nonce: str
    deadline: float
    stage: PeerId | None = None  # a command's addressee; None for a step (any stage may report its error)
    step: Step | None = None
    done: Done | None = None
    event: threading.Event = field(default_factory=threading.Event)
    reply: StageMessage | None = None
    error: BaseException | None = None
    then: Callable[["_Exchange"], None] | None = None  # a command's continuation (heartbeats), run on resolve


@dataclass
class _StageStatus:
    node: Node
    up: bool = False
    last_seen: float = 0.0
    state: dict[str, Any] = field(default_factory=dict)
    probe: str | None = None
    last_down: float = 0.0


class PipelineExecutor:
    """Drives the stages of a cluster; implements ``mlxcel.engine.executor.Executor``."""

    def __init__(self, cluster: ClusterConfig, secret: ClusterSecret, model: ModelFacts, *,
                 max_batch_size: int, micro_batch_size: int | None = None, return_logits: bool = False):
        self.cluster = cluster
        self.model = model
        self.depth = len(cluster.stages)
        self.micro_batch_size = min(micro_batch_size or cluster.micro_batch(max_batch_size), cluster.max_batch_size)
        self.return_logits = return_logits
        self.exchange_s = cluster.timeouts.exchange_s
        self.heartbeat_s = cluster.timeouts.heartbeat_s
        self.first = cluster.stages[0].address
        self.last = cluster.stages[-1].address
        self.stage_addrs = {n.address for n in cluster.stages}
        self.transport = Transport(cluster.coordinator.address, secret)
        self.outbox = Outbox(self.transport)
        self._status = {n.address: _StageStatus(n) for n in cluster.stages}
        self._open: dict[str, _Exchange] = {}
        self._lock = threading.Lock()
        self._samplers: dict[str, RowSampler] = {}
        self._prepared: set[str] = set()  # request ids prepared on every stage
        self._lost: set[str] = set()  # prepared before a stage restarted: their state is gone
        self._closing = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="mlxcel-coordinator-timer", daemon=True)
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
        self._ticker.start()
        log.info("pipeline ready: %s", ", ".join(f"{n.id} {_layers(s.state)} at {n.address}"
                                                  for n, s in ((s.node, s) for s in self._status.values())))

    def _await_stage(self, node: Node, deadline: float) -> None:
        last: BaseException | None = None
        while time.monotonic() < deadline:
            try:
                self.transport.connect(node.address)
                state = self.command(node.address, MsgType.GET_STATE, {}, timeout=min(COMMAND_TIMEOUT_S, self.exchange_s))
                self._check_stage(node, state.header)
                self._mark_up(node.address, state.header)
                return
            except HandshakeError as exc:  # wrong secret, identity: retrying cannot help
                raise ExecutorError(f"cannot join stage {node.id} at {node.address}: {exc}", "handshake") from None
            except ExecutorError as exc:
                if exc.code == "mismatch":
                    raise
                last = exc
            except ClusterError as exc:
                last = exc
            time.sleep(0.5)
        raise ExecutorError(f"stage {node.id} at {node.address} did not answer within "
                            f"{self.cluster.timeouts.startup_s:g}s: {last}", "stage_unreachable")

    def _check_stage(self, node: Node, state: dict[str, Any]) -> None:
        index = self.cluster.stage_index(node.id)
        problems = []
        if state.get("node_id") != node.id or state.get("stage") != index:
            problems.append(f"it is {state.get('node_id')!r} (stage {state.get('stage')})")
        if state.get("cluster") != self.cluster.name:
            problems.append(f"its cluster name is {state.get('cluster')!r}, not {self.cluster.name!r}")
        if state.get("model_identity") != self.model.identity:
            problems.append("it holds a different model (identity mismatch: compare `mlxcel models info` on both hosts)")
        if node.layers is not None and tuple(state.get("layers") or ()) != node.layers:
            problems.append(f"it serves layers {state.get('layers')}, the cluster TOML says {list(node.layers)}")
        if problems:
            raise ExecutorError(f"stage {node.id} at {node.address}: " + "; ".join(problems), "mismatch")

    # -- the Executor interface (scheduler thread) ----------------------------------------------------

    def prepare(self, rid: str, params: SamplingParams, top_logprobs: int, prompt: Sequence[int]) -> int:
        down = [s.node.id for s in self._status.values() if not s.up]
        if down:
            raise ExecutorError(f"pipeline stage {', '.join(down)} is unreachable; retry shortly", "stage_unreachable")
        header = {"request_id": rid, "params": params_to_wire(params, top_logprobs),
                  "return": "logits" if self.return_logits else "token"}
        waits = [self._command_async(n.address, MsgType.PREPARE, header) for n in self.cluster.stages]
        for node, ex in zip(self.cluster.stages, waits):
            self._wait(ex, node.address, COMMAND_TIMEOUT_S)
        with self._lock:
            self._prepared.add(rid)
        if self.return_logits:
            self._samplers[rid] = RowSampler(params, top_logprobs)
        return 0

    def submit(self, step: Step, done: Done) -> None:
        with self._lock:
            lost = any(r in self._lost for r in step.rids)
        if lost:
            done(step, ExecutorError("a pipeline stage restarted and lost this request's state", "stage_unreachable"))
            return
        nonce = new_nonce()
        ex = _Exchange(nonce, time.monotonic() + self.exchange_s, step=step, done=done)
        header = {"nonce": nonce, "phase": step.kind, "micro_batch": max(step.slot, 0),
                  "request_ids": step.rids, "sample": step.sample}
        payload = encode(MsgType.RUN_ENTRY, header, {"input_ids": ids_to_wire(step.tokens)})
        with self._lock:
            self._open[nonce] = ex
        self.outbox.send(self.first, Kind.TENSOR_DATA, payload,
                         lambda exc: self._fail(nonce, ExecutorError(f"cannot reach the first stage: {exc}", "stage_unreachable")),
                         wanted=lambda: nonce in self._open)

    def release(self, rid: str, tokens: Sequence[int] | None = None) -> None:
        """RELEASE on every stage; stages do not answer it, so no exchange stays open for it."""
        self._samplers.pop(rid, None)
        with self._lock:
            self._prepared.discard(rid)
            self._lost.discard(rid)
        payload = encode(MsgType.RELEASE, {"request_id": rid, "nonce": new_nonce()})
        for node in self.cluster.stages:
            self.outbox.send(node.address, Kind.CONTROL, payload)

    def stats(self) -> dict[str, float]:
        frames = self.outbox.frames + self.received_frames
        nbytes = self.outbox.bytes + self.received_bytes
        for s in self._status.values():
            frames += int(s.state.get("sent_frames", 0)) if s.node.address != self.last else 0
            nbytes += int(s.state.get("sent_bytes", 0)) if s.node.address != self.last else 0
        return {"stages_down": float(sum(not s.up for s in self._status.values())),
                "wire_frames": float(frames), "wire_bytes": float(nbytes)}

    def health(self) -> dict[str, Any]:
        stages = [{"id": s.node.id, "address": str(s.node.address), "up": s.up, "layers": s.state.get("layers")}
                  for s in self._status.values()]
        return {"status": "ok" if all(s["up"] for s in stages) else "degraded", "stages": stages}

    def close(self) -> None:
        self._closing.set()
        with self._lock:
            open_, self._open = list(self._open.values()), {}
        for ex in open_:
            self._resolve(ex, error=ExecutorError("the coordinator is shutting down", "closed"))
        self.outbox.close()
        self.transport.close()

    # -- commands ---------------------------------------------------------------------------------------

    def command(self, stage: PeerId, mtype: MsgType, header: dict, timeout: float = COMMAND_TIMEOUT_S) -> StageMessage:
        """Send a command to one stage and wait for its ACK or STATE; raises ExecutorError on ERROR/timeout."""
        return self._wait(self._command_async(stage, mtype, header), stage, timeout)

    def _command_async(self, stage: PeerId, mtype: MsgType, header: dict, *,
                       then: Callable[[_Exchange], None] | None = None,
                       timeout: float = COMMAND_TIMEOUT_S) -> _Exchange:
        nonce = new_nonce()
        ex = _Exchange(nonce, time.monotonic() + timeout, stage=stage, then=then)
        with self._lock:
            self._open[nonce] = ex
        self.outbox.send(stage, Kind.CONTROL, encode(mtype, {**header, "nonce": nonce}),
                         lambda exc: self._fail(nonce, ExecutorError(f"cannot reach stage {stage}: {exc}", "stage_unreachable")),
                         wanted=None if mtype is MsgType.RELEASE else (lambda: nonce in self._open))
        return ex

    def _wait(self, ex: _Exchange, stage: PeerId, timeout: float) -> StageMessage:
        if not ex.event.wait(timeout):
            with self._lock:
                self._open.pop(ex.nonce, None)
            raise ExecutorError(f"stage {stage} did not answer within {timeout:g}s", "timeout")
        if ex.error is not None:
            raise ex.error if isinstance(ex.error, ExecutorError) else ExecutorError(str(ex.error))
        assert ex.reply is not None
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
        with self._lock:
            ex = self._open.get(m.nonce)
        if ex is None:
            self._drop(msg.peer, f"{m.type.name} for no open exchange")
            return
        if m.type is MsgType.RUN_RESULT:
            self._on_result(msg.peer, m, ex)
        elif m.type in (MsgType.ACK, MsgType.STATE) and ex.stage is not None:
            if msg.peer != ex.stage:
                self._drop(msg.peer, f"{m.type.name} for an exchange with {ex.stage}")
                return
            self._resolve(ex, reply=m)
        elif m.type is MsgType.ERROR:
            allowed = (msg.peer == ex.stage) if ex.stage is not None else (msg.peer in self.stage_addrs)
            if not allowed:
                self._drop(msg.peer, "an ERROR from a node this exchange does not involve")
                return
            code = str(m.header.get("code", "internal"))
            text = str(m.header.get("message", ""))[:500]
            self._resolve(ex, error=ExecutorError(f"stage {msg.peer}: {text}", code))
        else:
            self._drop(msg.peer, f"{m.type.name}, which the coordinator does not accept")

    def _on_result(self, peer: PeerId, m: StageMessage, ex: _Exchange) -> None:
        step = ex.step
        if step is None or peer != self.last:
            self._drop(peer, "a RUN_RESULT not from the last stage or for a command")
            return
        h = m.header
        if h.get("request_ids") != step.rids or h.get("micro_batch") != max(step.slot, 0):
            self._drop(peer, "a RUN_RESULT for other requests or another micro-batch")
            return
        try:
            outcome = self._outcome(step, m)
        except (ValueError, TypeError) as exc:
            self._drop(peer, f"a RUN_RESULT of the wrong shape ({exc})")
            return
        self._resolve(ex, outcome=outcome)

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
        tokens = h.get("tokens")
        if (not isinstance(tokens, list) or len(tokens) != step.rows
                or not all(isinstance(t, int) and 0 <= t < self.model.vocab_size for t in tokens)):
            raise ValueError(f"tokens must be {step.rows} ids below {self.model.vocab_size}")
        lps = h.get("logprobs") or [None] * step.rows
        tops = h.get("top_logprobs") or [[] for _ in tokens]
        if len(lps) != step.rows or len(tops) != step.rows:
            raise ValueError("logprobs do not match the rows")
        return [Sampled(t, float(lp) if lp is not None else None, tuple((int(a), float(b)) for a, b in top))
                for t, lp, top in zip(tokens, lps, tops)]

    def _drop(self, peer: PeerId, what: str) -> None:
        cluster_warnings.warning(WarnClass.DIAGNOSTIC, "coordinator: dropping %s from %s", what, peer)

    # -- completion ---------------------------------------------------------------------------------------

    def _fail(self, nonce: str, error: BaseException) -> None:
        with self._lock:
            ex = self._open.get(nonce)
        if ex is not None:
            self._resolve(ex, error=error)

    def _resolve(self, ex: _Exchange, *, outcome: Any = None, reply: StageMessage | None = None,
                 error: BaseException | None = None) -> None:
        with self._lock:
            if self._open.pop(ex.nonce, None) is None and not self._closing.is_set():
                return  # already resolved: a nonce is used once
        ex.reply, ex.error = reply, error
        ex.event.set()
        if ex.step is not None and ex.done is not None:
            ex.done(ex.step, error if error is not None else outcome)
        elif ex.then is not None:
            ex.then(ex)

    # -- deadlines and heartbeats ----------------------------------------------------------------------------

    def _tick(self) -> None:
        next_beat = time.monotonic()
        while not self._closing.wait(TICK_S):
            now = time.monotonic()
            with self._lock:
                expired = [ex for ex in self._open.values() if ex.deadline <= now]
            for ex in expired:
                what = "the pipeline" if ex.step is not None else f"stage {ex.stage}"
                self._resolve(ex, error=ExecutorError(f"no answer from {what} before the exchange deadline", "timeout"))
            if now >= next_beat:
                next_beat = now + self.heartbeat_s
                self._heartbeat(now)

    def _heartbeat(self, now: float) -> None:
        """Probe every stage that has no probe outstanding (a dead peer's probe waits out its dial)."""
        for addr, status in self._status.items():
            with self._lock:
                outstanding = status.probe is not None and status.probe in self._open
            if not outstanding:
                status.probe = self._probe(addr)

    def _probe(self, addr: PeerId) -> str:
        """GET_STATE with a deadline of two heartbeats; the answer marks the stage up, its absence down."""

        def answered(ex: _Exchange) -> None:
            if ex.reply is not None:
                self._mark_up(addr, ex.reply.header)
            elif not self._closing.is_set():
                self._mark_down(addr, str(ex.error) if ex.error else "no answer to a heartbeat")

        return self._command_async(addr, MsgType.GET_STATE, {}, then=answered,
                                   timeout=max(2 * self.heartbeat_s, 1.0)).nonce

    def _mark_up(self, addr: PeerId, state: dict[str, Any]) -> None:
        status = self._status[addr]
        try:
            self._check_stage(status.node, state)  # a stage that came back must still be the same stage
        except ExecutorError as exc:
            cluster_warnings.warning(WarnClass.DIAGNOSTIC, "coordinator: not using %s: %s", addr, exc)
            self._mark_down(addr, "it answers as a different stage or model")
            return
        booted = status.state.get("boot_id")
        if booted is not None and state.get("boot_id") != booted:
            self._stage_restarted(status.node)
        was_up = status.up
        status.state, status.last_seen, status.up = state, time.monotonic(), True
        if not was_up and status.last_down:
            log.warning("pipeline stage %s at %s answers again; the cluster is healthy", status.node.id, addr)

    def _stage_restarted(self, node: Node) -> None:
        """A restarted stage lost every sequence: fail their open steps, and any later step, at once."""
        with self._lock:
            self._lost |= self._prepared
            self._prepared = set()
            steps = [ex for ex in self._open.values() if ex.step is not None]
        log.warning("pipeline stage %s restarted; its sequences are lost and their requests fail", node.id)
        for ex in steps:
            self._resolve(ex, error=ExecutorError(f"pipeline stage {node.id} restarted", "stage_unreachable"))

    def _mark_down(self, addr: PeerId, why: str) -> None:
        status = self._status[addr]
        if not status.up:
            return
        status.up, status.last_down = False, time.monotonic()
        log.warning("pipeline stage %s at %s is unreachable (%s); failing its open exchanges, /health says degraded",
                    status.node.id, addr, why)
        with self._lock:
            steps = [ex for ex in self._open.values() if ex.step is not None]
        for ex in steps:
            self._resolve(ex, error=ExecutorError(f"pipeline stage {status.node.id} at {addr} is unreachable", "stage_unreachable"))


def _layers(state: dict[str, Any]) -> str:
    layers = state.get("layers") or [0, 0]
    return f"layers {layers[0]}-{layers[1] - 1}"
