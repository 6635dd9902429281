"""Frame protection benchmark: one-way latency and bandwidth of the cluster transport.

One-way latency is half the round trip of a TensorData message that the peer echoes
back over a second authenticated connection (its own pooled connection to our
listener), so it includes both ends' frame work.  Candidates: unprotected, HMAC-SHA256,
AES-256-GCM (the cluster's suite) and ChaCha20-Poly1305.

    python -m bench.frame_bench                       # local: echo peer in a subprocess
    python -m bench.frame_bench --quick               # 1/10 of the iterations
    python -m bench.frame_bench --serve-echo 0.0.0.0:19100 --cluster-secret-file S
    python -m bench.frame_bench --remote 10.0.0.2:19100 --cluster-secret-file S

``--serve-echo BIND`` listens for variant i at BIND's port + i (port 0: any ports,
printed as JSON); the variants are the four suites in the order above unless
``--variants`` names others (then start both ends with the same list).  Both hosts
need the same cluster secret (the usual sources: --cluster-secret-file,
MLXCEL_CLUSTER_SECRET_FILE, MLXCEL_CLUSTER_SECRET).

A variant is a suite with transport settings, ``SUITE[/wN][/rLEN][/cLEN][/pLEN]``: ``w`` the
crypto helper threads (``crypto_workers``), ``r`` the chunk ramp (``chunk_ramp_len``),
``c`` the chunk size (``chunk_len``), ``p`` the smallest message the helpers take
(``crypto_pipeline_min_len``; ``aes/w2/p0`` is the helpers at every size, as before 2026-12-04).  All variants run interleaved in the same rounds,
so one run compares settings under the same load:

    python -m bench.frame_bench --variants unprotected,aes/w0,aes/w2,aes/w2/r0 --sizes 1048576,2097152,16777216
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.environment import write_jsonl
from bench.stats import percentile
from mlxcel.cluster import ClusterSecret, Kind, Message, PeerId, Suite, Transport, load_secret

SUITES = [Suite.UNPROTECTED, Suite.HMAC_SHA256, Suite.AES_256_GCM, Suite.CHACHA20_POLY1305]
MODE_NAMES = {
    Suite.UNPROTECTED: "unprotected",
    Suite.HMAC_SHA256: "candidate 1: HMAC-SHA256",
    Suite.AES_256_GCM: "candidate 2: AES-256-GCM (chosen)",
    Suite.CHACHA20_POLY1305: "candidate 2: ChaCha20-Poly1305",
}
SIZES = [(8 * 1024, 4000), (64 * 1024, 2000), (1024 * 1024, 400), (2 * 1024 * 1024, 200), (16 * 1024 * 1024, 60)]
SUITE_BY_NAME = {"unprotected": Suite.UNPROTECTED, "hmac": Suite.HMAC_SHA256, "aes": Suite.AES_256_GCM, "chacha": Suite.CHACHA20_POLY1305}
COLUMNS = [
    "mode", "suite", "payload_bytes", "iterations", "p50_us", "p95_us", "p99_us", "mean_us", "one_way_gib_s",
    "variant", "chunk_len", "crypto_workers", "chunk_ramp_len", "crypto_pipeline_min_len", "label", "remote",
]


# --- echo peer ----------------------------------------------------------------------------


def transport_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Transport overrides from the command line (both ends use the same)."""
    kw: dict[str, Any] = {}
    if args.chunk_len:
        kw["chunk_len"] = args.chunk_len
    if args.socket_buffer is not None:
        kw["socket_buffer"] = args.socket_buffer or None
    if args.crypto_workers is not None:
        kw["crypto_workers"] = args.crypto_workers
    if args.ramp_len is not None:
        kw["chunk_ramp_len"] = args.ramp_len
    return kw


VARIANT_KEYS = {"w": "crypto_workers", "r": "chunk_ramp_len", "c": "chunk_len", "p": "crypto_pipeline_min_len"}
ALL_SUITES = ",".join(SUITE_BY_NAME)


