"""Sealing and opening the chunks of a large message beside the socket copy (docs/protocol.md §9).

A message above the chunk size already travels as MESSAGE_BEGIN + MESSAGE_CONTINUE
frames, each sealed under its own sequence number.  On one thread the AEAD of every
chunk sits on the round trip's critical path: seal, send, seal, send ... and receive,
open, receive, open.  ``cryptography``'s AES-GCM releases the GIL, so helper threads
can seal chunk i+1 while the connection's thread is in ``sendmsg`` with chunk i, and
open chunk i while the reader receives chunk i+1.  Nothing changes on the wire.

* ``CryptoPool``: the helper threads of one transport (lazily started).
* ``Job``: one seal or open.  A job no helper has claimed yet is run by the thread
  that needs its result, so a busy, slow or absent helper never stalls a connection.
* ``SealPipeline`` / ``OpenPipeline``: one direction's ring of slots (reused buffers
  with their own AEAD context, so no context is ever used by two threads at once).

Nothing of a message is delivered before every chunk authenticated: the reader
drains the open jobs before it hands a message on (``FrameReader.drain``).
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Callable, Sequence

from cryptography.exceptions import InvalidTag

from mlxcel import envs

from .frames import Buffer, FrameOpener, FrameSealer
from .wire import DEFAULT_CRYPTO_PIPELINE_MIN_LEN, FRAME_HEADER_LEN, NONCE_BYTES

#: slots per direction: a sender seals up to SLOTS - 1 frames ahead of the one in sendmsg
SLOTS = 4
#: frames shorter than this are opened inline (a job costs a few microseconds)
DEFER_MIN_LEN = 32 * 1024
#: hosts with fewer usable cores get no helpers by default: the peer process, the
#: reader and the sender already keep two cores busy (docs/protocol.md §9)
AUTO_MIN_CORES = 4
AUTO_WORKERS = 2
# MLXCEL_CRYPTO_WORKERS and MLXCEL_CRYPTO_PIPELINE_MIN_LEN (mlxcel/envs.py), when set, replace the automatic
# choice (``crypto_workers=None``) and DEFAULT_CRYPTO_PIPELINE_MIN_LEN (``crypto_pipeline_min_len=None``)

SendParts = Callable[[tuple[tuple[Buffer, ...], int]], None]


def usable_cores() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def auto_workers(cores: int | None = None) -> int:
    """Helpers per transport when ``crypto_workers`` is None: ``MLXCEL_CRYPTO_WORKERS`` if set (0 to 64; anything
    else is a ValueError naming it), else 2 on 4+ cores, else 0."""
    value = envs.settings().crypto_workers if cores is None else None
    if value is not None:
        return int(value)
    return AUTO_WORKERS if (usable_cores() if cores is None else cores) >= AUTO_MIN_CORES else 0


def auto_pipeline_min_len() -> int:
    """The smallest message the helpers take when ``crypto_pipeline_min_len`` is None: ``MLXCEL_CRYPTO_PIPELINE_MIN_LEN``
    if set (bytes, 0 to 2^40; anything else is a ValueError naming it), else 4 MiB."""
    value = envs.settings().crypto_pipeline_min_len
    return DEFAULT_CRYPTO_PIPELINE_MIN_LEN if value is None else int(value)


def ring_slots(workers: int) -> int:
    """Slots of one direction's ring: ``SLOTS``, or enough for every helper to hold a frame and the
    connection's thread one more (each slot is one frame's buffer: 256 KiB by default)."""
    return max(SLOTS, workers + 2)


class Job:
    """One unit of crypto work, run exactly once by a helper or by its owner."""

    __slots__ = ("_claim", "_done", "_fn", "_args", "error", "result")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self._claim = threading.Lock()
        self._done = threading.Lock()
        self._done.acquire()
        self._fn, self._args = fn, args
        self.error: BaseException | None = None
        self.result: Any = None

    def run(self) -> bool:
        """Run the job unless another thread claimed it; True when this call ran it."""
        if not self._claim.acquire(False):
            return False
        try:
            self.result = self._fn(*self._args)
        except BaseException as exc:  # noqa: BLE001 - handed to the owner by wait()
            self.error = exc
        finally:
            self._args = ()
            self._done.release()
        return True

    def wait(self) -> Any:
        """The job's result: runs it here when unclaimed, else waits for its helper; re-raises its error."""
        if not self.run():
            self._done.acquire()
            self._done.release()
        if self.error is not None:
            raise self.error
        return self.result

    def cancel(self) -> None:
        """Drop the job if unclaimed, else wait until its helper finished (its error is dropped)."""
        if self._claim.acquire(False):
            self._args = ()
            self._done.release()
            return
        self._done.acquire()
        self._done.release()


