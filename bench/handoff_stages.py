"""Where a KV handoff's time goes, stage by stage, and the whole path end to end (``disagg_bench``'s
``stages`` and ``e2e`` modes).

The KV comes from real mlx-lm ``KVCache`` objects filled by ``update_and_fetch`` (so their buffers
have the step-rounded capacity a prefill leaves), in the layout of a named shape:

* ``qwen3-0.6b``: 28 layers, 8 KV heads of 128, bfloat16 (172.0 MB at 1,500 tokens: issue 24's shape);
* ``smollm2``: 30 layers, 3 KV heads of 64, float32 (the CPU default model).

``stages`` times each stage alone, on this thread (the real functions): ``export`` (``export_cache``),
``encode`` (``encode_chunks``, every part materialised), ``seal`` and ``open`` (AES-256-GCM over the
transport's 256 KiB frames, one core), ``socket`` (the parts through an unprotected transport stream
to a receiver that only counts), ``decode`` (``HandoffDecoder.feed`` over parts already in memory, then
``result``) and ``import`` (``import_cache``). ``e2e`` times the whole path in one process: export,
header, chunks through an AES-256-GCM transport stream, the receiver's decoder, ``result`` and
``import_cache``, reporting the stream alone (first write to ``result``) and the total.

Both modes keep freed heap memory resident first, as a decode node does (``mlxcel/disagg/heap.py``;
``heap="plain"``: glibc's defaults, each round's tensor buffers on fresh pages); rows record which (``heap``).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
import time
from typing import Any, Callable

import numpy as np

SHAPES = {"qwen3-0.6b": (28, 8, 128, "bfloat16"), "smollm2": (30, 3, 64, "float32")}
FRAME = 256 * 1024


def layout_of(shape: str):
    from mlxcel.disagg.kv_codec import KVLayout, LayerSpec, dtype_code
    from mlxcel.disagg.wire import CacheKind

    layers, heads, dim, dtype = SHAPES[shape]
    return KVLayout(tuple(LayerSpec(CacheKind.KV, dtype_code(dtype), heads, dim, dim) for _ in range(layers)))


def make_caches(shape: str, tokens: int) -> list:
    """Filled mlx-lm KVCaches of ``shape`` holding ``tokens`` positions of random values."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    layers, heads, dim, dtype = SHAPES[shape]
    mx.random.seed(0)
    caches = []
    for _ in range(layers):
        c = KVCache()
        k = mx.random.normal((1, heads, tokens, dim)).astype(getattr(mx, dtype))
        c.update_and_fetch(k, -k)
        mx.eval(c.keys, c.values)
        caches.append(c)
    return caches


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _parts(tensors: list, layout: Any, tokens: int) -> list:
    from mlxcel.disagg import kv_codec

    head = kv_codec.encode_header({"nonce": "0" * 16}, tuple(range(tokens)), layout)
    if hasattr(kv_codec, "chunk_parts"):  # the sender's parts as it hands them to the transport
        return [head, *kv_codec.chunk_parts(tensors)]
    return [head, *kv_codec.encode_chunks(tensors)]


def _flat(part: Any) -> bytes:
    """One part as contiguous bytes (a sender may hand the transport a list of buffers)."""
    return part if isinstance(part, (bytes, bytearray)) else b"".join(bytes(p) for p in part)


def _size(part: Any) -> int:
    if isinstance(part, (bytes, bytearray, memoryview)):
        return len(part)
    return sum(memoryview(p).nbytes for p in part)