def parse_variant(spec: str) -> tuple[Suite, dict[str, int]]:
    """``aes/w2/r65536`` -> (Suite.AES_256_GCM, {"crypto_workers": 2, "chunk_ramp_len": 65536})."""
    name, *opts = spec.strip().split("/")
    if name not in SUITE_BY_NAME:
        raise SystemExit(f"unknown suite {name!r} in variant {spec!r} (one of {ALL_SUITES})")
    kw: dict[str, int] = {}
    for opt in opts:
        key = VARIANT_KEYS.get(opt[:1])
        if key is None or not opt[1:].isdigit():
            raise SystemExit(f"bad setting {opt!r} in variant {spec!r}: w<helpers>, r<ramp bytes>, c<chunk bytes> or p<bytes>")
        kw[key] = int(opt[1:])
    return SUITE_BY_NAME[name], kw


def _variant_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def serve_echo(bind: str, secret: ClusterSecret, overrides: dict[str, Any], variants: list[str] | None = None) -> list[Transport]:
    """One echo transport per variant (default: per suite); each sends every TensorData back to its sender."""
    base = PeerId.parse(bind)
    transports = []
    for i, spec in enumerate(variants or _variant_list(ALL_SUITES)):
        suite, kw = parse_variant(spec)
        t = Transport(PeerId(base.host, base.port + i if base.port else 0), secret, suite=suite, **{**overrides, **kw})

        def echo(msg: Message, t: Transport = t) -> None:
            t.send(msg.peer, Kind.TENSOR_DATA, msg.payload)

        t.serve(echo)
        transports.append(t)
    return transports


def _echo_main(args: argparse.Namespace, secret: ClusterSecret) -> None:
    variants = _variant_list(args.variants or ALL_SUITES)
    transports = serve_echo(args.serve_echo, secret, transport_kwargs(args), variants)
    print(json.dumps({spec: str(t.identity) for spec, t in zip(variants, transports)}), flush=True)
    try:
        sys.stdin.read()  # run until the parent closes our stdin (or Ctrl-D / Ctrl-C)
    except KeyboardInterrupt:
        pass
    finally:
        for t in transports:
            t.close()


SUITE_BY_NAME_INV = {v: k for k, v in SUITE_BY_NAME.items()}


# --- measuring side ---------------------------------------------------------------------------


class PingPong:
    """Drives the round trips from the receive handler (no thread hand-off per message)."""

    def __init__(self, transport: Transport, peer: PeerId, payload: bytes, total: int) -> None:
        self.transport, self.peer, self.payload, self.total = transport, peer, payload, total
        self.samples: list[int] = []
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._t0 = 0

    def start(self) -> None:
        self._t0 = time.perf_counter_ns()
        self.transport.send(self.peer, Kind.TENSOR_DATA, self.payload)

    def on_message(self, msg: Message) -> None:
        now = time.perf_counter_ns()
        try:
            if len(msg.payload) != len(self.payload):
                raise RuntimeError("echo returned a different length")
            self.samples.append(now - self._t0)
            if len(self.samples) >= self.total:
                self.done.set()
                return
            self.start()
        except BaseException as exc:  # noqa: BLE001 - surfaced by run()
            self.error = exc
            self.done.set()


def _percentile_us(ns: list[float], q: float) -> float:
    return percentile(ns, q) / 1000.0


def round_trips(local: Transport, router: dict[str, PingPong], peer: PeerId, payload: bytes, count: int) -> list[int]:
    """``count`` echo round trips of ``payload``; nanoseconds each."""
    pp = PingPong(local, peer, payload, count)
    router["current"] = pp
    pp.start()
    timeout = 60 + count * len(payload) / 2e8
    if not pp.done.wait(timeout):
        raise TimeoutError(f"echo of {len(payload)} bytes did not finish within {timeout:.0f}s")
    if pp.error:
        raise pp.error
    return pp.samples


def summarize(samples_ns: list[int], size: int) -> dict[str, Any]:
    """One-way statistics (half the round trip) in microseconds, bandwidth at p50."""
    one_way = sorted(s / 2 for s in samples_ns)
    p50 = _percentile_us(one_way, 50)
    return {
        "payload_bytes": size,
        "iterations": len(one_way),
        "p50_us": p50,
        "p95_us": _percentile_us(one_way, 95),
        "p99_us": _percentile_us(one_way, 99),
        "mean_us": statistics.fmean(one_way) / 1000.0,
        "one_way_gib_s": size / (p50 * 1e-6) / 2**30,
    }


