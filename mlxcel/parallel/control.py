"""The control channel beside MLX's collectives: rank 0 tells the followers what to run.

MLX's collectives carry only tensors; which step to run, which sequence to prepare or free, and when
to stop travel here, over the authenticated, encrypted cluster transport (``mlxcel.cluster``) under
the cluster secret. Messages are small JSON objects with an ``op``; ``decode`` checks every field
(docs/tp.md, "Control channel").

Rank 0 -> follower, one-way ``CONTROL`` messages, applied in order:
  ``step``     {kind, rids, tokens, slot, sample}: run it exactly as rank 0 does
  ``release``  {rid, tokens|null}: free a sequence (tokens: keep its KV in the prefix cache)
  ``shutdown`` {reason}: exit 0
Rank 0 -> follower, requests (answered after everything sent before them is applied):
  ``prepare``  {rid, prompt, limit} -> {cached}: a fresh sequence, its prefix cut to at most ``limit``
  ``ping``     {} -> {ok}: answered at once, even while a step runs
Follower -> rank 0, requests:
  ``hello``    {rank, pid, identity} -> {max_batch_size, prefix_cache_bytes, reduce_dtype, moe_mode}: this rank is up
  ``ready``    {rank}: loaded and sharded;  ``failed`` {rank, error}: it cannot go on (it exits)
"""

from __future__ import annotations

import json
import logging
import threading
import time
from functools import partial
from typing import Any, Callable

from mlxcel import strict_json as strict
from mlxcel.cluster.errors import ClusterError
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.messages import Message
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.cluster.transport import Transport
from mlxcel.cluster.wire import Kind
from mlxcel.config import MAX_PREFIX_TOKENS, TP_MAX_CONTROL_TEXT, TP_MAX_ROWS, TP_MAX_STEP_TOKENS
from mlxcel.error_codes import CodedError, ErrorCode
from mlxcel.models.token_ids import TokenIdError, check_token_ids
from mlxcel.parallel.errors import TPError

log = logging.getLogger("mlxcel.parallel")

OPS = ("step", "release", "shutdown", "prepare", "ping", "hello", "ready", "failed")


class ControlError(CodedError, ValueError):
    """A control message that does not decode or breaks a bound (or comes from a sender it may not)."""

    code = ErrorCode.BAD_REQUEST


def encode(op: str, **fields: Any) -> bytes:
    return json.dumps({"op": op, **fields}, separators=(",", ":")).encode()


_refused = strict.mapped(lambda exc: ControlError(str(exc)))  # at decode, the codec's boundary


def _int(value: Any, name: str, low: int = 0, high: int = 2**31) -> int:
    return strict.integer(value, name, low, high, text="{name} must be an integer in [{lo}, {hi}]")


def _ints(value: Any, name: str, limit: int, vocab_size: int | None) -> list[int]:
    """At most ``limit`` token ids, each in [0, vocab_size) (None: [0, 2^31], the sender is rank 0)."""
    if not isinstance(value, list) or len(value) > limit:
        raise ControlError(f"{name} must be a list of at most {limit} token ids")
    if vocab_size is None:
        return [_int(v, name) for v in value]
    try:
        check_token_ids(value, vocab_size, name)
    except TokenIdError as exc:
        raise ControlError(str(exc)) from None
    return value


def _text(value: Any, name: str) -> str:
    return strict.string(value, name, min_len=1, max_bytes=TP_MAX_CONTROL_TEXT, lone_surrogates=True,
                         text="{name} must be a non-empty string of at most {limit} UTF-8 bytes")


_bool = partial(strict.boolean, text="{name} must be a boolean")


def _step(m: dict, vocab_size: int | None) -> dict:
    if m.get("kind") not in ("prefill", "decode"):
        raise ControlError("kind must be prefill or decode")
    rids = m.get("rids")
    if not isinstance(rids, list) or not 1 <= len(rids) <= TP_MAX_ROWS:
        raise ControlError(f"rids must list 1 to {TP_MAX_ROWS} request ids")
    tokens = m.get("tokens")
    if not isinstance(tokens, list) or len(tokens) != len(rids):
        raise ControlError("tokens must have one row per request id")
    rows = [_ints(t, "tokens", TP_MAX_STEP_TOKENS, vocab_size) for t in tokens]
    if sum(len(r) for r in rows) > TP_MAX_STEP_TOKENS or len({len(r) for r in rows}) != 1 or not rows[0]:
        raise ControlError("tokens must be rows of one non-zero length")
    _bool(m.get("sample"), "sample")
    return {"op": "step", "kind": m["kind"], "rids": [_text(r, "rid") for r in rids], "tokens": rows,
            "slot": _int(m.get("slot"), "slot", -1, TP_MAX_ROWS), "sample": m["sample"]}


@_refused
def decode(payload: bytes | memoryview, vocab_size: int | None = None) -> dict:
    """One control message, checked; ``ControlError`` names the first bad field. A follower passes its
    model's ``vocab_size``: every token id (``step`` tokens, ``release`` tokens, ``prepare`` prompt) is below it."""
    try:
        m = json.loads(bytes(payload))
    except ValueError:
        raise ControlError("not a JSON object") from None
    if not isinstance(m, dict) or m.get("op") not in OPS:
        raise ControlError(f"op must be one of {', '.join(OPS)}")
    op = m["op"]
    if op == "step":
        return _step(m, vocab_size)
    if op == "release":
        tokens = m.get("tokens")
        return {"op": op, "rid": _text(m.get("rid"), "rid"),
                "tokens": None if tokens is None else _ints(tokens, "tokens", MAX_PREFIX_TOKENS * 2, vocab_size)}
    if op == "prepare":
        rid = _text(m.get("rid"), "rid")
        prompt = _ints(m.get("prompt"), "prompt", MAX_PREFIX_TOKENS * 16, vocab_size)
        return {"op": op, "rid": rid, "prompt": prompt, "limit": _int(m.get("limit"), "limit")}
    if op in ("hello", "ready", "failed"):
        out = {"op": op, "rank": _int(m.get("rank"), "rank", 1, TP_MAX_ROWS)}
        if op == "hello":
            out.update(pid=_int(m.get("pid"), "pid"), identity=_text(m.get("identity"), "identity"))
        if op == "failed":
            out["error"] = str(m.get("error", ""))[:TP_MAX_CONTROL_TEXT]
        return out
    if op == "shutdown":
        return {"op": op, "reason": str(m.get("reason", ""))[:TP_MAX_CONTROL_TEXT]}
    return {"op": op}