class _Pair:
    """Two transports in this process (127.0.0.76 -> .77); the receiver runs ``on_stream(msg)``."""

    def __init__(self, suite_name: str, on_data: Callable[[Any], None], on_end: Callable[[Any], None],
                 crypto_workers: int | None = None, lanes: int = 1):
        from mlxcel.cluster.secret import ClusterSecret
        from mlxcel.cluster.transport import Transport
        from mlxcel.cluster.wire import Kind, Suite

        suite = Suite.AES_256_GCM if suite_name.partition("-")[0] == "aes" else Suite.UNPROTECTED
        secret = ClusterSecret(os.urandom(32))
        extra: dict[str, int] = {} if crypto_workers is None else {"crypto_workers": crypto_workers}
        if "-p0" in suite_name:  # the helpers on every fragmented message (before crypto_pipeline_min_len)
            extra["crypto_pipeline_min_len"] = 0

        def on_message(msg: Any) -> None:
            if msg.kind is Kind.STREAM_DATA:
                on_data(msg)
            elif msg.kind is Kind.STREAM_END and lanes == 1:  # a split handoff ends at its last part's END
                on_end(msg)

        self.rx = Transport("127.0.0.77:0", secret, suite=suite, **extra)
        self.rx.serve(on_message=on_message)
        self.tx = Transport("127.0.0.76:0", secret, suite=suite, **extra)
        self.tx.connect(self.rx.identity)
        self.lanes = lanes
        for lane in range(1, lanes):  # dialled once, as a prefill node's lanes stay up
            self.tx._acquire(self.rx.identity, lane)
        self.split_read = threading.Event()
        self._workers = ThreadPoolExecutor(lanes) if lanes > 1 else None

    def stream(self, parts: list) -> None:
        with self.tx.open_stream(self.rx.identity) as s:
            for p in parts:
                s.write(p)

    def stream_split(self, head: bytes, tensors: list) -> None:
        """The handoff split over every lane as a prefill node sends it (docs/disagg.md §4.9): HEADER and
        SPLIT on lane 0, then part i on lane i from its own thread; the part streams start once the receiver
        read SPLIT (so no part waits for its header here)."""
        from mlxcel.disagg.kv_codec import contiguous_runs
        from mlxcel.disagg.kv_split import encode_part, encode_split, range_parts, ranges, total_bytes

        self.split_read.clear()
        header = self.tx.open_stream(self.rx.identity, 0)
        header.write(head)
        header.write(encode_split(self.lanes))
        self.split_read.wait(30)

        def part(i: int, span: tuple[int, int]) -> None:
            with self.tx.open_stream(self.rx.identity, i) as s:
                s.write(encode_part(header.id, i, self.lanes))
                for p in range_parts((v for t in tensors for v in contiguous_runs(t)), *span):
                    s.write(p)

        assert self._workers is not None
        for f in [self._workers.submit(part, i, span) for i, span in enumerate(ranges(total_bytes(tensors), self.lanes))]:
            f.result()
        header.close()

    def close(self) -> None:
        if self._workers is not None:
            self._workers.shutdown()
        self.tx.close()
        self.rx.close()


def _heap(heap: str) -> str:
    """Apply the ``heap`` mode (``keep``: as a decode node, ``plain``: glibc's defaults); the mode in effect."""
    if heap not in ("keep", "plain"):
        raise SystemExit(f"handoff_stages: heap must be keep or plain, not {heap}")
    if heap == "keep":
        from mlxcel.disagg.heap import keep_freed_memory

        return "keep" if keep_freed_memory() else "plain"
    return heap