class Side:
    """The measuring transport of one variant, connected to its echo listener."""

    def __init__(self, spec: str, echo_addr: PeerId, advertise: str, secret: ClusterSecret, overrides: dict[str, Any]) -> None:
        suite, variant_kw = parse_variant(spec)
        kw: dict[str, Any] = {"suite": suite, **overrides, **variant_kw}
        self.spec, self.suite, self.peer = spec, suite, echo_addr
        self.router: dict[str, PingPong] = {}
        host = f"[{advertise}]" if ":" in advertise else advertise
        self.transport = Transport(f"{host}:0", secret, **kw)
        self.transport.serve(lambda msg: self.router["current"].on_message(msg))
        self.transport.connect(echo_addr)

    def run(self, payload: bytes, count: int) -> list[int]:
        return round_trips(self.transport, self.router, self.peer, payload, count)


def run_all(sides: list[Side], sizes: list[tuple[int, int]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per size, interleave the suites in rounds so load drift hits every candidate alike."""
    rows: list[dict[str, Any]] = []
    for size, iterations in sizes:
        n = max(10, iterations // 10) if args.quick else iterations
        payload = secrets.token_bytes(size)
        rounds = max(1, min(args.rounds, n // 5))
        samples: dict[str, list[int]] = {side.spec: [] for side in sides}
        for side in sides:  # warm-up: connection buffers, allocator, caches
            side.run(payload, max(3, n // 20))
        for r in range(rounds):
            per = n // rounds + (1 if r < n % rounds else 0)
            for side in sides:
                samples[side.spec] += side.run(payload, per)
        for side in sides:
            row = summarize(samples[side.spec], size)
            opts = side.transport.options
            plain = side.spec == SUITE_BY_NAME_INV[side.suite]
            row.update(
                mode=MODE_NAMES[side.suite] + ("" if plain else f" [{side.spec}]"), variant=side.spec,
                suite=side.suite.name.lower(), chunk_len=opts.chunk_len, remote=args.remote,
                crypto_workers=opts.effective_crypto_workers, chunk_ramp_len=opts.chunk_ramp_len,
                crypto_pipeline_min_len=opts.crypto_pipeline_min_len, label=args.label,
            )
            rows.append(row)
            print(_fmt_row(row), flush=True)
    return rows


# --- output -------------------------------------------------------------------------------------


def _fmt_time(us: float) -> str:
    return f"{us:.1f} us" if us < 1000 else f"{us / 1000:.3f} ms" if us < 10000 else f"{us / 1000:.2f} ms"


def _fmt_size(n: int) -> str:
    return f"{n // (1024 * 1024)} MiB" if n >= 1024 * 1024 else f"{n // 1024} KiB"


def _fmt_row(r: dict[str, Any]) -> str:
    return (
        f"{r['mode']:<52} {_fmt_size(r['payload_bytes']):>7} {r['iterations']:>6} {_fmt_time(r['p50_us']):>10} "
        f"{_fmt_time(r['p95_us']):>10} {_fmt_time(r['p99_us']):>10} {r['one_way_gib_s']:>8.2f} GiB/s"
    )


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'Mode':<52} {'Payload':>7} {'Iters':>6} {'p50':>10} {'p95':>10} {'p99':>10} {'One-way bandwidth':>14}")
    for r in rows:
        print(_fmt_row(r))
    base: dict[int, float] = {}
    for r in rows:  # the first unprotected variant of each size is the reference
        if r["suite"] == "unprotected":
            base.setdefault(r["payload_bytes"], r["p50_us"])
    if base:
        print("\np50 relative to unprotected:")
        for r in rows:
            if r["suite"] != "unprotected" and r["payload_bytes"] in base:
                print(f"  {r['mode']:<52} {_fmt_size(r['payload_bytes']):>7} {r['p50_us'] / base[r['payload_bytes']]:.2f}x")


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


# --- orchestration --------------------------------------------------------------------------------


def _local_ip_towards(host: str) -> str:
    """The source IP this host uses to reach ``host`` (UDP connect sends nothing)."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def _spawn_local_echo(args: argparse.Namespace, secret_file: Path) -> tuple[subprocess.Popen[str], dict[str, str]]:
    cmd = [sys.executable, "-m", "bench.frame_bench", "--serve-echo", "127.0.0.1:0"]
    if args.chunk_len:
        cmd += ["--chunk-len", str(args.chunk_len)]
    if args.socket_buffer is not None:
        cmd += ["--socket-buffer", str(args.socket_buffer)]
    if args.crypto_workers is not None:
        cmd += ["--crypto-workers", str(args.crypto_workers)]
    if args.ramp_len is not None:
        cmd += ["--ramp-len", str(args.ramp_len)]
    if args.variants:
        cmd += ["--variants", args.variants]
    env = {k: v for k, v in os.environ.items() if k != "MLXCEL_CLUSTER_SECRET"}
    env["MLXCEL_CLUSTER_SECRET_FILE"] = str(secret_file)  # a path, never the value, on the command line
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if not line:
        proc.kill()
        raise RuntimeError("the echo subprocess did not start")
    return proc, json.loads(line)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.frame_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("results/frame_bench.jsonl"), help="JSONL output (appended)")
    p.add_argument("--csv", type=Path, default=None, help="CSV output (default: --out with .csv)")
    p.add_argument("--quick", action="store_true", help="1/10 of the iterations (at least 10)")
    p.add_argument("--suites", default=ALL_SUITES, help="comma list of unprotected,hmac,aes,chacha")
    p.add_argument("--variants", default=None, help="comma list of SUITE[/wN][/rLEN][/cLEN] to compare (replaces --suites; see above)")
    p.add_argument("--sizes", default=None, help="comma list of payload sizes in bytes (default: the reference's five)")
    p.add_argument("--rounds", type=int, default=10, help="interleaving rounds per payload size")
    p.add_argument("--socket-buffer", type=int, default=None, help="SO_SNDBUF/SO_RCVBUF bytes (default: the transport's; 0: kernel autotuning)")
    p.add_argument("--chunk-len", type=int, default=None, help="override the transport's fragment size")
    p.add_argument("--crypto-workers", type=int, default=None, help="helper threads sealing/opening chunks (default: the transport's, 2 on 4+ cores; 0: off)")
    p.add_argument("--ramp-len", type=int, default=None, help="first/last chunk length with helpers (default: the transport's; 0: no ramp)")
    p.add_argument("--label", default=None, help="free text stored in every row")
    p.add_argument("--remote", default=None, metavar="HOST:PORT", help="echo peer started with --serve-echo on another host")
    p.add_argument("--advertise", default=None, metavar="IP", help="this host's IP as the remote peer sees it")
    p.add_argument("--serve-echo", default=None, metavar="BIND", help="run the echo peer on BIND (suite i at port + i)")
    p.add_argument("--cluster-secret-file", default=None, metavar="PATH")
    return p.parse_args(argv)


def _sizes(args: argparse.Namespace) -> list[tuple[int, int]]:
    if not args.sizes:
        return SIZES
    table = dict(SIZES)
    return [(int(s), table.get(int(s), 400)) for s in args.sizes.split(",")]


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.serve_echo:
        _echo_main(args, load_secret(args.cluster_secret_file))
        return 0
    measured = _variant_list(args.variants or args.suites)
    for spec in measured:
        parse_variant(spec)  # fail before any process starts
    proc = None
    with tempfile.TemporaryDirectory() as tmp:
        if args.remote:
            secret = load_secret(args.cluster_secret_file)
            base = PeerId.parse(args.remote)
            served = _variant_list(args.variants or ALL_SUITES)  # what the remote echo serves, in port order
            addrs = {spec: str(PeerId(base.host, base.port + i)) for i, spec in enumerate(served)}
            advertise = args.advertise or _local_ip_towards(base.host)
        else:
            secret_file = Path(tmp) / "cluster.secret"
            fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, secrets.token_hex(32).encode() + b"\n")
            os.close(fd)
            secret = load_secret(secret_file, env={})
            proc, addrs = _spawn_local_echo(args, secret_file)
            advertise = "127.0.0.1"
        sides: list[Side] = []
        try:
            for spec in measured:
                sides.append(Side(spec, PeerId.parse(addrs[spec]), advertise, secret, transport_kwargs(args)))
            rows = run_all(sides, _sizes(args), args)
        finally:
            for side in sides:
                side.transport.close()
            if proc is not None:
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait(10)
    print_table(rows)
    for r in rows:
        r["bench"] = "frame_bench"
        r["quick"] = args.quick
    write_jsonl(args.out, rows)
    csv_path = args.csv or args.out.with_suffix(".csv")
    write_csv(csv_path, rows)
    print(f"\nwrote {args.out} and {csv_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
