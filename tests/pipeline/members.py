"""In-process pipeline members on their own loopback addresses, for the authorization tests.

Everything is real: ``StageService`` and ``PipelineExecutor`` on the authenticated transport, and
``Peer``s, plain transports holding the cluster secret that send crafted stage-protocol messages and
record what reaches them (a rogue member, or a scripted stage the test drives by hand).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxcel.cluster.identity import PeerId
from tests.ports import free_port  # noqa: F401  (re-exported to the attack tests)
from tests.waiting import wait_until  # noqa: F401  (re-exported to the pipeline tests)
from mlxcel.cluster.messages import Message
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.cluster.transport import Transport
from mlxcel.cluster.wire import Kind
from mlxcel.engine.executor import Step
from mlxcel.engine.runner import SliceRunner
from mlxcel.engine.sampling import SamplingParams
from mlxcel.topology.cluster_config import ClusterConfig, parse_cluster_config
from mlxcel.pipeline.coordinator import PipelineExecutor
from mlxcel.pipeline.protocol import (
    MsgType,
    ProtocolError,
    StageMessage,
    decode,
    encode,
)
from mlxcel.models.facts import ModelFacts
from mlxcel.pipeline.stage import StageService
from mlxcel.pipeline.tensors import to_wire

SECRET = ClusterSecret(b"pipeline-authorization-tests-0123456789", source="test")
COORDINATOR_IP = "127.0.0.2"
STAGE_IPS = ("127.0.0.3", "127.0.0.4")
ROGUE_IP = "127.0.0.9"
LAYERS = ((0, 2), (2, 4))
MAX_ROWS = 4
CLUSTER_NAME = "attack-test"
Received = tuple[PeerId, StageMessage]


def cluster_config(coordinator: str, stages: Sequence[str], *, exchange_s: float) -> ClusterConfig:
    """The cluster TOML's content as a dict, through the real loader."""
    nodes = [{"id": "coordinator", "role": "coordinator", "address": coordinator}]
    nodes += [{"id": f"stage-{i}", "role": "stage", "address": a, "layers": f"{lo}-{hi - 1}"}
              for i, (a, (lo, hi)) in enumerate(zip(stages, LAYERS))]
    doc = {"cluster": {"name": CLUSTER_NAME}, "pipeline": {"max_batch_size": MAX_ROWS},
           "timeouts": {"startup_s": 20, "exchange_s": exchange_s, "heartbeat_s": 0.5}, "nodes": nodes}
    return parse_cluster_config(doc, Path("attack.toml"))


def stage_state(config: ClusterConfig, index: int, facts: ModelFacts) -> dict[str, Any]:
    """What a scripted stage answers to GET_STATE (the fields the coordinator checks)."""
    node = config.stages[index]
    return {"node_id": node.id, "stage": index, "cluster": config.name, "model_identity": facts.identity,
            "layers": list(node.layers or ())}


class Peer:
    """A serving transport that records every stage-protocol message it receives.

    ``answer(peer_obj, sender, message)`` runs first on the reader thread (a scripted stage replies
    there); every decoded message is recorded, in arrival order.
    """

    def __init__(self, address: str, answer: Callable[[Peer, PeerId, StageMessage], None] | None = None):
        self.transport = Transport(address, SECRET, reconnect_base_delay=0.01, max_reconnect_attempts=2)
        self._answer = answer
        self._cond = threading.Condition()
        self.received: list[Received] = []
        self.identity = self.transport.serve(self._on_message)

    def _on_message(self, msg: Message) -> None:
        try:
            m = decode(bytes(msg.payload))
        except ProtocolError as exc:
            m = StageMessage(MsgType.ERROR, {"code": "undecodable", "message": str(exc)})
        if self._answer is not None:
            self._answer(self, msg.peer, m)
        with self._cond:
            self.received.append((msg.peer, m))
            self._cond.notify_all()

    def send(self, to: PeerId, mtype: MsgType, header: dict, tensors: dict | None = None) -> None:
        self.send_raw(to, encode(mtype, header, tensors))

    def send_raw(self, to: PeerId, payload: bytes) -> None:
        self.transport.send(to, Kind.TENSOR_DATA if len(payload) > 256 else Kind.CONTROL, payload)

    def matching(self, pred: Callable[[PeerId, StageMessage], bool]) -> list[Received]:
        with self._cond:
            return [(p, m) for p, m in self.received if pred(p, m)]

    def wait_for(self, pred: Callable[[PeerId, StageMessage], bool], timeout: float = 5.0) -> Received:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for p, m in self.received:
                    if pred(p, m):
                        return p, m
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"nothing matched within {timeout}s; got {self._summary()}")
                self._cond.wait(left)

    def about(self, nonce: str) -> list[Received]:
        """Everything received that carries ``nonce``."""
        return self.matching(lambda p, m: m.nonce == nonce)

    def _summary(self) -> list[str]:
        return [f"{m.type.name} from {p} {m.header}" for p, m in self.received if m.type is not MsgType.GET_STATE]

    def close(self) -> None:
        self.transport.close()


