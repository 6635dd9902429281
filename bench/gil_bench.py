"""A bulk stream beside a thread that holds the GIL: the interpreter's switch interval and the frame size.

    python -m bench.gil_bench [--mib 64] [--repeats 3] [--busy 0,1] [--intervals 5,1,0.5,0.2] [--frames 256,1024]

A disaggregated prefill or decode node moves a KV handoff on transport threads (reader, sender, intake)
while its step thread builds the next step's graph in Python. Each of those threads leaves the GIL for
``recv``/``sendmsg``/AES-GCM and must get it back afterwards, and a thread running Python gives it up only
every switch interval (``sys.setswitchinterval``, 5 ms by default). This times one protected stream of
``--mib`` MiB (1 MiB messages, as a handoff's CHUNK parts) through two transports of this process
(127.0.0.60 -> .61, AES-256-GCM) with ``--busy`` threads spinning in pure Python beside it, for each switch
interval and transport frame size (``chunk_len``). Configurations alternate their order each repeat
(ABBA); a row per configuration: the stream time's median, min and max over the repeats, and its rate.
``mlxcel/threads.py`` sets the prefill and decode nodes' interval from these rows.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.environment import load_1m, write_jsonl
from mlxcel.cluster import ClusterSecret, Kind, Transport

MESSAGE = 1 << 20  # a handoff's CHUNK part


def spin(stop: threading.Event) -> None:
    """Pure Python until told to stop: holds the GIL but for the switch interval."""
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i * i


def stream_once(data: np.ndarray, frame: int, secret: ClusterSecret) -> float:
    """Seconds from the first write to the receiver seeing STREAM_END, over a fresh transport pair."""
    done = threading.Event()
    srv = Transport("127.0.0.60:0", secret, chunk_len=frame)
    cli = Transport("127.0.0.61:0", secret, chunk_len=frame)
    try:
        srv.serve(lambda msg: done.set() if msg.kind == Kind.STREAM_END else None)
        cli.connect(srv.identity)
        start = time.perf_counter()
        writer = cli.open_stream(srv.identity)
        view = memoryview(data)
        for off in range(0, len(data), MESSAGE):
            writer.write(view[off:off + MESSAGE])
        writer.close()
        if not done.wait(120):
            raise SystemExit("gil_bench: the stream did not end within 120 s")
        return time.perf_counter() - start
    finally:
        cli.close()
        srv.close()


def measure(config: tuple[int, float, int], data: np.ndarray, secret: ClusterSecret) -> float:
    busy, interval_ms, frame_kib = config
    before = sys.getswitchinterval()
    stop = threading.Event()
    spinners = [threading.Thread(target=spin, args=(stop,), daemon=True) for _ in range(busy)]
    sys.setswitchinterval(interval_ms / 1000)
    try:
        for t in spinners:
            t.start()
        return stream_once(data, frame_kib << 10, secret)
    finally:
        stop.set()
        for t in spinners:
            t.join()
        sys.setswitchinterval(before)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    configs = list(itertools.product(args.busy, args.intervals, args.frames))
    data = np.random.default_rng(0).integers(0, 256, args.mib << 20, dtype=np.uint8)
    secret = ClusterSecret(os.urandom(32))
    times: dict[tuple[int, float, int], list[float]] = {c: [] for c in configs}
    for rep in range(args.repeats):
        for config in configs if rep % 2 == 0 else reversed(configs):  # ABBA: each config leads in turn
            times[config].append(measure(config, data, secret))
    rows = []
    for (busy, interval, frame), samples in times.items():
        p50 = statistics.median(samples)
        rows.append({"bench": "gil_stream", "busy_threads": busy, "switch_interval_ms": interval, "frame_kib": frame,
                     "message_kib": MESSAGE >> 10, "mib": args.mib, "repeats": len(samples),
                     "p50_ms": round(p50 * 1000, 2), "min_ms": round(min(samples) * 1000, 2),
                     "max_ms": round(max(samples) * 1000, 2), "gib_s": round(args.mib / 1024 / p50, 3),
                     "load_1m": load_1m()})
    return rows


def numbers(kind: type) -> Any:
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gil_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=64, help="stream size in MiB (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="streams per configuration (default 3)")
    p.add_argument("--busy", type=numbers(int), default=[0, 1], help="spinning threads, comma list (default 0,1)")
    p.add_argument("--intervals", type=numbers(float), default=[5.0, 1.0, 0.5, 0.2],
                   help="switch intervals in ms, comma list (default 5,1,0.5,0.2; 5 is Python's own)")
    p.add_argument("--frames", type=numbers(int), default=[256, 1024],
                   help="transport frame sizes (chunk_len) in KiB, comma list (default 256,1024)")
    p.add_argument("--out", default="bench/results", help="directory of gil_bench.jsonl (default bench/results)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    for r in rows:
        print(f"busy={r['busy_threads']} switch={r['switch_interval_ms']:g} ms frame={r['frame_kib']} KiB: "
              f"{r['p50_ms']} ms [{r['min_ms']}-{r['max_ms']}] {r['gib_s']} GiB/s", flush=True)
    path = write_jsonl(Path(args.out) / "gil_bench.jsonl", rows)
    print(f"gil_bench: {len(rows)} rows -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
