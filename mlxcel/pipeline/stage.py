"""A pipeline stage process: its layer slice behind the authenticated transport.

Authorization (docs/pipeline.md §4, as the reference specifies):

- commands (PREPARE, RUN_ENTRY, CANCEL, RELEASE, BEGIN_DRAIN, SHUTDOWN, GET_STATE) are accepted
  only from the cluster's coordinator identity (any identity on its port when its configured IP is
  unspecified); anything else is answered with ERROR ``unauthorized`` and changes nothing;
- the authenticated source of a PREPARE owns that request id here; a PREPARE, RUN_ENTRY, CANCEL
  or RELEASE for it from another identity is answered with ERROR ``unauthorized``;
- activations are accepted only from the upstream stage; one from anywhere else (a reverse
  activation, a rogue member) is dropped with a warning;
- replies and results go to the authenticated owner, never to an address named in a payload;
- tensors are checked against the bounds before use; a violation is answered with ERROR
  ``bad_tensor`` to the owner, carrying the exchange nonce, so the request fails at once.

Transport reader threads only decode, authorize, check bounds and enqueue; one worker thread runs
every MLX operation in arrival order.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from mlxcel import __version__
from mlxcel.cluster.attribution import AttributionOnly, transport_options
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.messages import Message
from mlxcel.cluster.ratelimit import WarnClass, cluster_warnings
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.cluster.transport import Transport
from mlxcel.cluster.wire import Kind
from mlxcel.config import MAX_PREFIX_TOKENS, MAX_TOKENS_LIMIT
from mlxcel.engine.prefix_cache import PrefixCache
from mlxcel.engine.runner import RowSampler, RunnerError, Sampled, SliceRunner
from mlxcel.engine.sampling import SamplingError
from mlxcel.models.facts import ModelFacts
from mlxcel.topology.cluster_config import ClusterConfig
from mlxcel.cluster.outbox import Outbox, fast_handoffs
from mlxcel.pipeline.params import count_from_wire, params_and_replay, tokens_from_wire
from mlxcel.pipeline.protocol import (
    COMMANDS,
    STATE_SECONDS,
    ErrorCode,
    MsgType,
    ProtocolError,
    StageMessage,
    check_hidden,
    check_ids,
    is_request_id,
    decode,
    encode,
)

log = logging.getLogger("mlxcel.pipeline.stage")
_STOP = object()


@dataclass(frozen=True)
class _Launched:
    """A step built but not yet waited for and sent."""

    owner: PeerId
    message: StageMessage
    out: Any  # hidden states, sampled rows, logits, or None (an intermediate prompt chunk)
    started: float
    logits: bool


@dataclass(frozen=True)
class _Prepare:
    """A checked PREPARE for the worker: the last stage's sampler, the prompt to look up, the agreed cap."""

    row: RowSampler | None
    prompt: list[int] | None
    max_cached: int | None


def is_coordinator(peer: PeerId, coordinator: PeerId) -> bool:
    """The coordinator check: its exact identity, or any identity on its port when its IP is unspecified."""
    if coordinator.ip.is_unspecified:
        return peer.port == coordinator.port
    return peer == coordinator