def stages(shape: str, tokens: int, repeats: int, heap: str = "keep") -> list[dict[str, Any]]:
    """One row per stage: its p50 over ``repeats`` and its GiB/s over the handoff's tensor bytes."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from mlxcel.disagg.kv_cache import export_cache, import_cache
    from mlxcel.disagg.kv_codec import HandoffDecoder

    heap = _heap(heap)
    layout = layout_of(shape)
    caches = make_caches(shape, tokens)
    nbytes = layout.nbytes(tokens)
    times: dict[str, list[float]] = {}
    done = threading.Event()
    pair = _Pair("unprotected", lambda msg: None, done.set)
    aead = AESGCM(os.urandom(32))
    plain = np.random.default_rng(0).integers(0, 255, FRAME, dtype=np.uint8)
    sealed = bytearray(FRAME + 16)
    opened = bytearray(FRAME)
    frames = -(-nbytes // FRAME)
    try:
        for _ in range(repeats):
            t, tensors = _timed(lambda: export_cache(caches, layout, tokens))
            times.setdefault("export", []).append(t)
            t, parts = _timed(lambda: _parts(tensors, layout, tokens))
            times.setdefault("encode", []).append(t)
            nonce, aad = bytes(12), bytes(5)
            t, _ = _timed(lambda: [aead.encrypt_into(nonce, plain, aad, sealed) for _ in range(frames)])
            times.setdefault("seal", []).append(t)
            t, _ = _timed(lambda: [aead.decrypt_into(nonce, sealed, aad, opened) for _ in range(frames)])
            times.setdefault("open", []).append(t)
            done.clear()
            t, _ = _timed(lambda: (pair.stream(parts), done.wait(60)))
            times.setdefault("socket", []).append(t)
            received = [bytearray(_flat(p)) for p in parts]  # what a transport delivers: buffers the handler owns

            def decode() -> Any:
                dec = _decoder(HandoffDecoder, layout)
                for p in received:
                    dec.feed(p)
                return dec.result()

            t, handoff = _timed(decode)
            times.setdefault("decode", []).append(t)
            t, _ = _timed(lambda: import_cache(handoff))
            times.setdefault("import", []).append(t)
    finally:
        pair.close()
    return [_row("disagg_stage", shape, tokens, nbytes, stage=name, samples=s, heap=heap) for name, s in times.items()]


def e2e(shape: str, tokens: int, repeats: int, suites: list[str], crypto_workers: int | None,
        heap: str = "keep", lanes: int = 1) -> list[dict[str, Any]]:
    """The whole handoff path per suite, rounds alternating: export, stream, decoder, import. A suite named
    ``aes-staged`` or ``unprotected-staged`` goes through page-locked staging (docs/disagg.md §4.3) on both
    sides, as the nodes do on CUDA: a contiguous export copied to the host, received into the pool. A ``-p0`` in a
    suite's name gives both transports ``crypto_pipeline_min_len=0`` (helpers on the 1 MiB chunks too). ``lanes`` > 1
    splits each handoff over that many connections, each part stream sent and received on its own thread."""
    from mlxcel.disagg.host_staging import shared_staging
    from mlxcel.disagg.kv_cache import export_cache, import_cache, staged_allocator
    from mlxcel.disagg.kv_codec import HandoffDecoder

    heap = _heap(heap)
    layout = layout_of(shape)
    caches = make_caches(shape, tokens)
    nbytes = layout.nbytes(tokens)
    intake = _intake()
    pairs: dict[str, tuple[_Pair, dict[str, Any]]] = {}
    for name in suites:
        staging = shared_staging(True) if name.endswith("-staged") else None
        state: dict[str, Any] = {"done": threading.Event(), "staging": staging}

        def feed(msg: Any, state: dict = state, staging: Any = staging) -> None:
            if "dec" not in state:
                state["dec"] = (HandoffDecoder(layout, 1 << 20, None, staged_allocator(staging)) if staging is not None
                                else _decoder(HandoffDecoder, layout))
                state["parts"] = {}
            if lanes > 1 and _split_part(state, msg, pairs[name][0]):
                return
            state["dec"].feed(msg.payload)

        def end(state: dict = state) -> None:
            state["handoff"] = state.pop("dec").result()
            state["at"] = time.perf_counter()
            state["done"].set()

        def on_end(msg: Any, end: Callable = end, name: str = name) -> None:
            intake.put((name, msg.id), end) if intake is not None else end()

        def on_data(msg: Any, feed: Callable = feed, name: str = name) -> None:  # as the decode node: by stream
            intake.put((name, msg.id), feed, msg) if intake is not None else feed(msg)

        state["end"] = end
        pairs[name] = (_Pair(name, on_data, on_end, crypto_workers, lanes), state)
    samples: dict[str, dict[str, list[float]]] = {n: {"export": [], "stream": [], "import": [], "total": []} for n in suites}
    try:
        for rnd in range(repeats):
            for name in (suites if rnd % 2 == 0 else suites[::-1]):
                pair, state = pairs[name]
                state["done"].clear()
                t0 = time.perf_counter()
                staging = state["staging"]
                tensors = export_cache(caches, layout, tokens, contiguous=staging is not None)
                staged = staging.to_host(tensors) if staging is not None else None
                t1 = time.perf_counter()
                sent = staged[0] if staged is not None else tensors
                if lanes > 1:
                    pair.stream_split(_parts(sent, layout, tokens)[0], sent)
                else:
                    pair.stream(_parts(sent, layout, tokens))
                if staged is not None:
                    staged[1].release()
                if not state["done"].wait(60):
                    raise SystemExit("handoff_stages: a handoff did not arrive")
                t2 = state["at"]
                import_cache(state.pop("handoff"))
                t3 = time.perf_counter()
                for key, value in (("export", t1 - t0), ("stream", t2 - t1), ("import", t3 - t2), ("total", t3 - t0)):
                    samples[name][key].append(value)
    finally:
        for pair, _ in pairs.values():
            pair.close()
        if intake is not None:
            intake.close()
    rows = []
    for name, s in samples.items():
        row = _row("disagg_e2e", shape, tokens, nbytes, samples=s["total"], suite=name,
                   crypto_workers=crypto_workers, intake_workers=intake.workers if intake is not None else None,
                   heap=heap, lanes=lanes)
        for key in ("export", "stream", "import"):
            row[f"{key}_p50_ms"] = round(_p50(s[key]) * 1000, 3)
        row["stream_gib_s"] = round(nbytes / _p50(s["stream"]) / 2**30, 3)
        rows.append(row)
    return rows


def _split_part(state: dict, msg: Any, pair: Any) -> bool:
    """A split handoff's part as the decode node takes it: True when ``msg`` was a part stream's (its PART,
    CHUNK or END; the last END ends the handoff); False for the header stream's (SPLIT wakes the sender)."""
    from mlxcel.disagg.kv_split import parse_part
    from mlxcel.disagg.wire import Part

    dec, view = state["dec"], memoryview(msg.payload).cast("B")
    index = state["parts"].get(msg.id)
    if index is None and view[0] == Part.PART:
        _, index, count = parse_part(view, ValueError)
        state["parts"][msg.id] = index
        dec.start_part(index, count)
        return True
    if index is None:
        if view[0] == Part.SPLIT:
            dec.feed(msg.payload)
            pair.split_read.set()
            return True
        return False
    dec.feed_part(index, msg.payload)
    if dec.state == "done":
        state["end"]()
    return True


