"""Page-locked host buffers for KV handoffs, filled and drained by DMA where MLX runs on CUDA.

On CUDA, MLX arrays live in managed memory: the first CPU touch of a page the GPU wrote migrates that page,
one fault at a time. Measured on the H200 host (``bench/gpu/managed_probe.py``, 172 MB of KV): numpy copying
out of MLX arrays ran at 3.5 GiB/s, AES-GCM sealing straight from them at 2.8 GiB/s, and numpy writes that the
GPU then read at 1.7 GiB/s, while ``cudaMemcpy`` between an MLX array and a page-locked host buffer ran at
46 GiB/s. So a prefill node copies a handoff's KV into one pinned buffer (``Staging.to_host``) and seals from
that, and a decode node receives each tensor into a pinned buffer (``Staging.take``) and copies it into the
MLX array its cache will hold (``Staging.to_device``), one DMA per tensor.

Buffers come from a pool (at most ``limit`` bytes, reused by size class, never returned to the system); a
request that would pass the limit gets None, and the caller takes its unstaged path. A buffer goes back to
the pool when it is given back (``HostBuffer.release``) or when its ``HostBuffer`` is collected (a handoff
aborted half-way). Backends: ``CudaBackend`` (the libcudart MLX loaded, through ctypes: ``cudaHostAlloc``,
``cudaMemcpyAsync`` on a per-thread stream) and ``MemoryBackend`` (ordinary memory and ``memmove``: what
``MLXCEL_HANDOFF_STAGING=1`` takes without CUDA, so the path runs, and is tested, on a CPU).
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import sys
import threading
import weakref
from typing import Any, Protocol, Sequence

import numpy as np

log = logging.getLogger("mlxcel.disagg.staging")

#: bytes of page-locked buffers one process holds at most
DEFAULT_LIMIT = 4 << 30
_ALIGN = 256  # each tensor of a staged handoff starts at a multiple of this


class Backend(Protocol):
    def alloc(self, nbytes: int) -> int: ...

    def copy(self, dst: int, src: int, nbytes: int) -> None: ...  # queued on this thread's stream

    def wait(self) -> None: ...  # every copy this thread queued is done


class MemoryBackend:
    """Ordinary host memory, copied with ``memmove``."""

    def __init__(self) -> None:
        self._blocks: list[np.ndarray] = []  # the pool's memory, alive for the process

    def alloc(self, nbytes: int) -> int:
        block = np.empty(nbytes + 4096, dtype=np.uint8)
        self._blocks.append(block)
        return -(-block.ctypes.data // 4096) * 4096  # page-aligned, as cudaHostAlloc's

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    def wait(self) -> None:
        return None


class CudaBackend:
    """The CUDA runtime MLX loaded: pinned allocations and asynchronous copies on a stream per thread."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self._local = threading.local()
        lib.cudaHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                        ctypes.c_void_p]
        lib.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]

    @classmethod
    def load(cls) -> CudaBackend | None:
        """The backend over the CUDA runtime: the libcudart this process already mapped (MLX's), else one by its
        name or in an ``nvidia/*/lib`` folder on ``sys.path`` (where the CUDA wheels put it); None without one."""
        for path in cudart_paths():
            try:
                return cls(ctypes.CDLL(path))
            except (OSError, AttributeError):
                continue
        log.warning("handoff staging: MLX runs on CUDA but no libcudart could be loaded; handoffs go unstaged")
        return None

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUDA error {rc}")

    def _stream(self) -> ctypes.c_void_p:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = ctypes.c_void_p()
            self._check(self.lib.cudaStreamCreateWithFlags(ctypes.byref(stream), 1), "cudaStreamCreateWithFlags")
            self._local.stream = stream
        return stream

    def alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self._check(self.lib.cudaHostAlloc(ctypes.byref(ptr), nbytes, 0), f"cudaHostAlloc of {nbytes} bytes")
        return int(ptr.value or 0)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self._check(self.lib.cudaMemcpyAsync(dst, src, nbytes, 4, self._stream()), "cudaMemcpyAsync")

    def wait(self) -> None:
        self._check(self.lib.cudaStreamSynchronize(self._stream()), "cudaStreamSynchronize")


def cudart_paths() -> list[str]:
    """Where a CUDA runtime may be, in the order to try: the one this process mapped, the loader's names, then
    the CUDA wheels' ``nvidia/*/lib`` folders on ``sys.path``."""
    found = [p for p in (_mapped_library("libcudart.so"),) if p]
    found += ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    for base in sys.path:
        found += sorted(glob.glob(os.path.join(base or ".", "nvidia", "*", "lib", "libcudart.so*")), reverse=True)
    return found