class StageService:
    """Serves one stage of a cluster until closed."""

    def __init__(self, cluster: ClusterConfig, node_id: str, runner: SliceRunner, secret: ClusterSecret,
                 model: ModelFacts, *, on_shutdown: Callable[[], None] | None = None,
                 step_delay_s: float = 0.0, _attribution: AttributionOnly | None = None):
        self.cluster = cluster
        self.index = cluster.stage_index(node_id)
        self.node = cluster.stages[self.index]
        self.runner = runner
        self.model = model
        self.prefix = PrefixCache(cluster.prefix_cache_mb << 20)  # this slice's KV of finished sequences, per owner
        self.coordinator = cluster.coordinator.address
        self.upstream = cluster.stages[self.index - 1].address if self.index > 0 else None
        self.downstream = cluster.stages[self.index + 1].address if self.index + 1 < len(cluster.stages) else None
        self.max_rows = cluster.max_batch_size
        # _attribution: bench code's unsealed frames (mlxcel/cluster/attribution.py); roles never pass it
        self.transport = Transport(self.node.address, secret, transport_options(
            _attribution, who=f"stage {node_id}", base=cluster.transport_options()))
        self.outbox = Outbox(self.transport)
        self.boot_id = os.urandom(8).hex()
        self.draining = False
        self._owners: dict[str, PeerId] = {}
        self._returns: dict[str, str] = {}  # request id -> "token" | "logits"
        self._slots: dict[tuple[PeerId, int], int] = {}  # (owner, micro-batch) -> the runner's slot
        self._lock = threading.Lock()
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._on_shutdown = on_shutdown
        self._worker = threading.Thread(target=self._run, name=f"mlxcel-stage-{node_id}", daemon=True)
        self.steps = 0
        self.cancels = 0  # CANCELs accepted (requests whose client gave up)
        # seconds spent since start, per part of a step: decoding on the reader thread, waiting for the
        # worker, computing (tensor in, forward, evaluation or sampling), sending (tensor out, encode, send)
        self.timings = dict.fromkeys(STATE_SECONDS, 0.0)
        self._delay = step_delay_s  # a test and rehearsal aid: sleep this long before every step (a slow stage)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.downstream is None

    def start(self) -> PeerId:
        fast_handoffs()
        self._worker.start()
        return self.transport.serve(self._on_message)

    def close(self) -> None:
        self._work.put(_STOP)
        self.transport.close()
        self.outbox.close()
        if self._worker.is_alive() and self._worker is not threading.current_thread():
            self._worker.join(5.0)

    # -- reader threads: decode, authorize, bound, enqueue ----------------------------------------

    def _on_message(self, msg: Message) -> None:
        refused: ProtocolError | None = None
        start = time.perf_counter()
        try:
            m = decode(msg.payload)
            m.received = time.perf_counter()
            self.timings["read_s"] += m.received - start
        except ProtocolError as exc:
            if exc.partial is None:  # no type or no header: nothing to authorize or answer
                cluster_warnings.warning(WarnClass.DIAGNOSTIC, "stage %s: dropping a malformed message from %s: %s",
                                         self.node.id, msg.peer, exc)
                return
            m, refused = exc.partial, exc  # a tensor out of bounds: answered like any other refusal of its kind
        if m.type is MsgType.ACTIVATION:
            self._on_activation(msg.peer, m, refused)
        elif m.type in COMMANDS:
            self._on_command(msg.peer, m, refused)
        else:
            cluster_warnings.warning(WarnClass.DIAGNOSTIC, "stage %s: dropping %s from %s (a stage takes no replies)",
                                     self.node.id, m.type.name, msg.peer)

    def _on_command(self, peer: PeerId, m: StageMessage, refused: ProtocolError | None = None) -> None:
        if not is_coordinator(peer, self.coordinator):
            self._reply_error(peer, m, ErrorCode.UNAUTHORIZED, f"{m.type.name} accepted only from the coordinator")
            return
        try:
            if refused is not None:
                raise refused
            handler = getattr(self, f"_cmd_{m.type.name.lower()}")
            handler(peer, m)
        except ProtocolError as exc:
            self._reply_error(peer, m, exc.code, str(exc))

    def _cmd_get_state(self, peer: PeerId, m: StageMessage) -> None:
        self._reply(peer, MsgType.STATE, {"nonce": m.nonce, **self.state()})

    def _cmd_prepare(self, peer: PeerId, m: StageMessage) -> None:
        rid = _rid(m.header.get("request_id"))
        if self.draining:
            raise ProtocolError(ErrorCode.UNAVAILABLE, f"stage {self.node.id} is draining; it accepts no new sequence")
        try:
            params, top, context, replay = params_and_replay(m.header.get("params"), self.model.vocab_size)
            # a grammar compiles here, against this stage's vocabulary, and replays what came before (GrammarError)
            row = RowSampler(params, top, context=context, replay=replay, vocab_size=self.model.vocab_size) \
                if self.is_last else None
        except (SamplingError, TypeError, ValueError) as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"bad sampling parameters: {exc}") from None
        ret = m.header.get("return", "token")
        if ret not in ("token", "logits"):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"return must be token or logits, got {ret!r}")
        try:
            prompt = tokens_from_wire(m.header.get("prompt"), "prompt", self.model.vocab_size)
            cap = m.header.get("max_cached")
            cap = None if cap is None else count_from_wire(cap, "max_cached", MAX_PREFIX_TOKENS)
            draws = count_from_wire(m.header.get("draws", 0), "draws", MAX_TOKENS_LIMIT)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, str(exc)) from None
        with self._lock:
            owner = self._owners.get(rid)
            if owner is not None and owner != peer:
                raise ProtocolError(ErrorCode.UNAUTHORIZED, f"request {rid} belongs to another identity")
            self._owners[rid] = peer
            self._returns[rid] = ret
        if row is not None:
            row.skip(draws)  # a resumed sequence: its sampler goes on after the tokens sampled before
        self._work.put(("prepare", peer, m, _Prepare(row, prompt, cap)))

    def _cmd_run_entry(self, peer: PeerId, m: StageMessage) -> None:
        if not self.is_first:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"stage {self.node.id} is not the first stage")
        # the ids' form was checked when the step header decoded (bad_request), before who owns them
        self._check_owned(peer, m.request_ids)
        check_ids(m, max_rows=self.max_rows, vocab_size=self.model.vocab_size)
        self._work.put(("run", peer, m, "input_ids"))

    def _cmd_cancel(self, peer: PeerId, m: StageMessage) -> None:
        self._release(peer, m, ack=True)
        self.cancels += 1

    def _cmd_release(self, peer: PeerId, m: StageMessage) -> None:
        try:
            tokens = tokens_from_wire(m.header.get("tokens"), "tokens", self.model.vocab_size)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, str(exc)) from None
        self._release(peer, m, ack=False, tokens=tokens)

    def _release(self, peer: PeerId, m: StageMessage, *, ack: bool, tokens: list[int] | None = None) -> None:
        rid = _rid(m.header.get("request_id"))
        with self._lock:
            owner = self._owners.get(rid)
            if owner is not None and owner != peer:
                raise ProtocolError(ErrorCode.UNAUTHORIZED, f"request {rid} belongs to another identity")
            self._owners.pop(rid, None)
            self._returns.pop(rid, None)
        self._work.put(("release", peer, m, (ack, tokens)))

    def _cmd_begin_drain(self, peer: PeerId, m: StageMessage) -> None:
        self.draining = True
        log.info("stage %s: draining (no new sequences)", self.node.id)
        self._reply(peer, MsgType.ACK, {"nonce": m.nonce})

    def _cmd_shutdown(self, peer: PeerId, m: StageMessage) -> None:
        log.info("stage %s: shutdown requested by the coordinator", self.node.id)
        self._reply(peer, MsgType.ACK, {"nonce": m.nonce})
        if self._on_shutdown is not None:
            threading.Timer(0.2, self._on_shutdown).start()

    def _cmd_relocate(self, peer: PeerId, m: StageMessage) -> None:
        """Another stage of the cluster now listens at ``address`` (a spare took it over): activations go
        to it, or are accepted from it, when it is this stage's neighbour. ACK, or ERROR bad_request."""
        node_id, text = m.header.get("node_id"), m.header.get("address")
        index = next((i for i, n in enumerate(self.cluster.stages) if n.id == node_id), None)
        if index is None or index == self.index:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"RELOCATE names {node_id!r}, which is not another stage of "
                                f"cluster {self.cluster.name!r}")
        try:
            address = PeerId.parse(text) if isinstance(text, str) else None
        except ValueError:
            address = None
        if address is None or address.port == 0 or address.ip.is_unspecified:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"RELOCATE address {text!r} is not a numeric ip:port a stage "
                                "listens on")
        if index == self.index - 1:
            self.upstream = address
        elif index == self.index + 1:
            self.downstream = address
        log.warning("stage %s: %s now listens at %s (relocated by the coordinator)", self.node.id, node_id, address)
        self._reply(peer, MsgType.ACK, {"nonce": m.nonce})

    def _on_activation(self, peer: PeerId, m: StageMessage, refused: ProtocolError | None = None) -> None:
        if peer != self.upstream:
            cluster_warnings.warning(WarnClass.DIAGNOSTIC, "stage %s: dropping an activation from %s (only %s, the "
                                     "upstream stage, sends activations here)", self.node.id, peer, self.upstream)
            return
        owner = self._owner_of(m.request_ids)
        if owner is None or not m.nonce:
            log.warning("stage %s: dropping an activation nobody can be told about (no owner or no nonce)", self.node.id)
            return
        try:
            if refused is not None:
                raise refused
            check_hidden(m, max_rows=self.max_rows, width=getattr(self.runner, "input_width", None) or self.model.hidden_size)
        except ProtocolError as exc:
            self._reply_error(owner, m, exc.code, str(exc))
            return
        self._work.put(("run", owner, m, "hidden"))

    def _check_owned(self, peer: PeerId, rids: list[str]) -> None:
        if not rids:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "request_ids must name at least one request")
        with self._lock:
            for rid in rids:
                owner = self._owners.get(rid)
                if owner is None:
                    raise ProtocolError(ErrorCode.NOT_FOUND, f"request {rid} was not prepared on stage {self.node.id}")
                if owner != peer:
                    raise ProtocolError(ErrorCode.UNAUTHORIZED, f"request {rid} belongs to another identity")

    def _slot(self, owner: PeerId, micro_batch: int) -> int:
        """Micro-batches are per owner: a decode step reconciles its slot (dropping the rows it does not
        name), so a shared slot would let one identity evict the sequences of another."""
        with self._lock:
            return self._slots.setdefault((owner, micro_batch), len(self._slots))

    def _owner_of(self, rids: list[str]) -> PeerId | None:
        with self._lock:
            owners = {self._owners.get(r) for r in rids} if rids else {None}
        return owners.pop() if len(owners) == 1 else None

    # -- the worker: every MLX operation -----------------------------------------------------------

    def _run(self) -> None:
        """Every queued item in arrival order, each to its end (built, evaluated, sent) before the next."""
        while True:
            item = self._work.get()
            if item is _STOP:
                return
            op, peer, m, arg = item
            if op == "prepare":
                self._attempt(peer, m, self._prepare, peer, m, arg)
            elif op == "release":
                self._attempt(peer, m, self._forget, peer, m, *arg)
            else:
                self._attempt(peer, m, self._step, peer, m, arg)

    def _attempt(self, peer: PeerId, m: StageMessage, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``; a failure is answered to ``peer`` as an ERROR for ``m`` (None returned), never
        raised: a failed step fails its requests, never the stage."""
        try:
            return fn(*args)
        except RunnerError as exc:
            self._reply_error(peer, m, exc.code, str(exc))
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, never the stage
            log.exception("stage %s: %s failed", self.node.id, m.type.name)
            self._reply_error(peer, m, ErrorCode.INTERNAL, f"stage {self.node.id}: {type(exc).__name__}: {exc}")
        return None

    def _prepare(self, peer: PeerId, m: StageMessage, p: _Prepare) -> None:
        """A fresh sequence, seeded with this slice's KV of the longest cached prefix of its prompt (at most
        ``max_cached`` tokens) that the same identity released; ACK says how many tokens that is (§3.12)."""
        cache, cached = self.prefix.lookup(p.prompt, p.max_cached, scope=peer) if p.prompt else (None, 0)
        self.runner.prepare(m.header["request_id"], p.row, cache=cache, length=cached)
        self._reply(peer, MsgType.ACK, {"nonce": m.nonce, "cached": cached})

    def _forget(self, peer: PeerId, m: StageMessage, ack: bool, tokens: list[int] | None) -> None:
        """Free a sequence; with ``tokens`` (a RELEASE), its KV first goes to the prefix cache under them."""
        rid = m.header["request_id"]
        taken = self.runner.take_cache(rid) if tokens and self.prefix.max_bytes > 0 else None
        if taken is not None:
            cache, length = taken
            self.prefix.store(tokens[:length], cache, scope=peer)  # only this identity may reuse it
        self.runner.release(rid)
        if ack:
            self._reply(peer, MsgType.ACK, {"nonce": m.nonce})

    def _step(self, owner: PeerId, m: StageMessage, tensor: str) -> None:
        """One step to its end: computed, evaluated, sent."""
        self._finish(self._launch(owner, m, tensor))

    def _launch(self, owner: PeerId, m: StageMessage, tensor: str) -> _Launched:
        """Build and evaluate one step (prompt chunk or decode step)."""
        from mlxcel.pipeline.tensors import from_wire

        h = m.header
        rids = m.request_ids
        phase, sample = h.get("phase"), bool(h.get("sample", True))
        with self._lock:
            if any(r not in self._owners for r in rids):
                raise RunnerError(ErrorCode.NOT_FOUND, "a request of this step was released")
            logits = self._returns.get(rids[0]) == "logits"
        started = time.perf_counter()
        self.timings["queue_s"] += started - m.received if m.received else 0.0
        x = from_wire(m.dtypes[tensor], m.tensors[tensor])
        if self._delay:
            time.sleep(self._delay)
        if phase == "prefill":
            out = self.runner.prefill(rids[0], x, sample=sample, logits=logits)
        else:
            out = self.runner.decode(self._slot(owner, int(h.get("micro_batch", 0))), rids, x, logits=logits)
        self.steps += 1
        return _Launched(owner, m, out, started, logits)

    def _finish(self, step: _Launched) -> None:
        """Wait for a launched step's output and send it on: the activation downstream, or the result."""
        from mlxcel.pipeline.tensors import to_wire

        out = step.out
        h, owner, m = step.message.header, step.owner, step.message
        fwd = {k: h[k] for k in ("nonce", "phase", "micro_batch", "request_ids", "sample") if k in h}
        hidden = None if self.is_last else to_wire(out)  # waits for a queued step's evaluation
        computed = time.perf_counter()
        self.timings["compute_s"] += computed - step.started
        if hidden is not None:
            self._send(self.downstream, MsgType.ACTIVATION, fwd, {"hidden": hidden}, owner, m)
        else:
            self._send(owner, MsgType.RUN_RESULT, {**fwd, **_result_fields(out, step.logits)},
                       {"logits": ("float32", _np(out))} if step.logits and out is not None else None, owner, m)
        self.timings["send_s"] += time.perf_counter() - computed

    # -- replies -----------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        start, end = self.node.layers or (0, 0)
        return {
            "node_id": self.node.id, "cluster": self.cluster.name, "stage": self.index, "layers": [start, end],
            "model_identity": self.model.identity, "num_layers": self.model.num_layers,
            "hidden_size": self.model.hidden_size, "vocab_size": self.model.vocab_size,
            "sequences": len(self.runner), "draining": self.draining, "version": __version__,
            "boot_id": self.boot_id, "steps": self.steps,
            "overlapped": 0,  # kept on the wire: no step is built ahead since MLXCEL_STAGE_OVERLAP went (§3.13)
            **{k: round(v, 6) for k, v in self.timings.items()}, "prefix_bytes": self.prefix.nbytes,
            "sent_frames": self.outbox.frames, "sent_bytes": self.outbox.bytes,
        }

    def _send(self, peer: PeerId | None, mtype: MsgType, header: dict, tensors: dict | None,
              owner: PeerId, m: StageMessage) -> None:
        assert peer is not None
        payload = encode(mtype, header, tensors)

        def failed(exc: BaseException) -> None:
            if peer != owner:  # the next stage is gone: tell the owner, so the request fails now
                self._reply_error(owner, m, ErrorCode.UNREACHABLE, f"stage {self.node.id} cannot reach {peer}: {exc}")

        kind = Kind.TENSOR_DATA if tensors else Kind.CONTROL
        self.outbox.send(peer, kind, payload, failed)

    def _reply(self, peer: PeerId, mtype: MsgType, header: dict) -> None:
        self.outbox.send(peer, Kind.CONTROL, encode(mtype, header))

    def _reply_error(self, peer: PeerId, m: StageMessage, code: ErrorCode, message: str) -> None:
        log.info("stage %s: %s %s from %s: %s", self.node.id, code.wire_name, m.type.name, peer, message)
        self._reply(peer, MsgType.ERROR, {"nonce": m.nonce, "code": int(code), "message": message,
                                          "request_ids": m.request_ids or ([m.header["request_id"]]
                                                                          if isinstance(m.header.get("request_id"), str) else [])})


def _rid(value: Any) -> str:
    if not is_request_id(value):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "request_id must be a string of 1 to 128 UTF-8 bytes")
    return value


def _np(x: Any) -> Any:
    import numpy as np

    return np.array(x, copy=False)


def _result_fields(out: list[Sampled] | Any | None, logits: bool) -> dict[str, Any]:
    if out is None:
        return {"tokens": None}
    if logits:
        return {"tokens": None}
    return {
        "tokens": [s.token for s in out],
        "logprobs": [s.logprob for s in out] if any(s.logprob is not None for s in out) else None,
        "top_logprobs": [[list(p) for p in s.top_logprobs] for s in out] if any(s.top_logprobs for s in out) else None,
    }