def answer_as_stage(state: dict[str, Any]) -> Callable[[Peer, PeerId, StageMessage], None]:
    """A scripted stage: answers GET_STATE (heartbeats included) and ACKs PREPARE; ignores the rest."""

    def answer(me: Peer, sender: PeerId, m: StageMessage) -> None:
        if m.type is MsgType.GET_STATE:
            me.send(sender, MsgType.STATE, {"nonce": m.nonce, **state})
        elif m.type is MsgType.PREPARE:
            me.send(sender, MsgType.ACK, {"nonce": m.nonce})

    return answer


class Tap:
    """Wraps a node's message handler: records (sender, decoded message) of everything it is handed."""

    def __init__(self, handler: Callable[[Message], None]):
        self.handler = handler
        self.seen: list[tuple[PeerId, StageMessage | None, bytes]] = []

    def __call__(self, msg: Message) -> None:
        raw = bytes(msg.payload)
        try:
            self.handler(msg)
        finally:  # recorded once handled: a test that sees it knows the node has decided
            try:
                m: StageMessage | None = decode(raw)
            except ProtocolError:
                m = None
            self.seen.append((msg.peer, m, raw))

    def about(self, nonce: str) -> list[tuple[PeerId, StageMessage]]:
        return [(p, m) for p, m, _ in self.seen if m is not None and m.nonce == nonce]

    def handled(self, payload: bytes) -> bool:
        """Whether the node has been handed (and has handled) exactly ``payload``, decodable or not."""
        return any(raw == payload for _, _, raw in list(self.seen))

    def raw(self, mtype: MsgType, nonce: str) -> bytes:
        return next(raw for _, m, raw in self.seen if m is not None and m.type is mtype and m.nonce == nonce)


def start_stage(config: ClusterConfig, index: int, runner: SliceRunner, facts: ModelFacts,
                shutdowns: list | None = None, **options: Any) -> StageService:
    service = StageService(config, config.stages[index].id, runner, SECRET, facts,
                           on_shutdown=(lambda: shutdowns.append(index)) if shutdowns is not None else None,
                           **options)
    service.start()
    return service


def start_coordinator(config: ClusterConfig, facts: ModelFacts, **options: Any) -> tuple[PipelineExecutor, Tap]:
    """A PipelineExecutor whose incoming messages are also recorded (``Tap``)."""
    executor = PipelineExecutor(config, SECRET, facts, max_batch_size=MAX_ROWS, **options)
    tap = Tap(executor._on_message)
    executor._on_message = tap  # type: ignore[method-assign]  # serve() picks the handler up at start
    try:
        executor.start(timeout=20)
    except BaseException:
        executor.close()
        raise
    return executor, tap


class Pending:
    """A step submitted to an executor; ``result()`` waits for its outcome (tokens, None or the exception)."""

    def __init__(self, executor: Any, step: Step):
        self.step = step
        self.outcomes: list[Any] = []
        self.elapsed = float("nan")
        self._event = threading.Event()
        self._start = time.monotonic()
        executor.submit(step, self._done)

    def _done(self, _: Step, outcome: Any) -> None:
        self.elapsed = time.monotonic() - self._start
        self.outcomes.append(outcome)
        self._event.set()

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def result(self, timeout: float = 10.0) -> Any:
        assert self._event.wait(timeout), f"step {self.step.kind} {self.step.rids} did not complete within {timeout}s"
        return self.outcomes[0]


class GreedyRun:
    """One greedy sequence driven through an executor step by step (prefill, then decode in ``slot``)."""

    def __init__(self, executor: Any, rid: str, prompt: Sequence[int], *, slot: int = 0,
                 params: SamplingParams | None = None, draws: int = 0):
        self.executor, self.rid, self.prompt, self.slot = executor, rid, list(prompt), slot
        self.tokens: list[int] = []
        executor.prepare(rid, params or SamplingParams(), 0, self.prompt, draws=draws)

    def step(self) -> int:
        """The next token; raises ExecutorError when the step fails."""
        if not self.tokens:
            step = Step("prefill", [self.rid], [self.prompt])
        else:
            step = Step("decode", [self.rid], [[self.tokens[-1]]], slot=self.slot)
        outcome = Pending(self.executor, step).result()
        if isinstance(outcome, BaseException):
            raise outcome
        self.tokens.append(outcome[0].token)
        return self.tokens[-1]

    def run(self, n: int) -> list[int]:
        while len(self.tokens) < n:
            self.step()
        return self.tokens

    def release(self) -> None:
        self.executor.release(self.rid)


def forward_as_stage0(runner: SliceRunner, entry: StageMessage) -> tuple[dict, dict]:
    """What a genuine first stage forwards for a RUN_ENTRY: the ACTIVATION header and tensors."""
    h = entry.header
    ids = mx.array(entry.tensors["input_ids"])
    if h["phase"] == "prefill":
        hidden = runner.prefill(h["request_ids"][0], ids, sample=h.get("sample", True))
    else:
        hidden = runner.decode(h["micro_batch"], h["request_ids"], ids)
    header = {k: h[k] for k in ("nonce", "phase", "micro_batch", "request_ids", "sample")}
    return header, {"hidden": to_wire(hidden)}