class CryptoPool:
    """``workers`` helper threads shared by a transport's connections (started on first
    use).  With 0 workers every job is run by its owner (deterministic, for tests)."""

    def __init__(self, workers: int, name: str = "mlxcel-cluster-crypto") -> None:
        if workers < 0:
            raise ValueError("crypto workers cannot be negative")
        self.workers = workers
        self._name = name
        self._q: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"CryptoPool(workers={self.workers}, started={bool(self._threads)}, closed={self._closed})"

    def submit(self, job: Job) -> None:
        """Queue ``job`` for a helper (after ``close`` its owner runs it)."""
        if not self._threads:
            if not self.workers:
                return
            self._start()
        if not self._closed:
            self._q.put(job)

    def _start(self) -> None:
        with self._lock:
            if self._threads or self._closed:
                return
            for i in range(self.workers):
                t = threading.Thread(target=self._work, name=f"{self._name}-{i}", daemon=True)
                t.start()
                self._threads.append(t)

    def _work(self) -> None:
        get = self._q.get
        while True:
            job = get()
            if job is None:
                return
            job.run()

    def close(self) -> None:
        """Stop the helpers once the queued jobs ran; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._q.put(None)
        me = threading.current_thread()
        for t in threads:
            if t is not me:
                t.join(5.0)


class SealPipeline:
    """The sending side of one connection: helpers seal frames ahead of ``sendmsg``."""

    def __init__(self, sealer: FrameSealer, pool: CryptoPool, max_payload: int, slots: int = SLOTS) -> None:
        self._sealer, self._pool = sealer, pool
        size = FRAME_HEADER_LEN + max_payload + sealer.tag_len
        self._bufs = [memoryview(bytearray(size)) for _ in range(slots)]
        self._aeads = [sealer.new_aead() for _ in range(slots)]
        self.max_payload = max_payload

    def send(self, frames: Sequence[tuple[int, Buffer]], sendmsg: SendParts) -> bool:
        """Seal ``frames`` in order of their sequence numbers and ``sendmsg`` each.

        False (nothing sent) when the direction's sequence numbers would run out in the
        middle: the caller then sends frame by frame and closes at the limit."""
        n = len(frames)
        seq0 = self._sealer.reserve(n)
        if seq0 is None:
            return False
        ring = len(self._bufs)
        jobs: list[Job | None] = [None] * ring
        totals = [0] * ring
        bufs, aeads, prepare, submit = self._bufs, self._aeads, self._sealer.prepare_at, self._pool.submit

        def queue_frame(j: int) -> None:
            i = j % ring
            kind, payload = frames[j]
            totals[i], args = prepare(seq0 + j, kind, payload, bufs[i])
            jobs[i] = job = Job(aeads[i].encrypt_into, args)  # a helper runs C code only
            submit(job)

        try:
            for j in range(min(ring, n)):
                queue_frame(j)
            for j in range(n):
                i = j % ring
                job = jobs[i]
                assert job is not None
                job.wait()
                total = totals[i]
                sendmsg(((bufs[i][:total],), total))
                if j + ring < n:
                    queue_frame(j + ring)
        finally:
            for job in jobs:
                if job is not None:
                    job.cancel()
        return True


class OpenPipeline:
    """The receiving side of one connection: the reader receives a MESSAGE_CONTINUE
    frame's ciphertext into a slot, a helper opens it into the message buffer.

    Slots are allocated on the first deferred frame.  ``drain`` waits for (or runs)
    every pending open and raises the first failure in frame order."""

    def __init__(self, opener: FrameOpener, pool: CryptoPool, max_payload: int, slots: int = SLOTS, min_len: int = DEFER_MIN_LEN) -> None:
        self._opener, self._pool = opener, pool
        self.slot_len = max_payload + opener.tag_len
        self.min_len = min_len
        self._ring = slots
        self._bufs: list[memoryview] = []
        self._aeads: list[Any] = []
        self._jobs: list[Job | None] = [None] * slots
        self._seqs = [0] * slots
        self._next = 0
        self.pending = 0

    def accepts(self, n: int) -> bool:
        """Whether a MESSAGE_CONTINUE payload of ``n`` bytes is opened by a helper."""
        return self.min_len <= n and n + self._opener.tag_len <= self.slot_len

    def slot(self, size: int) -> memoryview:
        """Where the next deferred frame's ciphertext || tag (``size`` bytes) goes."""
        if not self._bufs:
            self._bufs = [memoryview(bytearray(self.slot_len)) for _ in range(self._ring)]
            self._aeads = [self._opener.new_aead() for _ in range(self._ring)]
        i = self._next % self._ring
        if self._jobs[i] is not None:  # the slot's previous frame must be opened first
            self._finish(i)
        return self._bufs[i][:size]

    def submit(self, seq: int, header: bytes, body: memoryview, out: memoryview) -> None:
        """Open the frame just received into ``slot()``'s view: ``body`` is that view."""
        i = self._next % self._ring
        self._next += 1
        self._seqs[i] = seq
        self._jobs[i] = job = Job(self._aeads[i].decrypt_into, (seq.to_bytes(NONCE_BYTES, "big"), body, header, out))
        self.pending += 1
        self._pool.submit(job)

    def _finish(self, i: int) -> None:
        job = self._jobs[i]
        assert job is not None
        self._jobs[i] = None
        self.pending -= 1
        try:
            job.wait()
        except InvalidTag:
            raise self._opener.auth_failed(self._seqs[i]) from None

    def drain(self) -> None:
        """Wait for every pending open, oldest first; raise the first failure."""
        if not self.pending:
            return
        ring = self._ring
        order = [(self._next + k) % ring for k in range(ring)]
        try:
            for i in reversed(order):  # run here what no helper started, newest first
                job = self._jobs[i]
                if job is not None:
                    job.run()
            for i in order:  # then wait for the helpers; the first failure in frame order wins
                if self._jobs[i] is not None:
                    self._finish(i)
        finally:
            self.close()

    def close(self) -> None:
        """Drop the pending opens (the connection is closing)."""
        for i, job in enumerate(self._jobs):
            if job is not None:
                self._jobs[i] = None
                job.cancel()
        self.pending = 0
