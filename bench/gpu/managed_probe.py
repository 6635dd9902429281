"""How fast the host reads and writes KV that lives in MLX's CUDA (managed) memory: the handoff's bound.

A prefill node seals its KV straight from MLX arrays (numpy views of them), and a decode node receives
into MLX arrays the same way (docs/disagg.md §4.3). On CUDA those arrays are managed memory: the first
CPU touch of a page the GPU wrote migrates it, page by page. This probe times, on a buffer of --mib
written by the GPU just before each read (fresh every time), medians over --rounds rounds whose
variant order alternates (ABBA):

read side (GPU-written -> host):
- ``numpy_copy``: ``np.copyto`` from the view into a host buffer (what sealing from the view pays);
- ``prefetch_copy``: ``cudaMemPrefetchAsync`` to the host first, then the same copy;
- ``memcpy``: ``cudaMemcpy`` (``cudaMemcpyDefault``) into a pageable host buffer;
- ``memcpy_pinned``: the same into a host buffer pinned with ``cudaHostRegister``;
- ``aes_view`` / ``aes_host``: AES-256-GCM over 256 KiB chunks on one thread, from the view / from a host
  copy (the sealing itself, with and without the migration under it);

write side (host -> GPU reads it):
- ``write_then_gpu``: ``np.copyto`` into the view, then a GPU reduction over the array;
- ``write_prefetch_gpu``: the same with ``cudaMemPrefetchAsync`` to the device before the reduction;
- ``pinned_dma_gpu``: ``cudaMemcpy`` from a page-locked host buffer into the array, then the reduction (what a
  decode node's staged receive does, ``mlxcel/disagg/host_staging.py``).

Each row: variant, MiB, median seconds and GiB/s, with the environment (JSONL, --out).

    python -m bench.gpu.managed_probe --mib 172 --rounds 6 --out /tmp/results/managed_probe.jsonl
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from bench.environment import write_jsonl

CHUNK = 256 << 10


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Cuda:
    """The few CUDA runtime calls the probe needs, through ctypes (the libcudart MLX itself loaded)."""

    HOST_TYPE, DEVICE_TYPE = 2, 1  # cudaMemLocationTypeHost, cudaMemLocationTypeDevice

    def __init__(self) -> None:
        self.lib = _load_cudart()
        version = ctypes.c_int()
        self.lib.cudaRuntimeGetVersion(ctypes.byref(version))
        self.version = version.value

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what}: CUDA error {rc}")

    def prefetch(self, ptr: int, size: int, device: int | None) -> None:
        """Migrate [ptr, ptr + size) to ``device`` (None: the host), then wait."""
        if self.version >= 13000:
            loc = _Location(self.HOST_TYPE if device is None else self.DEVICE_TYPE, 0 if device is None else device)
            fn = self.lib.cudaMemPrefetchAsync
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, _Location, ctypes.c_uint, ctypes.c_void_p]
            self.check(fn(ptr, size, loc, 0, None), "cudaMemPrefetchAsync")
        else:
            fn = self.lib.cudaMemPrefetchAsync
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            self.check(fn(ptr, size, -1 if device is None else device, None), "cudaMemPrefetchAsync")
        self.check(self.lib.cudaStreamSynchronize(None), "cudaStreamSynchronize")

    def memcpy(self, dst: int, src: int, size: int) -> None:
        fn = self.lib.cudaMemcpy
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.check(fn(dst, src, size, 4), "cudaMemcpy")  # cudaMemcpyDefault

    def register(self, ptr: int, size: int) -> None:
        fn = self.lib.cudaHostRegister
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self.check(fn(ptr, size, 0), "cudaHostRegister")


def _load_cudart() -> Any:
    from mlxcel.disagg.host_staging import cudart_paths

    for path in cudart_paths():
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise RuntimeError("no libcudart found")


def _ptr(view: Any) -> int:
    return view.__array_interface__["data"][0]


def main(argv: list[str] | None = None) -> int:
    import mlx.core as mx
    import numpy as np
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=172)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--label", default=None)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    cuda = Cuda()
    n = args.mib << 20
    elems = n // 2
    seed = mx.random.normal((elems,), dtype=mx.float16)
    mx.eval(seed)
    host = np.empty(elems, dtype=np.float16)
    pinned = np.empty(elems, dtype=np.float16)
    cuda.register(_ptr(pinned), n)
    aead = AESGCM(os.urandom(32))
    nonce = os.urandom(12)

    def fresh() -> tuple[Any, Any]:
        a = seed + 1  # written by the GPU now, in a fresh (or recycled) buffer
        mx.eval(a)
        view = np.array(a, copy=False)
        return a, view

    def aes(buf: Any) -> None:
        flat = buf.view(np.uint8)
        for off in range(0, n, CHUNK):
            aead.encrypt(nonce, flat[off:off + CHUNK], None)

    def read(kind: str) -> float:
        a, view = fresh()
        t = time.perf_counter()
        if kind == "numpy_copy":
            np.copyto(host, view)
        elif kind == "prefetch_copy":
            cuda.prefetch(_ptr(view), n, None)
            np.copyto(host, view)
        elif kind == "memcpy":
            cuda.memcpy(_ptr(host), _ptr(view), n)
        elif kind == "memcpy_pinned":
            cuda.memcpy(_ptr(pinned), _ptr(view), n)
        elif kind == "aes_view":
            aes(view)
        elif kind == "aes_host":
            cuda.memcpy(_ptr(pinned), _ptr(view), n)
            aes(pinned)
        elif kind == "prefetch_aes_view":
            cuda.prefetch(_ptr(view), n, None)
            aes(view)
        elapsed = time.perf_counter() - t
        del a, view
        return elapsed

    def write(kind: str) -> float:
        a, view = fresh()
        t = time.perf_counter()
        if kind == "pinned_dma_gpu":
            cuda.memcpy(_ptr(view), _ptr(pinned), n)
        else:
            np.copyto(view, host)
        if kind == "write_prefetch_gpu":
            cuda.prefetch(_ptr(view), n, 0)
        mx.eval(mx.sum(a))  # the GPU reads every page the host just wrote
        elapsed = time.perf_counter() - t
        del a, view
        return elapsed

    variants: dict[str, Callable[[], float]] = {
        k: (lambda k=k: read(k)) for k in ("numpy_copy", "prefetch_copy", "memcpy", "memcpy_pinned", "aes_view",
                                           "aes_host", "prefetch_aes_view")}
    variants |= {k: (lambda k=k: write(k)) for k in ("write_then_gpu", "write_prefetch_gpu", "pinned_dma_gpu")}
    names = list(variants)
    for name in names:  # warm every path once (kernels, page tables)
        variants[name]()
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(variants[name]())
    rows = []
    for name in names:
        med = statistics.median(times[name])
        rows.append({"bench": "managed_probe", "variant": name, "mib": args.mib, "rounds": args.rounds,
                     "median_s": med, "min_s": min(times[name]), "max_s": max(times[name]),
                     "gib_s": (n / (1 << 30)) / med, "cuda_runtime": cuda.version, "label": args.label})
        print(f"{name:20s} {med * 1000:8.2f} ms ({min(times[name]) * 1000:.2f}-{max(times[name]) * 1000:.2f}) "
              f"{(n / (1 << 30)) / med:6.2f} GiB/s")
    write_jsonl(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
