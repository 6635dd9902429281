"""Every authorization rule of the stage protocol, attacked by a rogue member that holds the secret.

The rules are the reference's "Command and reply authorization" (issue 7, Deliver item 4). Each
test runs in-process over real transports on loopback addresses (coordinator 127.0.0.2, stages
127.0.0.3 and .4, the rogue 127.0.0.9), asserts the refusal, and then that nothing changed: the
stages still hold (or never got) the sequence and a later legitimate step gives the right tokens.

Three pipelines of the 4-layer tiny llama (layers 0-1 and 2-3):

- ``strict``: coordinator configured at 127.0.0.2:P, two real stages, a real PipelineExecutor;
- ``wildcard``: coordinator configured at 0.0.0.0:P, so "alice" (the real executor on 127.0.0.2:P)
  and "mallory" (the rogue on 127.0.0.9:P) both pass the coordinator check;
- ``scripted``: the real executor and last stage, with the first stage played by the test (a
  ``Peer`` at stage 0's address that forwards genuine or crafted activations by hand), so the
  coordinator's side can be attacked with exchanges whose genuine result has not come yet.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.wire import Kind
from mlxcel.engine.executor import ExecutorError, LocalExecutor, Step, slice_runner
from mlxcel.engine.sampling import SamplingParams
from mlxcel.error_codes import ErrorCode
from mlxcel.topology.cluster_config import ClusterConfig
from mlxcel.pipeline.coordinator import PipelineExecutor
from mlxcel.pipeline.params import params_to_wire
from mlxcel.pipeline.protocol import ENVELOPE, MsgType, StageMessage, encode, new_nonce
from mlxcel.models.facts import model_facts
from mlxcel.pipeline.stage import StageService
from tests.pipeline.members import (
    COORDINATOR_IP,
    LAYERS,
    MAX_ROWS,
    ROGUE_IP,
    STAGE_IPS,
    GreedyRun,
    Peer,
    Pending,
    Tap,
    answer_as_stage,
    cluster_config,
    forward_as_stage0,
    free_port,
    stage_state,
    start_coordinator,
    start_stage,
    wait_until,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.proc]

PROMPT = [1, 40, 41, 42, 43]
N = 5  # tokens per sequence: prefill + 4 decode steps
EXCHANGE_S = 5.0  # real stages answer in milliseconds; nothing here should ever wait this long
SCRIPTED_EXCHANGE_S = 2.0  # the scripted pipeline's deadline (one test waits it out)
AT_ONCE_S = 1.0  # "fails at once": well before the deadline
SETTLE_S = 0.15  # after a barrier, how long a late (wrong) message gets to show up
HIDDEN = 64  # the tiny llama's width
VOCAB = 320
GREEDY = params_to_wire(SamplingParams(), 0)

_rids = iter(range(10**6))


def rid(tag: str) -> str:
    return f"{tag}-{next(_rids)}"


def hidden(rows: int = 1, n: int = 1, width: int = HIDDEN, dtype: str = "float32") -> dict[str, Any]:
    return {"hidden": (dtype, np.zeros((rows, n, width), dtype=np.float32))}


# dtype codes of a step header's tensor descriptor (docs/pipeline.md §3.4.1)
INT32, UINT32, FLOAT32, FLOAT16 = 1, 2, 3, 4
SEVEN = np.array([[7]], dtype="<i4").tobytes()  # the data of input_ids [[7]]


def raw_step(mtype: MsgType, header: dict, *, phase: int | None = None, flags: int | None = None,
             micro_batch: int | None = None, ids: list[bytes] | None = None, rows: int | None = None,
             tail: bytes = b"", data: bytes = b"") -> bytes:
    """A step message built byte by byte (docs/pipeline.md §3.4.1) from a field dict, with any field
    overridden by a value ``encode`` would never produce; ``tail`` follows the request ids (a tensor
    descriptor, or a RUN_RESULT's result) and ``data`` the header."""
    ids = [r.encode() for r in header["request_ids"]] if ids is None else ids
    body = struct.pack(">8sBBBB", bytes.fromhex(header["nonce"]),
                       ("prefill", "decode").index(header["phase"]) if phase is None else phase,
                       int(header.get("sample", True)) if flags is None else flags,
                       header.get("micro_batch", 0) if micro_batch is None else micro_batch,
                       len(ids) if rows is None else rows)
    body += b"".join(bytes([len(i)]) + i for i in ids) + tail
    return ENVELOPE.pack(int(mtype), len(body)) + body + data


def descriptor(code: int, *dims: int) -> bytes:
    """A step header's tensor descriptor: u8 dtype code, u8 rank, rank x u32 dimensions."""
    return struct.pack(">BB", code, len(dims)) + b"".join(struct.pack(">I", d) for d in dims)


Build = Callable[[MsgType, dict], bytes]  # (message type, the step's field dict) -> the payload sent


def encoded(tensors: dict | None = None, **overrides: Any) -> Build:
    """A step ``encode`` can express: the field dict with ``overrides``, and ``tensors``."""
    return lambda mtype, h: encode(mtype, {**h, **overrides}, tensors)


def crafted(**fields: Any) -> Build:
    """A step ``encode`` cannot express, built byte by byte (``raw_step``'s overrides)."""
    return lambda mtype, h: raw_step(mtype, h, **fields)


def codes(received: list[tuple[PeerId, StageMessage]]) -> list[str]:
    """The ERROR codes received, by name (the wire carries the integer value)."""
    return [code_name(m.header.get("code")) for _, m in received if m.type is MsgType.ERROR]


def code_name(value: object) -> str:
    assert type(value) is int, f"an ERROR code is a JSON integer, got {value!r}"
    return ErrorCode(value).wire_name


# -- fixtures --------------------------------------------------------------------------------------


@dataclass
class Pipeline:
    config: ClusterConfig
    coordinator: PipelineExecutor
    tap: Tap
    stages: list[Any]  # StageService, or a scripted Peer
    shutdowns: list[int] = field(default_factory=list)
    extra: list[Any] = field(default_factory=list)

    def addr(self, i: int) -> PeerId:
        return self.config.stages[i].address

    def real(self) -> list[StageService]:
        return [s for s in self.stages if isinstance(s, StageService)]

    def close(self) -> None:
        self.coordinator.close()
        for node in [*self.stages, *self.extra]:
            node.close()


@pytest.fixture(scope="module")
def model(tiny_llama):
    from mlxcel.models.loading import load_checkpoint

    return load_checkpoint(tiny_llama).model


@pytest.fixture(scope="module")
def facts(tiny_llama):
    f = model_facts(tiny_llama)
    assert (f.hidden_size, f.vocab_size) == (HIDDEN, VOCAB)
    return f


@pytest.fixture(scope="module")
def expected(model) -> list[int]:
    """The whole model's greedy tokens for PROMPT, in this process."""
    return GreedyRun(LocalExecutor(model, max_batch_size=MAX_ROWS), "reference", PROMPT).run(N)


def _stage_addrs() -> list[str]:
    return [f"{ip}:{free_port(ip)}" for ip in STAGE_IPS]


def _real_pipeline(model, facts, stage_config: ClusterConfig, coordinator_config: ClusterConfig) -> Pipeline:
    shutdowns: list[int] = []
    stages = [start_stage(stage_config, i, slice_runner(model, a, b, max_rows=MAX_ROWS), facts, shutdowns)
              for i, (a, b) in enumerate(LAYERS)]
    try:
        coordinator, tap = start_coordinator(coordinator_config, facts)
    except BaseException:
        for s in stages:
            s.close()
        raise
    return Pipeline(stage_config, coordinator, tap, stages, shutdowns)


@pytest.fixture(scope="module")
def strict(model, facts) -> Iterator[Pipeline]:
    port = free_port(COORDINATOR_IP, ROGUE_IP)
    config = cluster_config(f"{COORDINATOR_IP}:{port}", _stage_addrs(), exchange_s=EXCHANGE_S)
    p = _real_pipeline(model, facts, config, config)
    yield p
    p.close()


@pytest.fixture(scope="module")
def wildcard(model, facts) -> Iterator[Pipeline]:
    """Stages told the coordinator is 0.0.0.0:P; the executor (alice) listens on 127.0.0.2:P, mallory on 127.0.0.9:P."""
    port = free_port(COORDINATOR_IP, ROGUE_IP)
    addrs = _stage_addrs()
    stage_config = cluster_config(f"0.0.0.0:{port}", addrs, exchange_s=EXCHANGE_S)
    alice_config = cluster_config(f"{COORDINATOR_IP}:{port}", addrs, exchange_s=EXCHANGE_S)
    p = _real_pipeline(model, facts, stage_config, alice_config)
    p.extra.append(Peer(f"{ROGUE_IP}:{port}"))
    yield p
    p.close()


@pytest.fixture(scope="module")
def scripted(model, facts) -> Iterator[Pipeline]:
    """Stage 0 is a Peer the test drives (it answers GET_STATE and PREPARE); stage 1 and the executor are real."""
    config = cluster_config(f"{COORDINATOR_IP}:{free_port(COORDINATOR_IP)}", _stage_addrs(),
                            exchange_s=SCRIPTED_EXCHANGE_S)
    first = Peer(str(config.stages[0].address), answer=answer_as_stage(stage_state(config, 0, facts)))
    last = start_stage(config, 1, slice_runner(model, *LAYERS[1], max_rows=MAX_ROWS), facts)
    try:
        coordinator, tap = start_coordinator(config, facts)
    except BaseException:
        first.close()
        last.close()
        raise
    p = Pipeline(config, coordinator, tap, [first, last])
    p.extra.append(slice_runner(model, *LAYERS[0], max_rows=MAX_ROWS))  # the scripted stage's genuine compute
    yield p
    p.extra.pop().release_all()
    p.close()


@pytest.fixture
def rogue() -> Iterator[Peer]:
    peer = Peer(f"{ROGUE_IP}:0")
    yield peer
    peer.close()


# -- the strict pipeline: who may send commands and activations -------------------------------------


def start_victim(p: Pipeline, expected: list[int], tokens: int = 2) -> GreedyRun:
    """A sequence of the coordinator, prefilled and decoding (its rows sit in micro-batch 0)."""
    run = GreedyRun(p.coordinator, rid("victim"), PROMPT)
    assert run.run(tokens) == expected[:tokens]
    return run


def finish_victim(p: Pipeline, run: GreedyRun, expected: list[int]) -> None:
    """The victim's remaining steps give the whole model's tokens: nothing an attacker sent changed its caches."""
    assert all(run.rid in s.runner for s in p.real())
    assert run.run(N) == expected
    run.release()
    assert wait_until(lambda: all(run.rid not in s.runner for s in p.real()))


def _command(mtype: MsgType, victim: str) -> tuple[dict, dict | None, tuple[int, ...]]:
    """(header, tensors, stages to send it to) of a command aimed at the victim's sequence."""
    if mtype is MsgType.PREPARE:
        return {"request_id": victim, "params": GREEDY}, None, (0, 1)
    if mtype is MsgType.RUN_ENTRY:
        return ({"phase": "decode", "micro_batch": 0, "request_ids": [victim], "sample": True},
                {"input_ids": ("int32", np.array([[7]], dtype=np.int32))}, (0,))
    if mtype in (MsgType.CANCEL, MsgType.RELEASE):
        return {"request_id": victim}, None, (0, 1)
    return {}, None, (0, 1)


COMMANDS = [MsgType.PREPARE, MsgType.RUN_ENTRY, MsgType.CANCEL, MsgType.RELEASE, MsgType.BEGIN_DRAIN,
            MsgType.SHUTDOWN, MsgType.GET_STATE, MsgType.RELOCATE]


@pytest.mark.parametrize("where", ["rogue", "rogue on the coordinator's port", "the last stage"])
@pytest.mark.parametrize("mtype", COMMANDS, ids=lambda t: t.name)
def test_commands_only_from_the_coordinator(strict, expected, mtype, where):
    """A command from any identity but the configured coordinator's is answered 'unauthorized' and changes nothing.

    The last stage is a member holding the secret but not the coordinator; its replies are dropped
    by its own handler, so for it only the unchanged state is checked.
    """
    rogue = None
    if where != "the last stage":
        rogue = Peer(f"{ROGUE_IP}:{0 if where == 'rogue' else strict.config.coordinator.address.port}")

    def send(i: int, mtype: MsgType, header: dict, tensors: dict | None = None) -> None:
        payload = encode(mtype, header, tensors)
        sender = strict.stages[1].transport if rogue is None else rogue.transport
        sender.send(strict.addr(i), Kind.TENSOR_DATA, payload)
    try:
        victim = start_victim(strict, expected)
        steps = [s.steps for s in strict.stages]
        fresh = rid("fresh")
        header, tensors, targets = _command(mtype, victim.rid)
        targets = (0,) if rogue is None else targets
        sent = {new_nonce(): i for i in targets}  # nonce -> the stage it went to
        for nonce, i in sent.items():
            send(i, mtype, {**header, "nonce": nonce}, tensors)
        if mtype is MsgType.PREPARE:
            nonce = new_nonce()
            sent[nonce] = 0
            send(0, mtype, {"request_id": fresh, "params": GREEDY, "nonce": nonce})
        for nonce, i in sent.items() if rogue is not None else ():
            sender, m = rogue.wait_for(lambda p, m, n=nonce: m.nonce == n)
            assert sender == strict.addr(i) and m.type is MsgType.ERROR, (sender, m)
            assert code_name(m.header["code"]) == "unauthorized" and "only from the coordinator" in m.header["message"]
        finish_victim(strict, victim, expected)  # queued behind anything the commands would have queued
        assert [s.steps for s in strict.stages] == [n + N - 2 for n in steps]
        assert all(fresh not in s.runner for s in strict.stages)
        time.sleep(SETTLE_S)
        assert strict.shutdowns == [] and not any(s.draining for s in strict.stages)
        if rogue is not None:
            assert {m.type for _, m in rogue.received} == {MsgType.ERROR}, rogue.received
    finally:
        if rogue is not None:
            rogue.close()


@pytest.mark.parametrize("header", [{"node_id": "stage-9", "address": "127.0.0.9:1"},
                                    {"node_id": "stage-1", "address": "127.0.0.9:1"},
                                    {"node_id": "stage-0", "address": "0.0.0.0:1"},
                                    {"node_id": "stage-0", "address": "127.0.0.9"}, {"node_id": "stage-0"}],
                         ids=["unknown stage", "itself", "unspecified IP", "no port", "no address"])
def test_relocate_is_checked_and_changes_nothing_when_refused(strict, expected, header):
    """RELOCATE (docs/pipeline.md §5.7) must name another stage and a numeric ip:port; else bad_request."""
    with pytest.raises(ExecutorError, match="bad_request.*RELOCATE"):
        strict.coordinator.command(strict.addr(1), MsgType.RELOCATE, header)
    assert strict.stages[1].upstream == strict.addr(0)
    finish_victim(strict, start_victim(strict, expected), expected)


def test_relocate_moves_where_activations_come_from_and_go(strict, expected, rogue):
    """After RELOCATE the last stage takes activations only from the new address, the first sends them there."""
    try:
        strict.coordinator.command(strict.addr(1), MsgType.RELOCATE, {"node_id": "stage-0", "address": str(rogue.identity)})
        strict.coordinator.command(strict.addr(0), MsgType.RELOCATE, {"node_id": "stage-1", "address": str(rogue.identity)})
        assert strict.stages[1].upstream == rogue.identity and strict.stages[0].downstream == rogue.identity
        victim = rid("moved")
        strict.coordinator.prepare(victim, SamplingParams(), 0, PROMPT)
        ex = strict.coordinator.exchanges.open(EXCHANGE_S, senders=strict.coordinator.stage_addrs)
        header = {"nonce": ex.nonce, "phase": "prefill", "micro_batch": 0, "request_ids": [strict.coordinator._wire_ids([victim])[0]],
                  "sample": True}
        ids = np.array([PROMPT], dtype=np.int32)
        strict.coordinator.transport.send(strict.addr(0), Kind.TENSOR_DATA,
                                          encode(MsgType.RUN_ENTRY, header, {"input_ids": ("int32", ids)}))
        sender, m = rogue.wait_for(lambda p, m: m.type is MsgType.ACTIVATION)  # stage 0 forwards to the new address
        assert sender == strict.addr(0) and m.nonce == ex.nonce
        strict.stages[0].transport.send(strict.addr(1), Kind.TENSOR_DATA, encode(MsgType.ACTIVATION, m.header, hidden(1, len(PROMPT))))
        time.sleep(SETTLE_S)
        assert strict.tap.about(ex.nonce) == []  # the old upstream's activation is dropped now
        strict.coordinator.release(victim)
    finally:
        for i, j in ((1, 0), (0, 1)):
            strict.coordinator.command(strict.addr(i), MsgType.RELOCATE, {"node_id": f"stage-{j}", "address": str(strict.addr(j))})
    finish_victim(strict, start_victim(strict, expected), expected)


ACTIVATION_SENDERS = {
    "rogue to the last stage": ("rogue", 1),
    "rogue to the first stage": ("rogue", 0),
    "coordinator to the last stage": ("coordinator", 1),
    "reverse: last stage to the first": ("stage-1", 0),
    "first stage to itself": ("stage-0", 0),
}


@pytest.mark.parametrize("case", list(ACTIVATION_SENDERS))
def test_activations_only_from_the_upstream_stage(strict, expected, rogue, case):
    """An activation from anyone but the upstream stage is dropped: no RUN_RESULT, no ERROR, no step."""
    who, target = ACTIVATION_SENDERS[case]
    victim = start_victim(strict, expected)
    steps = [s.steps for s in strict.stages]
    forged = new_nonce()
    header = {"nonce": forged, "phase": "decode", "micro_batch": 0, "request_ids": [victim.rid], "sample": True}
    payload = encode(MsgType.ACTIVATION, header, hidden())
    if who == "rogue":
        rogue.send_raw(strict.addr(target), payload)
    elif who == "coordinator":
        strict.coordinator.transport.send(strict.addr(target), Kind.TENSOR_DATA, payload)
    else:
        strict.stages[int(who[-1])].transport.send(strict.addr(target), Kind.TENSOR_DATA, payload)
    finish_victim(strict, victim, expected)  # its steps queue behind whatever the forged frame caused
    time.sleep(SETTLE_S)
    assert [s.steps for s in strict.stages] == [n + N - 2 for n in steps]
    assert strict.tap.about(forged) == [] and rogue.about(forged) == []


def test_replies_go_to_the_authenticated_source_not_to_a_named_address(strict, expected, rogue):
    """A 'reply_to'/'owner' field in a header is ignored: ACK, RUN_RESULT and ERROR all go to the sender.

    The JSON commands carry the decoy fields; a step's binary header has no room for them (``encode``
    writes only its fixed fields), so for the steps the check is that the results follow the sender.
    """
    coord = strict.coordinator
    r = rid("named")
    nonces = {"run": new_nonce(), "bad": new_nonce()}
    decoy = {"reply_to": str(rogue.identity), "owner": str(rogue.identity), "coordinator": str(rogue.identity)}

    def send(i: int, mtype: MsgType, header: dict, tensors: dict | None = None) -> None:
        coord.transport.send(strict.addr(i), Kind.TENSOR_DATA, encode(mtype, {**header, **decoy}, tensors))

    for i in (0, 1):
        send(i, MsgType.PREPARE, {"request_id": r, "params": GREEDY, "nonce": f"prep{i}"})
    for i in (0, 1):
        assert wait_until(lambda i=i: [m.type for _, m in strict.tap.about(f"prep{i}")] == [MsgType.ACK])
    ids = {"input_ids": ("int32", np.array([PROMPT], dtype=np.int32))}
    send(0, MsgType.RUN_ENTRY, {"nonce": nonces["run"], "phase": "prefill", "micro_batch": 0, "request_ids": [r],
                                "sample": True}, ids)
    assert wait_until(lambda: strict.tap.about(nonces["run"]))
    (sender, result), = strict.tap.about(nonces["run"])
    assert sender == strict.addr(1) and result.type is MsgType.RUN_RESULT and result.header["tokens"] == expected[:1]
    bad = {"input_ids": ("int32", np.array([[VOCAB]], dtype=np.int32))}
    send(0, MsgType.RUN_ENTRY, {"nonce": nonces["bad"], "phase": "decode", "micro_batch": 0, "request_ids": [r]}, bad)
    assert wait_until(lambda: strict.tap.about(nonces["bad"]))
    assert codes(strict.tap.about(nonces["bad"])) == ["bad_tensor"]
    for i in (0, 1):
        send(i, MsgType.RELEASE, {"request_id": r, "nonce": f"rel{i}"})
    assert wait_until(lambda: all(r not in s.runner for s in strict.stages))
    time.sleep(SETTLE_S)
    assert rogue.received == []


def test_a_step_for_a_request_nobody_prepared_is_refused(strict, rogue):
    """RUN_ENTRY for an id that was never prepared: ERROR unknown_request, and the stages hold nothing under it."""
    nonce, r = new_nonce(), rid("unprepared")
    entry = {"nonce": nonce, "phase": "prefill", "micro_batch": 0, "request_ids": [r], "sample": True}
    ids = {"input_ids": ("int32", np.array([PROMPT], dtype=np.int32))}
    strict.coordinator.transport.send(strict.addr(0), Kind.TENSOR_DATA, encode(MsgType.RUN_ENTRY, entry, ids))
    assert wait_until(lambda: strict.tap.about(nonce))
    assert codes(strict.tap.about(nonce)) == ["not_found"]
    assert all(r not in s.runner for s in strict.stages)


def test_the_coordinator_may_drain_and_shut_a_stage_down(model, facts):
    """The positive control of the rogue tests: the same BEGIN_DRAIN and SHUTDOWN from the coordinator's identity work."""
    config = cluster_config(f"{COORDINATOR_IP}:{free_port(COORDINATOR_IP)}", _stage_addrs(), exchange_s=EXCHANGE_S)
    shutdowns: list[int] = []
    stage = start_stage(config, 1, slice_runner(model, *LAYERS[1], max_rows=MAX_ROWS), facts, shutdowns)
    coordinator = Peer(str(config.coordinator.address))
    try:
        def ask(mtype: MsgType, header: dict) -> StageMessage:
            nonce = rid("ctl")
            coordinator.send(config.stages[1].address, mtype, {**header, "nonce": nonce})
            return coordinator.wait_for(lambda p, m: m.nonce == nonce)[1]

        assert ask(MsgType.PREPARE, {"request_id": "before", "params": GREEDY}).type is MsgType.ACK
        assert ask(MsgType.BEGIN_DRAIN, {}).type is MsgType.ACK and stage.draining
        refused = ask(MsgType.PREPARE, {"request_id": "after", "params": GREEDY})
        assert refused.type is MsgType.ERROR and code_name(refused.header["code"]) == "unavailable"
        assert ask(MsgType.SHUTDOWN, {}).type is MsgType.ACK
        assert wait_until(lambda: shutdowns == [1])
    finally:
        coordinator.close()
        stage.close()


def test_a_prepare_refused_by_one_stage_is_released_on_the_others(strict, expected):
    """Stage 1 draining refuses the PREPARE that stage 0 acknowledged: the request fails, and stage 0 does not
    keep the sequence it allocated (the coordinator releases it); once stage 1 takes work again, all is well."""
    last, half = strict.stages[1], rid("half")
    last.draining = True  # as BEGIN_DRAIN sets it (the positive control below sends the command itself)
    try:
        with pytest.raises(ExecutorError) as refused:
            strict.coordinator.prepare(half, SamplingParams(), 0, PROMPT)
    finally:
        last.draining = False
    assert refused.value.peer_code is ErrorCode.UNAVAILABLE, refused.value
    assert wait_until(lambda: all(half not in s.runner for s in strict.real()))
    run = GreedyRun(strict.coordinator, rid("after-half"), PROMPT)
    assert run.run(N) == expected
    run.release()


# -- the strict pipeline: tensor bounds on RUN_ENTRY --------------------------------------------------

I32 = np.int32


def _ids(arr: np.ndarray, dtype: str = "int32") -> dict:
    return {"input_ids": (dtype, arr)}


# name -> (the payload, rows to prepare, the ERROR code answered; None: dropped without a reply)
ENTRY_BOUNDS: dict[str, tuple[Build, int, str | None]] = {
    "ids float32": (encoded({"input_ids": ("float32", np.array([[7]], dtype=np.float32))}), 1, "bad_tensor"),
    "ids rank 1": (encoded(_ids(np.array([7], dtype=I32))), 1, "bad_tensor"),
    "ids rank 3": (encoded(_ids(np.array([[[7]]], dtype=I32))), 1, "bad_tensor"),
    "ids rank 4": (crafted(tail=descriptor(INT32, 1, 1, 1, 1), data=SEVEN), 1, "bad_tensor"),
    "ids rank 0": (crafted(tail=descriptor(INT32)), 1, "bad_tensor"),
    # int8, q4 and the rest have no dtype code: any code but 1-5 is refused
    "ids int8 (dtype code 6)": (crafted(tail=descriptor(6, 1, 1), data=b"\x07"), 1, "bad_tensor"),
    "ids q4 (dtype code 7)": (crafted(tail=descriptor(7, 1, 2), data=b"\x07"), 1, "bad_tensor"),
    "ids of dtype code 0": (crafted(tail=descriptor(0, 1, 1), data=bytes(8)), 1, "bad_tensor"),
    "ids of dtype code 255": (crafted(tail=descriptor(255, 1, 1), data=bytes(8)), 1, "bad_tensor"),
    "claims 2**21 positions": (crafted(tail=descriptor(INT32, 1, 2**21), data=bytes(4)), 1, "bad_tensor"),
    "a dimension over 2**26": (crafted(tail=descriptor(INT32, 1, 2**26 + 1), data=bytes(4)), 1, "bad_tensor"),
    "a zero dimension": (crafted(tail=descriptor(INT32, 1, 0)), 1, "bad_tensor"),
    "claims more bytes than sent": (crafted(tail=descriptor(INT32, 1, 8), data=bytes(16)), 1, "bad_tensor"),
    "bytes after the tensor": (crafted(tail=descriptor(INT32, 1, 1), data=bytes(8)), 1, "bad_tensor"),
    "rows != request ids": (encoded(_ids(np.array([[7], [8]], dtype=I32))), 1, "bad_tensor"),
    "more rows than max_batch_size": (encoded(_ids(np.full((MAX_ROWS + 1, 1), 7, dtype=I32))), MAX_ROWS + 1,
                                      "bad_tensor"),
    "decode with n=2": (encoded(_ids(np.array([[7, 8]], dtype=I32))), 1, "bad_tensor"),
    "prefill of 2 rows": (encoded(_ids(np.array([[7], [8]], dtype=I32)), phase="prefill"), 2, "bad_tensor"),
    "id == vocab_size": (encoded(_ids(np.array([[VOCAB]], dtype=I32))), 1, "bad_tensor"),
    "negative id": (encoded(_ids(np.array([[-1]], dtype=I32))), 1, "bad_tensor"),
    "uint32 id 2**32 - 1": (encoded(_ids(np.array([[2**32 - 1]], dtype=np.uint32), "uint32")), 1, "bad_tensor"),
    # the tensor's name is implied by the message type: a RUN_ENTRY's one tensor is input_ids
    "a hidden tensor as input_ids": (encoded({"hidden": ("float32", np.zeros((1, 1, HIDDEN), dtype=np.float32))}), 1,
                                     "bad_tensor"),
    # the binary header itself is cut or overlong once its ids decoded: bad_request, not bad_tensor (§3.2)
    "no tensor descriptor": (crafted(), 1, "bad_request"),
    "dimensions cut short": (crafted(tail=descriptor(INT32, 1, 1)[:-2]), 1, "bad_request"),
    "a header longer than its fields": (crafted(tail=descriptor(INT32, 1, 1) + b"\x00", data=SEVEN), 1, "bad_request"),
    # the fixed fields or the ids do not decode: past the 12 fixed bytes the nonce is known, so the stage
    # answers the coordinator bad_request at once (docs/pipeline.md §3.2) and the step fails now, not at
    # its deadline; no other field of it is ever used
    "unknown phase (byte 7)": (crafted(phase=7, tail=descriptor(INT32, 1, 1), data=SEVEN), 1, "bad_request"),
    "an unknown flag bit (sample not a boolean)": (crafted(flags=0x03, tail=descriptor(INT32, 1, 1), data=SEVEN), 1,
                                                   "bad_request"),
    "micro_batch 64": (crafted(micro_batch=64, tail=descriptor(INT32, 1, 1), data=SEVEN), 1, "bad_request"),
    "micro_batch 255": (crafted(micro_batch=255, tail=descriptor(INT32, 1, 1), data=SEVEN), 1, "bad_request"),
    "no request ids (0 rows)": (crafted(ids=[], tail=descriptor(INT32, 1, 1), data=SEVEN), 1, "bad_request"),
    "more ids claimed than sent": (crafted(rows=2), 1, "bad_request"),  # the header ends where the second id should be
    "an empty request id": (crafted(ids=[b""], tail=descriptor(INT32, 1, 1), data=SEVEN), 1, "bad_request"),
    "a 129-byte request id": (crafted(ids=[b"r" * 129], tail=descriptor(INT32, 1, 1), data=SEVEN), 1, "bad_request"),
    "a request id that is not UTF-8": (crafted(ids=[b"\xff\xfe"], tail=descriptor(INT32, 1, 1), data=SEVEN), 1, "bad_request"),
    "a request id twice": (lambda mtype, h: raw_step(mtype, h, ids=[h["request_ids"][0].encode()] * 2,
                                                     tail=descriptor(INT32, 2, 1), data=SEVEN * 2), 1, "bad_request"),
}


@pytest.mark.parametrize("case", list(ENTRY_BOUNDS))
def test_run_entry_tensor_bounds(strict, expected, rogue, case):
    """A RUN_ENTRY outside the bounds gets ERROR (with its nonce) back to the coordinator; nothing runs."""
    build, rows, code = ENTRY_BOUNDS[case]
    victim = start_victim(strict, expected)
    others = [GreedyRun(strict.coordinator, rid("row"), PROMPT) for _ in range(rows - 1)]
    steps = [s.steps for s in strict.stages]
    nonce = new_nonce()
    header = {"nonce": nonce, "phase": "decode", "micro_batch": 0,
              "request_ids": [victim.rid, *(o.rid for o in others)], "sample": True}
    strict.coordinator.transport.send(strict.addr(0), Kind.TENSOR_DATA, build(MsgType.RUN_ENTRY, header))
    if code is not None:
        assert wait_until(lambda: strict.tap.about(nonce)), "no answer to a RUN_ENTRY outside the bounds"
        (sender, m), = strict.tap.about(nonce)
        assert sender == strict.addr(0) and m.type is MsgType.ERROR and code_name(m.header["code"]) == code, m.header
    for o in others:
        o.release()
    finish_victim(strict, victim, expected)  # its steps reach stage 0 behind the refused one, on the same connection
    time.sleep(SETTLE_S)
    assert codes(strict.tap.about(nonce)) == ([] if code is None else [code])
    assert [s.steps for s in strict.stages] == [n + N - 2 for n in steps]
    assert rogue.received == []


@pytest.mark.parametrize("bad", ["é" * 65, "é" * 100, "r" * 129, "\ud800", ""], ids=["65 é", "100 é", "129 r", "surrogate", "empty"])
def test_request_ids_are_bounded_in_utf8_bytes(strict, expected, bad):
    """An id is 1 to 128 UTF-8 bytes everywhere: a PREPARE the step header could never name is refused
    (100 'é' is 200 bytes), and the longest id it can name, 64 'é', runs (issue 21, docs finding)."""
    for i in (0, 1):
        with pytest.raises(ExecutorError) as refused:
            strict.coordinator.command(strict.addr(i), MsgType.PREPARE, {"request_id": bad, "params": GREEDY}, timeout=3)
        assert refused.value.peer_code is ErrorCode.BAD_REQUEST and "128 UTF-8 bytes" in str(refused.value)
    assert all(bad not in s.runner for s in strict.stages)
    run = GreedyRun(strict.coordinator, "é" * 64, PROMPT)
    assert run.run(N) == expected
    run.release()


STEP_BOUNDS = {
    "id outside the vocabulary": lambda r: Step("prefill", [r], [[1, VOCAB + 3]]),
    "decode of 2 positions": lambda r: Step("decode", [r], [[1, 2]], slot=0),
    "more rows than request ids": lambda r: Step("decode", [r], [[1], [2]], slot=0),
}


@pytest.mark.parametrize("case", list(STEP_BOUNDS))
def test_a_refused_step_fails_the_request_at_once(strict, expected, case):
    """Through the executor's own API: the stage's ERROR carries the nonce, so the step fails long before its deadline."""
    run = GreedyRun(strict.coordinator, rid("refused"), PROMPT)
    outcome = Pending(strict.coordinator, STEP_BOUNDS[case](run.rid))
    error = outcome.result()
    assert isinstance(error, ExecutorError) and error.peer_code is ErrorCode.BAD_TENSOR and error.code is ErrorCode.INTERNAL, error
    assert outcome.elapsed < AT_ONCE_S, outcome.elapsed
    assert run.run(N) == expected  # the refused step changed nothing
    run.release()


# -- the wildcard pipeline: the coordinator check passes, ownership still holds ----------------------


def mallory(p: Pipeline) -> Peer:
    return p.extra[0]


def test_wildcard_port_passes_the_coordinator_check(wildcard, rogue):
    """With the coordinator at 0.0.0.0:P, any IP on port P is accepted as a coordinator (GET_STATE answered),
    any other port still is not."""
    m = mallory(wildcard)
    nonce = rid("state")
    for peer in (m, rogue):
        peer.send(wildcard.addr(0), MsgType.GET_STATE, {"nonce": nonce})
    _, state = m.wait_for(lambda p, msg: msg.nonce == nonce)
    assert state.type is MsgType.STATE and state.header["node_id"] == "stage-0"
    _, refused = rogue.wait_for(lambda p, msg: msg.nonce == nonce)
    assert refused.type is MsgType.ERROR and code_name(refused.header["code"]) == "unauthorized"


@pytest.mark.parametrize("mtype", [MsgType.PREPARE, MsgType.RUN_ENTRY, MsgType.CANCEL, MsgType.RELEASE],
                         ids=lambda t: t.name)
def test_wildcard_rogue_cannot_touch_a_sequence_another_identity_prepared(wildcard, expected, mtype):
    m = mallory(wildcard)
    victim = start_victim(wildcard, expected)
    steps = [s.steps for s in wildcard.stages]
    header, tensors, targets = _command(mtype, victim.rid)
    nonces = {i: new_nonce() for i in targets}
    for i in targets:
        m.send(wildcard.addr(i), mtype, {**header, "nonce": nonces[i]}, tensors)
    for i in targets:
        _, reply = m.wait_for(lambda p, msg, i=i: msg.nonce == nonces[i])
        assert reply.type is MsgType.ERROR and code_name(reply.header["code"]) == "unauthorized", reply.header
        assert "belongs to another identity" in reply.header["message"]
    assert [s.steps for s in wildcard.stages] == steps
    finish_victim(wildcard, victim, expected)
    assert m.matching(lambda p, msg: msg.type is not MsgType.ERROR and msg.type is not MsgType.STATE) == []


def _prepare_as(peer: Peer, p: Pipeline, r: str) -> None:
    for i in (0, 1):
        peer.send(p.addr(i), MsgType.PREPARE, {"request_id": r, "params": GREEDY, "nonce": f"{r}-p{i}"})
    for i in (0, 1):
        _, ack = peer.wait_for(lambda _p, msg, i=i: msg.nonce == f"{r}-p{i}")
        assert ack.type is MsgType.ACK, ack.header


def _entry_as(peer: Peer, p: Pipeline, r: str, nonce: str, tokens: list[int], phase: str, **extra: Any) -> StageMessage:
    header = {"nonce": nonce, "phase": phase, "micro_batch": 0, "request_ids": [r], "sample": True, **extra}
    peer.send(p.addr(0), MsgType.RUN_ENTRY, header, {"input_ids": ("int32", np.array([tokens], dtype=np.int32))})
    return peer.wait_for(lambda _p, msg: msg.nonce == nonce)[1]


def test_wildcard_a_request_the_rogue_prepared_belongs_to_the_rogue(wildcard, expected):
    """Mallory owns what it prepared: its results go to it (not to an 'owner' it names), alice cannot touch it."""
    m, alice = mallory(wildcard), wildcard.coordinator
    r = rid("mallory")
    nonces = {label: new_nonce() for label in ("m-run1", "alice-run", "m-run2")}
    _prepare_as(m, wildcard, r)
    named = {"owner": str(alice.transport.identity), "reply_to": str(alice.transport.identity)}  # no room in a step
    first = _entry_as(m, wildcard, r, nonces["m-run1"], PROMPT, "prefill", **named)
    assert first.type is MsgType.RUN_RESULT and first.header["tokens"] == expected[:1]
    for i in (0, 1):
        for mtype in (MsgType.PREPARE, MsgType.CANCEL, MsgType.RELEASE):
            header = {"request_id": r, "params": GREEDY} if mtype is MsgType.PREPARE else {"request_id": r}
            with pytest.raises(ExecutorError) as refused:
                alice.command(wildcard.addr(i), mtype, header, timeout=3)
            assert refused.value.peer_code is ErrorCode.UNAUTHORIZED, refused.value
    entry = {"nonce": nonces["alice-run"], "phase": "decode", "micro_batch": 0, "request_ids": [r], "sample": True}
    alice.transport.send(wildcard.addr(0), Kind.TENSOR_DATA,
                         encode(MsgType.RUN_ENTRY, entry, {"input_ids": ("int32", np.array([[7]], dtype=np.int32))}))
    assert wait_until(lambda: wildcard.tap.about(nonces["alice-run"]))
    assert codes(wildcard.tap.about(nonces["alice-run"])) == ["unauthorized"]
    second = _entry_as(m, wildcard, r, nonces["m-run2"], expected[:1], "decode")
    assert second.type is MsgType.RUN_RESULT and second.header["tokens"] == expected[1:2]
    assert wildcard.tap.about(nonces["m-run1"]) == [] and wildcard.tap.about(nonces["m-run2"]) == []
    for i in (0, 1):
        m.send(wildcard.addr(i), MsgType.RELEASE, {"request_id": r, "nonce": f"{r}-rel"})
    assert wait_until(lambda: all(r not in s.runner for s in wildcard.stages))


def test_wildcard_rogue_cannot_evict_rows_through_a_shared_micro_batch(wildcard, expected):
    """Mallory's decode step in 'micro-batch 0' must not drop alice's rows that decode in her micro-batch 0."""
    m = mallory(wildcard)
    victim = start_victim(wildcard, expected, tokens=3)
    r = rid("evict")
    _prepare_as(m, wildcard, r)
    got = _entry_as(m, wildcard, r, new_nonce(), [7], "decode")
    assert got.type in (MsgType.RUN_RESULT, MsgType.ERROR)
    finish_victim(wildcard, victim, expected)
    for i in (0, 1):
        m.send(wildcard.addr(i), MsgType.RELEASE, {"request_id": r, "nonce": "evict-rel"})


def test_wildcard_owner_never_inherits_prefix_kv_another_identity_released(wildcard, expected):
    """Mallory computes KV from other ids and RELEASEs it under alice's prompt: alice's PREPARE of that
    prompt starts from nothing and decodes the whole model's tokens; mallory still reuses its own entry
    (issue 21, finding 2: the prefix cache is keyed by the identity that released the KV)."""
    m, alice = mallory(wildcard), wildcard.coordinator
    r = rid("seeder")
    _prepare_as(m, wildcard, r)
    seeded = _entry_as(m, wildcard, r, new_nonce(), [1, 60, 61, 62, 63], "prefill")  # not PROMPT's ids
    assert seeded.type is MsgType.RUN_RESULT, seeded.header
    before = [s.prefix.nbytes for s in wildcard.stages]
    for i in (0, 1):
        m.send(wildcard.addr(i), MsgType.RELEASE, {"request_id": r, "nonce": f"{r}-rel", "tokens": [*PROMPT, 7]})
    assert wait_until(lambda: all(s.prefix.nbytes > b and r not in s.runner for s, b in zip(wildcard.stages, before)))
    hits = alice.prefix_hits
    run = GreedyRun(alice, rid("heir"), PROMPT)
    assert alice.prefix_hits == hits, "alice started from KV that mallory stored"
    assert run.run(N) == expected
    run.release()
    own = rid("own")
    for i in (0, 1):
        m.send(wildcard.addr(i), MsgType.PREPARE, {"request_id": own, "params": GREEDY, "prompt": PROMPT,
                                                   "nonce": f"{own}-p{i}"})
    for i in (0, 1):
        _, ack = m.wait_for(lambda _p, msg, i=i: msg.nonce == f"{own}-p{i}")
        assert ack.type is MsgType.ACK and ack.header["cached"] == len(PROMPT) - 1, ack.header
        m.send(wildcard.addr(i), MsgType.RELEASE, {"request_id": own, "nonce": f"{own}-rel"})


# -- the scripted pipeline: what the coordinator accepts -------------------------------------------


@dataclass
class Exchange:
    """A step the executor submitted; ``entry`` is its RUN_ENTRY as the scripted first stage saw it."""

    pending: Pending
    entry: StageMessage

    @property
    def nonce(self) -> str:
        return self.entry.nonce


def submit(p: Pipeline, step: Step) -> Exchange:
    first: Peer = p.stages[0]
    pending = Pending(p.coordinator, step)
    _, entry = first.wait_for(lambda _p, m: m.type is MsgType.RUN_ENTRY and m.request_ids == step.rids
                              and m.header.get("phase") == step.kind and m.nonce not in _used)
    _used.add(entry.nonce)
    return Exchange(pending, entry)


_used: set[str] = set()


def forward(p: Pipeline, ex: Exchange) -> None:
    """The scripted first stage does its genuine work and forwards it to the real last stage."""
    header, tensors = forward_as_stage0(p.extra[0], ex.entry)
    p.stages[0].send(p.addr(1), MsgType.ACTIVATION, header, tensors)


@dataclass
class Scripted:
    """One sequence through the scripted pipeline (prepared on the executor and the scripted stage's runner)."""

    p: Pipeline
    rid: str

    def __post_init__(self) -> None:
        self.p.coordinator.prepare(self.rid, SamplingParams(), 0, PROMPT)
        self.p.extra[0].prepare(self.rid)

    def prefill(self) -> Exchange:
        return submit(self.p, Step("prefill", [self.rid], [PROMPT]))

    def decode(self, token: int) -> Exchange:
        return submit(self.p, Step("decode", [self.rid], [[token]], slot=0))

    def release(self) -> None:
        self.p.coordinator.release(self.rid)
        self.p.extra[0].release(self.rid)


def _sender(p: Pipeline, who: str, rogue: Peer) -> Callable[[bytes], None]:
    """Sends a payload to the coordinator as ``who``: the rogue, the scripted first stage or the real last stage."""
    me = p.coordinator.transport.identity
    if who == "rogue":
        return lambda payload: rogue.send_raw(me, payload)
    if who == "stage-0":
        return lambda payload: p.stages[0].send_raw(me, payload)
    last: StageService = p.stages[1]
    return lambda payload: last.transport.send(me, Kind.CONTROL, payload)


def _result(ex: Exchange, **changes: Any) -> dict:
    h = ex.entry.header
    return {"nonce": h["nonce"], "phase": h["phase"], "micro_batch": h["micro_batch"],
            "request_ids": h["request_ids"], "sample": True, "tokens": [7], **changes}


def answer(mtype: MsgType = MsgType.RUN_RESULT, **changes: Any) -> Callable[[Exchange], bytes]:
    """An answer ``encode`` can express: the genuine RUN_RESULT's fields with ``changes``, as ``mtype``."""
    return lambda ex: encode(mtype, _result(ex, **changes))


def crafted_result(result: bytes) -> Callable[[Exchange], bytes]:
    """A RUN_RESULT for the exchange whose result part (§3.4.1: kind, tokens...) is ``result``, byte by byte."""
    return lambda ex: raw_step(MsgType.RUN_RESULT, _result(ex), tail=result)


def u32(*values: int) -> bytes:
    return struct.pack(f">{len(values)}I", *values)


# name -> (sender, the forged payload for the exchange)
FORGED_RESULTS: dict[str, tuple[str, Callable[[Exchange], bytes]]] = {
    "RUN_RESULT from a non-member": ("rogue", answer()),
    "RUN_RESULT from the first stage": ("stage-0", answer()),
    "RUN_RESULT with an unknown nonce": ("stage-1", answer(nonce="0123456789abcdef")),
    "RUN_RESULT for other request ids": ("stage-1", answer(request_ids=["someone-else"])),
    "RUN_RESULT for more rows than the step": ("stage-1", lambda ex: encode(MsgType.RUN_RESULT, _result(
        ex, request_ids=[*ex.entry.request_ids, "someone-else"], tokens=[7, 8]))),
    "RUN_RESULT for another micro-batch": ("stage-1", answer(micro_batch=1)),
    # phase and sample are copied unchanged by every stage: a result with others is not this step's (§4.2)
    "RUN_RESULT of another phase": ("stage-1", answer(phase="decode")),
    "RUN_RESULT with sample false": ("stage-1", answer(sample=False)),
    # R x u32 tokens then the two flags: a second token leaves bytes after the header's fields (malformed)
    "RUN_RESULT with two tokens for one row": ("stage-1", crafted_result(b"\x01" + u32(7, 8) + b"\x00\x00")),
    "RUN_RESULT with no token (kind 0 for a sampling step)": ("stage-1", answer(tokens=None)),
    "RUN_RESULT with a truncated token list": ("stage-1", crafted_result(b"\x01\x00\x07")),
    "RUN_RESULT with token == vocab_size": ("stage-1", answer(tokens=[VOCAB])),
    "RUN_RESULT with token 2**32 - 1 (a negative id's bits)": ("stage-1", crafted_result(b"\x01" + u32(2**32 - 1)
                                                                                        + b"\x00\x00")),
    "RUN_RESULT of an unknown result kind": ("stage-1", crafted_result(b"\x03" + u32(7) + b"\x00\x00")),
    "RUN_RESULT with logprobs of the wrong length": ("stage-1", crafted_result(b"\x01" + u32(7) + b"\x01"
                                                                               + struct.pack(">2f", 0, 0) + b"\x00")),
    "RUN_RESULT with a logprobs flag of 2": ("stage-1", crafted_result(b"\x01" + u32(7) + b"\x02" + bytes(4)
                                                                       + b"\x00")),
    "RUN_RESULT with 21 top_logprobs": ("stage-1", crafted_result(b"\x01" + u32(7) + b"\x00\x01\x15" + bytes(8 * 21))),
    "RUN_RESULT with logits for a token return": ("stage-1", lambda ex: encode(
        MsgType.RUN_RESULT, _result(ex, tokens=None), {"logits": ("float32", np.zeros((1, VOCAB), np.float32))})),
    "ERROR for the step from a non-member": ("rogue", answer(MsgType.ERROR, code=1, message="x")),
    "ACK for the step from the last stage": ("stage-1", answer(MsgType.ACK)),
    "STATE for the step from the last stage": ("stage-1", answer(MsgType.STATE)),
}


@pytest.mark.parametrize("case", list(FORGED_RESULTS))
def test_coordinator_accepts_a_result_only_from_the_last_stage_for_its_exchange(scripted, expected, rogue, case):
    """Forged answers are dropped while the exchange keeps waiting; the genuine result then completes it."""
    who, forge = FORGED_RESULTS[case]
    seq = Scripted(scripted, rid("forged"))
    ex = seq.prefill()
    forged = forge(ex)
    _sender(scripted, who, rogue)(forged)
    assert wait_until(lambda: scripted.tap.handled(forged))
    time.sleep(SETTLE_S)
    assert not ex.pending.done, ex.pending.outcomes
    forward(scripted, ex)
    outcome = ex.pending.result()
    assert not isinstance(outcome, BaseException), outcome
    assert [s.token for s in outcome] == expected[:1] and len(ex.pending.outcomes) == 1
    seq.release()


def test_a_replayed_run_result_is_refused(scripted, expected):
    """The nonce is single-use: the last stage's genuine RUN_RESULT, sent again, completes nothing."""
    seq = Scripted(scripted, rid("replay"))
    first = seq.prefill()
    forward(scripted, first)
    assert [s.token for s in first.pending.result()] == expected[:1]
    captured = scripted.tap.raw(MsgType.RUN_RESULT, first.nonce)
    second = seq.decode(expected[0])
    last: StageService = scripted.stages[1]
    last.transport.send(scripted.coordinator.transport.identity, Kind.CONTROL, captured)
    assert wait_until(lambda: len(scripted.tap.about(first.nonce)) == 2)
    time.sleep(SETTLE_S)
    assert not second.pending.done and len(first.pending.outcomes) == 1
    forward(scripted, second)
    assert [s.token for s in second.pending.result()] == expected[1:2]
    seq.release()


REPLY_FORGERIES = [("stage-1", MsgType.ACK), ("stage-1", MsgType.STATE), ("stage-1", MsgType.ERROR),
                   ("rogue", MsgType.ACK), ("rogue", MsgType.ERROR), ("stage-0", MsgType.RUN_RESULT)]


@pytest.mark.parametrize("who,mtype", REPLY_FORGERIES, ids=lambda x: getattr(x, "name", x))
def test_coordinator_accepts_a_reply_only_from_the_addressed_stage(scripted, rogue, who, mtype):
    """An ACK/STATE/ERROR for a command from a node that was not addressed is dropped; the addressee's answer counts."""
    import threading

    first: Peer = scripted.stages[0]
    r = rid("cmd")
    box: list[Any] = []
    waiter = threading.Thread(target=lambda: box.append(
        scripted.coordinator.command(scripted.addr(0), MsgType.CANCEL, {"request_id": r}, timeout=5)))
    waiter.start()
    _, cmd = first.wait_for(lambda _p, m: m.type is MsgType.CANCEL and m.header.get("request_id") == r)
    header = {"nonce": cmd.nonce}
    if mtype is MsgType.ERROR:
        header.update(code=3, message="forged")
    elif mtype is MsgType.RUN_RESULT:  # a well-formed step answer, under the command's nonce
        header.update(phase="decode", micro_batch=0, request_ids=[r], sample=True, tokens=[7])
    _sender(scripted, who, rogue)(encode(mtype, header))
    assert wait_until(lambda: scripted.tap.about(cmd.nonce))
    time.sleep(SETTLE_S)
    assert waiter.is_alive() and box == []
    first.send(scripted.coordinator.transport.identity, MsgType.ACK, {"nonce": cmd.nonce})
    waiter.join(5)
    assert len(box) == 1 and box[0].type is MsgType.ACK


ONE_ROW, ONE_ROW_DATA = descriptor(FLOAT32, 1, 1, HIDDEN), bytes(4 * HIDDEN)  # a well-formed hidden [1, 1, 64]
# name -> (the payload, rows, the ERROR code the owner gets)
HIDDEN_BOUNDS: dict[str, tuple[Build, int, str]] = {
    "hidden of the wrong width": (encoded(hidden(width=HIDDEN - 1)), 1, "bad_tensor"),
    "hidden rank 2": (encoded({"hidden": ("float32", np.zeros((1, HIDDEN), dtype=np.float32))}), 1, "bad_tensor"),
    "hidden rank 4": (crafted(tail=descriptor(FLOAT32, 1, 1, 1, HIDDEN), data=bytes(4 * HIDDEN)), 1, "bad_tensor"),
    "hidden int32": (encoded({"hidden": ("int32", np.zeros((1, 1, HIDDEN), dtype=np.int32))}), 1, "bad_tensor"),
    # quantized and compressed activations have no dtype code: any code but 1-5 is refused
    "hidden int8 (quantized, dtype code 6)": (crafted(tail=descriptor(6, 1, 1, HIDDEN), data=bytes(HIDDEN)), 1,
                                              "bad_tensor"),
    "hidden q4 (compressed, dtype code 7)": (crafted(tail=descriptor(7, 1, 1, HIDDEN), data=bytes(HIDDEN // 2)), 1,
                                             "bad_tensor"),
    "hidden of dtype code 255": (crafted(tail=descriptor(255, 1, 1, HIDDEN), data=bytes(HIDDEN)), 1, "bad_tensor"),
    "claims n > 2**20": (crafted(tail=descriptor(FLOAT32, 1, 2**20 + 1, HIDDEN), data=bytes(256)), 1, "bad_tensor"),
    "claims more bytes than sent": (crafted(tail=descriptor(FLOAT16, 1, 4, HIDDEN), data=bytes(2 * HIDDEN)), 1,
                                    "bad_tensor"),
    "more rows than max_batch_size": (encoded(hidden(rows=MAX_ROWS + 1), phase="decode"), MAX_ROWS + 1, "bad_tensor"),
    "rows != request ids": (encoded(hidden(rows=2), phase="decode"), 1, "bad_tensor"),
    "decode with n=2": (encoded(hidden(n=2), phase="decode"), 1, "bad_tensor"),
    "prefill of 2 rows": (encoded(hidden(rows=2, n=3)), 2, "bad_tensor"),
    # the tensor's name is implied by the message type: an ACTIVATION's one tensor is hidden
    "token ids as hidden": (encoded({"input_ids": ("int32", np.array([[7]], dtype=np.int32))}), 1, "bad_tensor"),
    # the binary header itself is cut once its ids decoded: bad_request, not bad_tensor (§3.2)
    "no tensor descriptor": (crafted(), 1, "bad_request"),
    "dimensions cut short": (crafted(tail=descriptor(FLOAT32, 1, 1, HIDDEN)[:-1]), 1, "bad_request"),
    # a fixed byte of the header is wrong, or an id appears twice: the ids decoded, so their owner is told
    # bad_request at once (§4.3, §4.5), not left to the exchange deadline (issue 21, finding 1)
    **{f"phase {v}": (crafted(phase=v, tail=ONE_ROW, data=ONE_ROW_DATA), 1, "bad_request") for v in (2, 7, 255)},
    **{f"flags {v:#04x}": (crafted(flags=v, tail=ONE_ROW, data=ONE_ROW_DATA), 1, "bad_request")
       for v in (0x02, 0x03, 0x80, 0xff)},
    **{f"micro_batch {v}": (crafted(micro_batch=v, tail=ONE_ROW, data=ONE_ROW_DATA), 1, "bad_request")
       for v in (64, 255)},
    "a request id twice": (lambda mtype, h: raw_step(mtype, h, ids=[h["request_ids"][0].encode()] * 2,
                                                     tail=descriptor(FLOAT32, 2, 1, HIDDEN),
                                                     data=bytes(8 * HIDDEN)), 1, "bad_request"),
}


@pytest.mark.parametrize("case", list(HIDDEN_BOUNDS))
def test_activation_bounds_fail_the_request_at_once(scripted, expected, case):
    """An out-of-bounds activation from the upstream stage: ERROR with the exchange nonce to the owner, at once."""
    build, rows, code = HIDDEN_BOUNDS[case]
    last: StageService = scripted.stages[1]
    seqs = [Scripted(scripted, rid("bounds")) for _ in range(rows)]
    ex = seqs[0].prefill()
    steps, held = last.steps, len(last.runner)
    header = {**{k: ex.entry.header[k] for k in ("nonce", "phase", "micro_batch", "sample")},
              "request_ids": [s.rid for s in seqs]}
    scripted.stages[0].send_raw(scripted.addr(1), build(MsgType.ACTIVATION, header))
    error = ex.pending.result(timeout=SCRIPTED_EXCHANGE_S + 2)
    assert isinstance(error, ExecutorError) and error.peer_code is not None and error.peer_code.wire_name == code, error
    assert ex.pending.elapsed < AT_ONCE_S, ex.pending.elapsed
    (sender, m), = scripted.tap.about(ex.nonce)
    assert sender == scripted.addr(1) and m.type is MsgType.ERROR
    assert scripted.stages[0].about(ex.nonce) == [(scripted.coordinator.transport.identity, ex.entry)]
    assert (last.steps, len(last.runner)) == (steps, held)
    for s in seqs[1:]:
        s.release()
    retry = seqs[0].prefill()  # the same sequence, prefilled for real: the last stage's caches are untouched
    forward(scripted, retry)
    assert [s.token for s in retry.pending.result()] == expected[:1]
    seqs[0].release()


WRONG_WIDTH = descriptor(FLOAT32, 1, 1, HIDDEN - 1)  # answered bad_tensor, were the activation ever checked
UNCORRELATED: dict[str, Build] = {
    "activation for a request nobody prepared": encoded(hidden(width=HIDDEN - 1), request_ids=["nobody"]),
    # no nonce: the header ends inside its 8 nonce bytes
    "activation without a nonce": lambda mtype, h: ENVELOPE.pack(int(mtype), 5) + bytes.fromhex(h["nonce"])[:5],
    # the exchange's own nonce, but ids that do not decode: no owner to tell (§3.2)
    "activation whose request id is empty": crafted(ids=[b""], tail=WRONG_WIDTH, data=bytes(4 * (HIDDEN - 1))),
    "activation whose request id is not UTF-8": crafted(ids=[b"\xff"], tail=WRONG_WIDTH, data=bytes(4 * (HIDDEN - 1))),
    "activation of no request ids": crafted(ids=[], tail=WRONG_WIDTH, data=bytes(4 * (HIDDEN - 1))),
}


@pytest.mark.parametrize("case", list(UNCORRELATED))
def test_an_activation_nobody_can_be_told_about_is_dropped(scripted, expected, case):
    """No owner or no nonce: the frame is dropped (no fallback to the configured coordinator), the exchange waits on."""
    last: StageService = scripted.stages[1]
    seq = Scripted(scripted, rid("uncorrelated"))
    ex = seq.prefill()
    steps = last.steps
    header = {k: ex.entry.header[k] for k in ("nonce", "phase", "micro_batch", "request_ids", "sample")}
    scripted.stages[0].send_raw(scripted.addr(1), UNCORRELATED[case](MsgType.ACTIVATION, header))
    time.sleep(SETTLE_S * 2)
    assert not ex.pending.done and scripted.tap.about(ex.nonce) == [] and last.steps == steps
    forward(scripted, ex)
    assert [s.token for s in ex.pending.result()] == expected[:1]
    seq.release()


@pytest.mark.parametrize("value", [*range(len(ErrorCode)), 99, True], ids=lambda v: f"code {v!r}")
def test_a_stage_error_fails_the_step_with_a_5xx_never_499(scripted, value):
    """Every code a stage may send, as the coordinator reports it (§4.4's mapping table): the unavailable class
    stays a 503, everything else is a 500; a stage's ``cancelled`` (10) is a 500, not the 499 of a client who
    cancelled (issue 21, finding 5)."""
    from mlxcel.engine.interface import FinishEvent, finish_error
    from mlxcel.server.errors import error_reply

    seq = Scripted(scripted, rid("coded"))
    ex = seq.prefill()
    scripted.stages[0].send(scripted.coordinator.transport.identity, MsgType.ERROR,
                            {"nonce": ex.nonce, "code": value, "message": "refused", "request_ids": [seq.rid]})
    error = ex.pending.result()
    sent = ErrorCode.from_wire(value)
    assert isinstance(error, ExecutorError) and error.peer_code is sent, error
    assert error.code is (sent if sent.retryable else ErrorCode.INTERNAL), error.code
    status = error_reply(finish_error(FinishEvent("error", error=str(error), code=error.code))).status
    assert status == (503 if sent.retryable else 500), status
    seq.release()


def test_every_exchange_has_an_absolute_deadline(scripted):
    """A stage that never answers: the step fails with 'timeout' at exchange_s, a command at its timeout."""
    seq = Scripted(scripted, rid("silent"))
    ex = seq.prefill()  # the scripted first stage never forwards it
    error = ex.pending.result(timeout=SCRIPTED_EXCHANGE_S + 3)
    assert isinstance(error, ExecutorError) and error.code is ErrorCode.TIMEOUT, error
    assert SCRIPTED_EXCHANGE_S - 0.1 <= ex.pending.elapsed < SCRIPTED_EXCHANGE_S + 1.0, ex.pending.elapsed
    start = time.monotonic()
    with pytest.raises(ExecutorError) as waited:
        scripted.coordinator.command(scripted.addr(0), MsgType.BEGIN_DRAIN, {}, timeout=0.5)
    assert waited.value.code is ErrorCode.TIMEOUT and time.monotonic() - start < 1.5
    seq.release()


def test_logits_of_the_wrong_shape_are_dropped(model, facts, rogue):
    """With full-logits return, a RUN_RESULT must carry float32 [rows, vocab_size]; anything else is dropped."""
    config = cluster_config(f"{COORDINATOR_IP}:{free_port(COORDINATOR_IP)}", _stage_addrs(),
                            exchange_s=SCRIPTED_EXCHANGE_S)
    stages = [Peer(str(n.address), answer=answer_as_stage(stage_state(config, i, facts)))
              for i, n in enumerate(config.stages)]
    try:
        executor, tap = start_coordinator(config, facts, return_logits=True)
    except BaseException:
        for s in stages:
            s.close()
        raise
    try:
        r = rid("logits")
        executor.prepare(r, SamplingParams(), 0, PROMPT)
        pending = Pending(executor, Step("prefill", [r], [PROMPT]))
        _, entry = stages[0].wait_for(lambda _p, m: m.type is MsgType.RUN_ENTRY)
        base = {"nonce": entry.nonce, "phase": "prefill", "micro_batch": 0, "request_ids": [r], "sample": True,
                "tokens": None}
        me = executor.transport.identity
        forged = [("float32", np.zeros((1, VOCAB - 1), np.float32)), ("float32", np.zeros((2, VOCAB), np.float32)),
                  ("float32", np.zeros((1, 1, VOCAB), np.float32)), ("float16", np.zeros((1, VOCAB), np.float16)),
                  ("int32", np.zeros((1, VOCAB), np.int32))]
        for dtype, logits in forged:
            stages[1].send(me, MsgType.RUN_RESULT, base, {"logits": (dtype, logits)})
        stages[1].send(me, MsgType.RUN_RESULT, base)  # no logits at all (result kind 0)
        cut = raw_step(MsgType.RUN_RESULT, base, tail=b"\x02" + descriptor(FLOAT32, 1, VOCAB),
                       data=bytes(4 * VOCAB - 4))
        stages[1].send_raw(me, cut)  # logits that claim more bytes than sent: malformed
        assert wait_until(lambda: len(tap.about(entry.nonce)) == len(forged) + 1 and tap.handled(cut))
        time.sleep(SETTLE_S)
        assert not pending.done, pending.outcomes
        good = np.zeros((1, VOCAB), np.float32)
        good[0, 123] = 5.0
        stages[1].send(me, MsgType.RUN_RESULT, base, {"logits": ("float32", good)})
        outcome = pending.result()
        assert [s.token for s in outcome] == [123]
        assert tap.about(entry.nonce)[-1][0] == config.stages[1].address
    finally:
        executor.close()
        for s in stages:
            s.close()