def reply(**fields: Any) -> bytes:
    return json.dumps(fields, separators=(",", ":")).encode()


def read_reply(payload: bytes | memoryview) -> dict:
    try:
        out = json.loads(bytes(payload))
    except ValueError:
        raise ControlError("a control reply is not JSON") from None
    if not isinstance(out, dict):
        raise ControlError("a control reply is not a JSON object")
    return out


class RankZeroControl:
    """Rank 0's end: the listener followers say hello to, the broadcast, the liveness probe."""

    def __init__(self, secret: ClusterSecret, bind: tuple[str, int], size: int, *, timeout: float,
                 settings: dict[str, Any]):
        self.size = size
        self.timeout = timeout
        self.settings = settings  # sent to every follower in the hello reply
        self.transport = Transport(bind, secret)
        self.peers: dict[int, PeerId] = {}
        self.ready: set[int] = set()
        self.failures: dict[int, str] = {}
        self._cond = threading.Condition()
        self._probe: threading.Thread | None = None
        self._closing = threading.Event()
        self.on_lost: Callable[[str], None] = self.record_failure  # the executor takes over once serving

    @property
    def address(self) -> PeerId:
        return self.transport.identity

    def start(self) -> PeerId:
        return self.transport.serve(None, self._on_request)

    def _on_request(self, msg: Message) -> bytes:
        m = decode(msg.payload)
        rank = m.get("rank")
        with self._cond:
            if m["op"] == "hello":
                if rank >= self.size or (rank in self.peers and self.peers[rank] != msg.peer):
                    raise ControlError(f"rank {rank} is not expected (or already joined from elsewhere)")
                self.peers[rank] = msg.peer
                if m["identity"] != self.settings["identity"]:
                    problem = (f"rank {rank} holds another checkpoint (model identity {m['identity'][:12]}, "
                               f"rank 0 has {self.settings['identity'][:12]})")
                    self.failures[rank] = problem
                    self._cond.notify_all()
                    return reply(ok=False, error=problem)
            elif m["op"] == "ready" and self.peers.get(rank) == msg.peer:
                self.ready.add(rank)
            elif m["op"] == "failed" and self.peers.get(rank) == msg.peer:
                self.failures[rank] = f"rank {rank}: {m['error']}"
            else:
                raise ControlError(f"{m['op']} is not a request rank 0 answers")
            self._cond.notify_all()
        return reply(ok=True, **self.settings)

    def record_failure(self, message: str) -> None:
        """A start-up failure seen outside a request (the probe): wakes ``wait`` with it."""
        with self._cond:
            self.failures.setdefault(0, message)
            self._cond.notify_all()

    def wait(self, what: str, ranks: set[int], deadline: float | None, check: Callable[[], str | None]) -> None:
        """Until every rank of ``ranks`` is in ``what`` ("peers" or "ready"); TPError on failure or deadline."""
        with self._cond:
            while True:
                if self.failures:
                    raise TPError(next(iter(self.failures.values())))
                have = set(self.peers) if what == "peers" else self.ready
                if ranks <= have:
                    return
                problem = check()
                if problem:
                    raise TPError(problem)
                if deadline is not None and time.monotonic() > deadline:
                    missing = ", ".join(str(r) for r in sorted(ranks - have))
                    raise TPError(f"tensor-parallel rank(s) {missing} did not "
                                  f"{'join' if what == 'peers' else 'get ready'} in time")
                self._cond.wait(0.1)

    def broadcast(self, payload: bytes) -> None:
        """One message to every follower, in rank order; a send that fails raises (the group is broken)."""
        for rank in sorted(self.peers):
            self.transport.send(self.peers[rank], Kind.CONTROL, payload)

    def request_all(self, payload: bytes, ranks: list[int] | None = None) -> dict[int, dict]:
        """The request to every follower (or to ``ranks``), one after another; their replies by rank."""
        chosen = sorted(self.peers) if ranks is None else ranks
        return {rank: read_reply(self.transport.request(self.peers[rank], payload, timeout=self.timeout))
                for rank in chosen}

    def start_probe(self, interval: float) -> None:
        """Ping every follower every ``interval`` s; one that does not answer in ``timeout`` s calls on_lost."""
        def probe() -> None:
            while not self._closing.wait(interval):
                for rank, peer in sorted(list(self.peers.items())):
                    try:
                        self.transport.request(peer, encode("ping"), timeout=self.timeout)
                    except (ClusterError, OSError) as exc:
                        if not self._closing.is_set():
                            self.on_lost(f"tensor-parallel rank {rank} stopped answering ({exc})")
                        return

        self._probe = threading.Thread(target=probe, name="mlxcel-tp-probe", daemon=True)
        self._probe.start()

    def close(self) -> None:
        self._closing.set()
        self.transport.close()