def _mapped_library(stem: str) -> str | None:
    try:
        with open("/proc/self/maps", encoding="utf-8") as fh:
            for line in fh:
                path = line.rsplit(" ", 1)[-1].strip()
                if stem in path.rpartition("/")[2]:
                    return path
    except OSError:
        return None
    return None


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of a sixteenth of the next power of two (at most 12.5% spare)."""
    if nbytes <= 4096:
        return 4096
    step = 1 << max(12, (nbytes - 1).bit_length() - 4)
    return -(-nbytes // step) * step


class HostBuffer:
    """``nbytes`` of a pool block at ``ptr``; ``array`` is a uint8 numpy view of them."""

    def __init__(self, pool: Staging, ptr: int, capacity: int, nbytes: int) -> None:
        self.pool, self.ptr, self.nbytes = pool, ptr, nbytes
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        self._finalizer = weakref.finalize(self, pool._returned, ptr, capacity)

    def view(self, offset: int, dtype: Any, shape: Sequence[int]) -> np.ndarray:
        count = int(np.prod(shape, dtype=np.int64))
        return self.array[offset:offset + count * np.dtype(dtype).itemsize].view(dtype).reshape(shape)

    def release(self) -> None:
        """Back to the pool (once; later calls do nothing)."""
        self._finalizer()


class Staging:
    """A pool of host buffers and the copies between them and MLX arrays."""

    def __init__(self, backend: Backend, limit: int = DEFAULT_LIMIT) -> None:
        self.backend = backend
        self.limit = limit
        self._free: dict[int, list[int]] = {}  # size class -> block pointers
        # re-entrant: a buffer's finalizer (``_returned``) may run on a thread that already holds it
        self._lock = threading.RLock()
        self.held = 0  # bytes of blocks made
        self.in_use = 0  # bytes of blocks handed out

    def take(self, nbytes: int) -> HostBuffer | None:
        """A buffer of at least ``nbytes``, or None when the pool would pass its limit."""
        capacity = size_class(nbytes)
        with self._lock:
            free = self._free.get(capacity)
            if free:
                ptr = free.pop()
            elif self.held + capacity > self.limit:
                return None
            else:
                self.held += capacity
                ptr = 0
            self.in_use += capacity
        if not ptr:
            try:
                ptr = self.backend.alloc(capacity)
            except (RuntimeError, MemoryError) as exc:
                log.warning("handoff staging: %s; this handoff goes unstaged", exc)
                with self._lock:
                    self.held -= capacity
                    self.in_use -= capacity
                return None
        return HostBuffer(self, ptr, capacity, nbytes)

    def _returned(self, ptr: int, capacity: int) -> None:
        with self._lock:
            self._free.setdefault(capacity, []).append(ptr)
            self.in_use -= capacity

    def to_host(self, tensors: Sequence[np.ndarray]) -> tuple[list[np.ndarray], HostBuffer] | None:
        """Copies of ``tensors`` (numpy views of evaluated MLX arrays) in one buffer, each tensor's bytes at a
        multiple of 256, and that buffer (``release`` it once the copies are sent); None: the pool is full."""
        offsets, end = [], 0
        for t in tensors:
            offsets.append(end)
            end += -(-t.nbytes // _ALIGN) * _ALIGN
        buf = self.take(max(end, 1))
        if buf is None:
            return None
        out = []
        for t, off in zip(tensors, offsets):
            dst = buf.view(off, t.dtype, t.shape)
            if t.flags.c_contiguous:
                if t.nbytes:
                    self.backend.copy(buf.ptr + off, t.ctypes.data, t.nbytes)
            else:
                np.copyto(dst, t)  # strided: the CPU gathers it (exporters hand contiguous arrays where staging is on)
            out.append(dst)
        self.backend.wait()
        return out, buf

    def to_device(self, pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        """Copy each ``(source, target)``: a staged tensor into a C-contiguous numpy view of an evaluated MLX
        array of its size; returns when every copy is done."""
        for src, dst in pairs:
            if src.nbytes != dst.nbytes or not dst.flags.c_contiguous or not src.flags.c_contiguous:
                raise ValueError(f"cannot copy a {src.nbytes}-byte staged tensor into a {dst.nbytes}-byte array")
            if src.nbytes:
                self.backend.copy(dst.ctypes.data, src.ctypes.data, src.nbytes)
        self.backend.wait()


_SHARED: dict[str, Staging | None] = {}  # "cuda" (None where MLX is not on CUDA or has no libcudart), "memory"
_SHARED_LOCK = threading.Lock()


def shared_staging(mode: bool | None) -> Staging | None:
    """The process's pool: ``mode`` True (``MLXCEL_HANDOFF_STAGING=1``) stages on any device (CUDA's DMA where
    MLX runs on CUDA, else memory copies), False never, None (unset: the default) only where MLX runs on CUDA.
    One pool per backend, whichever mode asks for it."""
    if mode is False:
        return None
    with _SHARED_LOCK:
        if "cuda" not in _SHARED:
            cuda = CudaBackend.load() if _on_cuda() else None
            _SHARED["cuda"] = _pool(cuda) if cuda is not None else None
        if _SHARED["cuda"] is not None or not mode:
            return _SHARED["cuda"]
        if "memory" not in _SHARED:
            _SHARED["memory"] = _pool(MemoryBackend())
        return _SHARED["memory"]


def _pool(backend: Backend) -> Staging:
    log.info("handoff staging: %s buffers, at most %d MiB", type(backend).__name__, DEFAULT_LIMIT >> 20)
    return Staging(backend)


def _on_cuda() -> bool:
    """MLX's default device is a GPU on Linux: CUDA (Apple's Metal GPUs share one memory with the CPU)."""
    try:
        import mlx.core as mx

        return sys.platform.startswith("linux") and mx.default_device().type == mx.gpu
    except Exception:  # noqa: BLE001 - no MLX GPU: no CUDA staging
        return False