def _intake() -> Any:
    """The decode node's intake (parts off the reader thread), where the code has one."""
    try:
        from mlxcel.disagg.intake import Intake, default_workers
    except ImportError:
        return None
    return Intake(default_workers())


def _decoder(cls: Any, layout: Any) -> Any:
    """A decoder as the decode node makes it (with its tensor allocator, where the code has one)."""
    from mlxcel.disagg import kv_cache

    if hasattr(kv_cache, "handoff_allocator"):
        return cls(layout, 1 << 20, None, kv_cache.handoff_allocator())
    return cls(layout, 1 << 20)


def _p50(xs: list[float]) -> float:
    from bench.stats import percentile

    return percentile(xs, 50) or 0.0


def _row(bench: str, shape: str, tokens: int, nbytes: int, *, samples: list[float], **extra: Any) -> dict[str, Any]:
    from bench.environment import load_1m
    from bench.stats import percentile

    p50 = _p50(samples)
    return {"bench": bench, "shape": shape, "prompt_tokens": tokens, "tensor_bytes": nbytes, **extra,
            "repeats": len(samples), "p50_ms": round(p50 * 1000, 3),
            "min_ms": round(min(samples) * 1000, 3), "p95_ms": round((percentile(samples, 95) or 0) * 1000, 3),
            "gib_s": round(nbytes / max(p50, 1e-9) / 2**30, 3), "cpus": os.cpu_count(), "load_1m": load_1m()}
