"""A follower rank: join rank 0, shard the model, replay rank 0's steps until told to stop.

Started by rank 0 on this host (``python -m mlxcel.parallel.follower``, the secret on stdin) or by
the operator on another host (``mlxcel-server --tp-hostfile F --tp-rank R``, role ``tp-rank``).
The control channel's reader thread queues what rank 0 sends; the main thread applies it in order.
A follower never outlives its group: it exits 1 with one line when rank 0 is silent for
``--tp-timeout`` seconds, when its local parent is gone, or when a step fails after it started
(its collectives no longer line up); it exits 0 on rank 0's shutdown.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NoReturn

from mlxcel.cluster.errors import RequestError
from mlxcel.cluster.identity import PeerId, as_peer
from mlxcel.cluster.messages import Message
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.cluster.transport import Transport
from mlxcel.config import DEFAULT_KV_GROUP_SIZE, DEFAULT_TP_REDUCE_DTYPE
from mlxcel.parallel.control import ControlError, decode, encode, read_reply, reply
from mlxcel.parallel.errors import TPError
from mlxcel.parallel.launch import GroupSpec, init_group

log = logging.getLogger("mlxcel.parallel")

HELLO_RETRY_S = 0.5
WATCH_S = 0.25


def die(rank: int, message: str, code: int = 1) -> NoReturn:
    """One line, then leave without MLX's static destructors (see mlxcel.process.exit_process)."""
    if message:
        print(f"mlxcel: {'error: ' if code else ''}tensor-parallel rank {rank}: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


class FollowerControl:
    """The follower's end of the control channel: its listener for rank 0, and its calls to rank 0."""

    def __init__(self, secret: ClusterSecret, bind: tuple[str, int], rank0: PeerId, rank: int, timeout: float,
                 vocab_size: int | None = None):
        self.transport = Transport(bind, secret)
        self.rank0 = rank0
        self.rank = rank
        self.timeout = timeout
        self.vocab_size = vocab_size  # every token id rank 0 sends is below it (checked on receipt)
        self.inbox: queue.SimpleQueue[tuple[dict, Future | None]] = queue.SimpleQueue()
        self.last_seen = time.monotonic()
        self.stopped_before_ready: str | None = None  # rank 0's shutdown reason, while this rank is not replaying
        self.replaying = False

    def start(self) -> PeerId:
        return self.transport.serve(self._on_message, self._on_request)

    def _from_rank0(self, msg: Message) -> dict:
        if msg.peer != self.rank0:
            raise ControlError(f"control message from {msg.peer}, not rank 0 ({self.rank0})")
        self.last_seen = time.monotonic()
        return decode(msg.payload, self.vocab_size)

    def _on_message(self, msg: Message) -> None:
        try:
            m = self._from_rank0(msg)
        except ControlError as exc:
            log.warning("tensor-parallel rank %d: dropped a control message: %s", self.rank, exc)
            return
        if m["op"] == "shutdown" and not self.replaying:
            self.stopped_before_ready = m["reason"]
        self.inbox.put((m, None))

    def _on_request(self, msg: Message) -> bytes:
        try:
            m = self._from_rank0(msg)
        except ControlError as exc:  # e.g. a prompt id outside the vocabulary: refused, nothing prepared
            raise RequestError(exc.code, str(exc)) from None
        if m["op"] == "ping":
            return reply(ok=True)
        if m["op"] != "prepare":
            raise ControlError(f"{m['op']} is not a request a follower answers")
        fut: Future = Future()
        self.inbox.put((m, fut))
        return reply(cached=fut.result(self.timeout))

    def call(self, op: str, **fields: Any) -> dict:
        return read_reply(self.transport.request(self.rank0, encode(op, rank=self.rank, **fields), timeout=self.timeout))

    def hello(self, identity: str, deadline: float) -> dict:
        """Say hello until rank 0 answers (it may start later on another host); its settings."""
        while True:
            try:
                answer = self.call("hello", pid=os.getpid(), identity=identity)
            except Exception as exc:  # noqa: BLE001 - not listening yet, or refused
                if time.monotonic() > deadline:
                    raise TPError(f"rank 0 at {self.rank0} did not answer: {exc}") from None
                time.sleep(HELLO_RETRY_S)
                continue
            if answer.get("ok") is False:
                raise TPError(f"rank 0 refused this rank: {answer.get('error')}")
            return answer

    def close(self) -> None:
        self.transport.close()


def watch(control: FollowerControl, parent: int | None) -> None:
    """Exit when rank 0 has been silent for ``timeout`` s, or the parent process is gone."""
    def loop() -> None:
        while True:
            time.sleep(WATCH_S)
            if parent is not None and os.getppid() != parent:
                die(control.rank, f"rank 0 (pid {parent}) is gone")
            if control.stopped_before_ready is not None and not control.replaying:
                die(control.rank, f"rank 0 stopped before the group was ready ({control.stopped_before_ready})")
            silent = time.monotonic() - control.last_seen
            if silent > control.timeout:
                die(control.rank, f"rank 0 stopped answering for {silent:.0f}s")

    threading.Thread(target=loop, name="mlxcel-tp-watch", daemon=True).start()


def _load(model_dir: Path, size: int, group: Any, settings: dict) -> Any:
    import mlx.core as mx

    from mlxcel.engine.kv_quant import kv_quant, use_kv_bits
    from mlxcel.models.loading import load_checkpoint
    from mlxcel.parallel.plan import apply_plan, check_shardable
    from mlxcel.parallel.reduce import set_reduce_dtype
    from mlxcel.parallel.replay import ShardRunner

    loaded = load_checkpoint(model_dir, lazy=True, tokenizer=False)
    moe_mode = settings.get("moe_mode")  # rank 0's choice, as the reduce dtype
    apply_plan(loaded.model, check_shardable(loaded.config, size, model_dir,
                                             moe_mode=moe_mode if isinstance(moe_mode, str) else None), group)
    set_reduce_dtype(loaded.model, str(settings.get("reduce_dtype", DEFAULT_TP_REDUCE_DTYPE)))  # rank 0's choice
    use_kv_bits(loaded.model, kv_quant(settings.get("kv_bits"), settings.get("kv_group_size", DEFAULT_KV_GROUP_SIZE)))
    mx.eval(loaded.model.parameters())
    return ShardRunner(loaded.model, head=False, max_rows=int(settings["max_batch_size"]),
                       prefix_cache_bytes=int(settings["prefix_cache_bytes"]))


def replay(control: FollowerControl, shard: Any) -> int:
    """Apply rank 0's messages in order until ``shutdown``; returns 0."""
    from mlxcel.engine.runner import RunnerError

    control.replaying = True
    while True:
        m, fut = control.inbox.get()
        op = m["op"]
        if op == "shutdown":
            return 0
        try:
            if op == "step":
                shard.run(m["kind"], m["rids"], m["tokens"], m["slot"], m["sample"])
            elif op == "release":
                shard.release(m["rid"], m["tokens"])
            elif op == "prepare":
                cache, n = shard.lookup(m["prompt"], limit=m["limit"]) if m["limit"] else (None, 0)
                shard.prepare(m["rid"], None, cache, n)
                fut.set_result(n)
        except RunnerError as exc:  # refused before any collective, as rank 0 refused it
            log.debug("rank %d: %s refused: %s", control.rank, op, exc)
            if fut is not None:
                fut.set_exception(exc)
        except Exception as exc:  # noqa: BLE001 - the group cannot go on
            die(control.rank, f"{op} failed: {exc}")


def follow(rank: int, model_dir: Path, secret: ClusterSecret, rank0: PeerId, spec: GroupSpec, *,
           timeout: float, listen_host: str, parent: int | None = None, join_s: float = 60.0) -> int:
    """Run follower ``rank`` until rank 0's shutdown (0) or a failure (exits 1 with one line)."""
    from mlxcel.models.identity import model_identity, read_config
    from mlxcel.models.token_ids import config_vocab_size

    vocab_size = config_vocab_size(read_config(model_dir)[1])
    control = FollowerControl(secret, (listen_host, 0), rank0, rank, timeout, vocab_size)
    control.start()
    settings = control.hello(model_identity(model_dir), time.monotonic() + join_s)
    control.last_seen = time.monotonic()
    watch(control, parent)
    try:
        group = init_group(spec, rank, join_s)
        shard = _load(model_dir, spec.size, group, settings)
    except Exception as exc:  # noqa: BLE001 - tell rank 0 why, then exit
        try:
            control.call("failed", error=str(exc))
        except Exception:  # noqa: BLE001
            pass
        die(rank, str(exc))
    control.call("ready")
    code = replay(control, shard)
    control.close()
    return code


def follow_hostfile(tp: Any, model_dir: Path, secret: ClusterSecret) -> int:
    """Rank ``tp.rank`` of a hostfile group (started by the operator): rank 0 at the hostfile's control address."""
    from mlxcel.parallel.launch import group_spec, join_seconds, resolve_backend

    assert tp.hostfile is not None and tp.rank > 0
    spec, control = group_spec(tp, resolve_backend(tp.backend, tp.hostfile))
    print(f"mlxcel: tensor-parallel rank {tp.rank} of {tp.size}: following rank 0 at {as_peer(control)} "
          f"({spec.backend} backend)", file=sys.stderr, flush=True)
    return follow(tp.rank, model_dir, secret, as_peer(control), spec, timeout=tp.timeout,
                  listen_host=tp.hostfile.ips[tp.rank][0], join_s=join_seconds(tp.timeout))


def main(argv: list[str] | None = None) -> NoReturn:
    """``python -m mlxcel.parallel.follower``: a local follower started by rank 0 (secret on stdin)."""
    import mlxcel  # noqa: F401 - OpenBLAS before MLX (mlxcel/blas.py)

    p = argparse.ArgumentParser(prog="mlxcel.parallel.follower", description="tensor-parallel follower rank")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--control", required=True, help="rank 0's control address IP:PORT")
    p.add_argument("--group", required=True, help="the group's addresses (JSON, from rank 0)")
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--parent", type=int, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        secret = ClusterSecret(bytes.fromhex(sys.stdin.readline().strip()), source="rank 0 (stdin)")
        host, _, port = args.control.rpartition(":")
        code = follow(args.rank, Path(args.model), secret, as_peer((host, int(port))), GroupSpec.from_json(args.group),
                      timeout=args.timeout, listen_host=host, parent=args.parent)
    except Exception as exc:  # noqa: BLE001 - one line
        die(args.rank, str(exc))
    die(args.rank, "", code)


if __name__ == "__main__":
    main()
