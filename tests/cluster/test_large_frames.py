"""Large messages whose chunks are sealed and opened on helper threads (pipeline.py).

Sans-I/O: the chunk schedule, the reader with an ``OpenPipeline`` under any receive
split.  Sockets: round trips between transports with and without helpers (the wire
does not change), and an authenticated raw client that tampers with, reorders,
replays or transplants chunks, or announces sizes beyond the caps: the connection
closes and no part of the message reaches the handler.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxcel.cluster import messages as messages_module
from mlxcel.cluster.errors import FrameAuthError, SequenceExhausted
from mlxcel.cluster.frames import FrameOpener, FrameSealer
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.messages import Assembler, chunk_sizes, plan
from mlxcel.cluster.aead_pipeline import CryptoPool, Job, OpenPipeline, auto_pipeline_min_len, auto_workers
from mlxcel.cluster.reader import FrameReader
from mlxcel.cluster.transport import Transport
from mlxcel.cluster.wire import FRAME_HEADER, MESSAGE_BEGIN, Kind, Suite

from .conftest import CLIENT_IP, HONEST_IP, SERVER_IP, Inbox, RawClient, assert_serves, wait_until

pytestmark = pytest.mark.timeout(60)
KEY = bytes(range(32))
PEER = PeerId("127.0.0.1", 1)
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CHUNK = 64 * 1024  # what the raw client sends: each chunk is deferred to a helper (>= 32 KiB)


# --- the chunk schedule ---------------------------------------------------------------------


@FAST
@given(n=st.integers(1, 3_000_000), chunk=st.integers(1, 300_000), ramp=st.integers(0, 300_000))
def test_chunk_sizes_cover_the_body_within_bounds(n, chunk, ramp):
    sizes = chunk_sizes(n, chunk, ramp)
    assert sum(sizes) == n and all(1 <= s <= chunk for s in sizes)
    if 0 < ramp < chunk and n > 2 * ramp:
        assert sizes[0] == ramp and sizes[-1] == ramp
    if not 0 < ramp < chunk:
        assert sizes[:-1] == [chunk] * (len(sizes) - 1)


def test_ramp_grows_and_shrinks_by_doubling():
    k = 1024
    assert chunk_sizes(1024 * k, 256 * k, 64 * k) == [64 * k, 128 * k, 256 * k, 256 * k, 128 * k, 128 * k, 64 * k]
    sizes = chunk_sizes(16 * 1024 * k, 256 * k, 64 * k)
    assert sizes[:3] == [64 * k, 128 * k, 256 * k] and sizes[-2:] == [128 * k, 64 * k]
    assert chunk_sizes(1024 * k, 256 * k, 0) == [256 * k] * 4


def test_plan_with_a_ramp_carries_the_body_in_order():
    body = os.urandom(700_000)
    frames = list(plan(Kind.STREAM_DATA, body, id=9, chunk_len=CHUNK, ramp_len=16 * 1024))
    assert frames[0] == (Kind.MESSAGE_BEGIN, MESSAGE_BEGIN.pack(Kind.STREAM_DATA, len(body)) + (9).to_bytes(8, "big"))
    assert b"".join(bytes(p) for _, p in frames[1:]) == body
    assert [len(p) for _, p in frames[1:]] == chunk_sizes(len(body), CHUNK, 16 * 1024)


@FAST
@given(sizes=st.lists(st.integers(0, 200_000), min_size=1, max_size=6), ramp=st.sampled_from([0, 16 * 1024]))
def test_plan_of_a_gathered_body_cuts_frames_at_buffer_boundaries(sizes, ramp):
    pieces = [os.urandom(n) for n in sizes]
    body = b"".join(pieces)
    frames = list(plan(Kind.STREAM_DATA, [memoryview(p) for p in pieces], id=3, chunk_len=CHUNK, ramp_len=ramp))
    single = list(plan(Kind.STREAM_DATA, body, id=3, chunk_len=CHUNK, ramp_len=ramp))
    if len(single) == 1:  # a short body is one frame either way (joined)
        assert [(k, bytes(p)) for k, p in frames] == [(k, bytes(p)) for k, p in single]
        return
    assert frames[0] == single[0]  # the same MESSAGE_BEGIN: the total length
    assert b"".join(bytes(p) for _, p in frames[1:]) == body
    assert all(0 < len(p) <= CHUNK and k == Kind.MESSAGE_CONTINUE for k, p in frames[1:])
    bounds = set(itertools.accumulate(n for n in sizes if n))
    ends = set(itertools.accumulate(len(p) for _, p in frames[1:]))
    assert bounds <= ends  # no frame spans two buffers: each is sealed where it lies


# --- jobs ---------------------------------------------------------------------------------------


def test_an_unclaimed_job_runs_on_the_thread_that_needs_it():
    job = Job(lambda: threading.current_thread().name, ())
    assert job.wait() == threading.current_thread().name
    assert job.wait() == threading.current_thread().name  # once only


def test_a_job_error_reaches_its_owner_and_cancel_drops_unclaimed_jobs():
    job = Job(lambda: 1 / 0, ())
    with pytest.raises(ZeroDivisionError):
        job.wait()
    ran = []
    dropped = Job(ran.append, (1,))
    dropped.cancel()
    assert dropped.wait() is None and ran == []


def test_helpers_run_jobs_and_stop_on_close():
    pool = CryptoPool(2, name="test-crypto")
    started = threading.Barrier(3, timeout=5)
    jobs = [Job(lambda: (started.wait(), threading.current_thread().name)[1], ()) for _ in range(2)]
    for job in jobs:
        pool.submit(job)
    started.wait()  # both jobs run at once, so on two helpers
    assert {j.wait() for j in jobs} == {"test-crypto-0", "test-crypto-1"}
    pool.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("test-crypto")]


def test_auto_workers_needs_four_cores():
    assert [auto_workers(c) for c in (1, 2, 3, 4, 16)] == [0, 0, 0, 2, 2]


def test_the_crypto_workers_variable_is_checked_and_named(monkeypatch):
    monkeypatch.setenv("MLXCEL_CRYPTO_WORKERS", "3")
    assert auto_workers() == 3
    for bad, words in (("two", "a whole number, not 'two'"), ("-1", "from 0 to 64, not -1"), ("65", "from 0 to 64")):
        monkeypatch.setenv("MLXCEL_CRYPTO_WORKERS", bad)
        with pytest.raises(ValueError, match=f"MLXCEL_CRYPTO_WORKERS must be {words}"):
            auto_workers()


def test_the_pipeline_threshold_variable_is_read_when_a_transport_starts_checked_and_named(monkeypatch, make_transport):
    from mlxcel.cli import build_parser
    from mlxcel.commands.serve import check_flags
    from mlxcel.errors import CLIError

    assert make_transport(SERVER_IP).options.crypto_pipeline_min_len == 4 * 2**20  # the default
    monkeypatch.setenv("MLXCEL_CRYPTO_PIPELINE_MIN_LEN", "0")
    started = make_transport(CLIENT_IP)
    monkeypatch.setenv("MLXCEL_CRYPTO_PIPELINE_MIN_LEN", "1048576")
    assert started.options.crypto_pipeline_min_len == 0  # read once, when the transport started
    assert make_transport(CLIENT_IP, crypto_pipeline_min_len=7).options.crypto_pipeline_min_len == 7  # an option wins
    args = build_parser().parse_args(["serve", "-m", "anything"])
    for bad, words in (("4MiB", "a whole number, not '4MiB'"), ("-1", "from 0 to 1.09951e\\+12, not -1")):
        monkeypatch.setenv("MLXCEL_CRYPTO_PIPELINE_MIN_LEN", bad)
        with pytest.raises(ValueError, match=f"MLXCEL_CRYPTO_PIPELINE_MIN_LEN must be {words}"):
            auto_pipeline_min_len()
        with pytest.raises(CLIError, match="MLXCEL_CRYPTO_PIPELINE_MIN_LEN must be"):
            check_flags(args)  # mlxcel serve refuses it before it loads or binds anything


# --- the reader with an OpenPipeline (sans-I/O) --------------------------------------------------


def _wire(messages: list[bytes], chunk_len: int, ramp_len: int) -> bytes:
    sealer = FrameSealer(Suite.AES_256_GCM, KEY)
    return b"".join(
        sealer.seal(k, p) for body in messages for k, p in plan(Kind.TENSOR_DATA, body, chunk_len=chunk_len, ramp_len=ramp_len)
    )


def _reader(workers: int, chunk_len: int) -> tuple[FrameReader, Assembler, OpenPipeline, CryptoPool]:
    opener = FrameOpener(Suite.AES_256_GCM, KEY)
    pool = CryptoPool(workers)
    pipe = OpenPipeline(opener, pool, chunk_len, min_len=64)
    asm = Assembler(PEER)
    return FrameReader(opener, destination=asm.destination, capacity=chunk_len + 64, pipeline=pipe), asm, pipe, pool


def _drive(reader: FrameReader, asm: Assembler, wire: bytes, sizes: list[int]) -> list[bytes]:
    """The connection's loop: short receives, and a drain before a message is used."""
    got, off, i = [], 0, 0
    while off < len(wire) or reader.bytes_needed() == 0:
        frame = reader.read_frame()
        if frame is None:
            view, exact = reader.recv_target()
            k = min(len(view), len(wire) - off, len(view) if exact else sizes[i % len(sizes)])
            view[:k] = wire[off : off + k]
            off, i = off + k, i + 1
            reader.received(k)
            continue
        msg = asm.frame_done(*frame)
        if msg is not None:
            reader.drain()
            got.append(bytes(msg.payload))
    return got


@FAST
@given(
    bodies=st.lists(st.integers(0, 12_000), min_size=1, max_size=4),
    sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=5),
    ramp=st.sampled_from([0, 256, 1024]),
    workers=st.sampled_from([0, 2]),
)
def test_reader_with_a_pipeline_under_any_split(bodies, sizes, ramp, workers):
    messages = [os.urandom(n) for n in bodies]
    reader, asm, _, pool = _reader(workers, 2048)
    try:
        assert _drive(reader, asm, _wire(messages, 2048, ramp), sizes) == messages
    finally:
        pool.close()


def test_a_reader_with_a_threshold_takes_a_short_authenticated_message_begin_in_its_stride():
    """The threshold reads the body length from an authenticated MESSAGE_BEGIN; one too short to hold it (the
    assembler refuses it by its header, another destination may not) is returned as it is, not a crash."""
    opener = FrameOpener(Suite.AES_256_GCM, KEY)
    reader = FrameReader(opener, pipeline=OpenPipeline(opener, CryptoPool(0), 65536), pipeline_min_len=10)
    reader.receive_data(FrameSealer(Suite.AES_256_GCM, KEY).seal(Kind.MESSAGE_BEGIN, b"\x05"))
    frame = reader.next_frame()
    assert frame is not None and (frame.kind, bytes(frame.payload)) == (Kind.MESSAGE_BEGIN, b"\x05")


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("chunk", [0, 3, 6])
def test_one_tampered_chunk_fails_the_whole_message(workers, chunk):
    body = os.urandom(7 * 2048)
    wire = bytearray(_wire([body], 2048, 0))
    frame_len = 5 + 2048 + 16
    begin_len = 5 + MESSAGE_BEGIN.size + 16
    wire[begin_len + chunk * frame_len + 100] ^= 0x40  # a ciphertext byte of that chunk
    reader, asm, _, pool = _reader(workers, 2048)
    try:
        with pytest.raises(FrameAuthError, match=f"frame {chunk + 1} failed authentication"):
            _drive(reader, asm, bytes(wire), [4096])
    finally:
        pool.close()


# --- real sockets -------------------------------------------------------------------------------------


@pytest.fixture
def thread_log(monkeypatch):
    """Names of the threads that ran the pipelined seals and opens."""
    names: dict[str, set[str]] = {"seal": set(), "open": set()}
    run = Job.run

    def spy(self):
        what = {"encrypt_into": "seal", "decrypt_into": "open"}.get(getattr(self._fn, "__name__", ""))
        ran = run(self)
        if ran and what:
            names[what].add(threading.current_thread().name)
        return ran

    monkeypatch.setattr(Job, "run", spy)
    return names


def _helpers(names: set[str]) -> bool:
    return any(n.startswith("mlxcel-cluster-crypto") for n in names)


@pytest.mark.parametrize(("sender", "receiver"), [(2, 2), (2, 0), (0, 2)])
def test_large_messages_round_trip(make_transport, thread_log, sender, receiver):
    inbox = Inbox()
    srv = make_transport(SERVER_IP, crypto_workers=receiver, crypto_pipeline_min_len=0)
    srv.serve(inbox.on_message, lambda m: bytes(m.payload)[::-1])
    cli = make_transport(CLIENT_IP, crypto_workers=sender, crypto_pipeline_min_len=0)
    tensor, request, stream = os.urandom(3 * 2**20 + 7), os.urandom(600_000), os.urandom(1_000_001)
    cli.send(srv.identity, Kind.TENSOR_DATA, tensor)
    assert bytes(cli.request(srv.identity, request, timeout=20)) == request[::-1]
    with cli.open_stream(srv.identity) as s:
        s.write(stream)
    assert bytes(inbox.get(20).payload) == tensor
    data, end = inbox.get(20), inbox.get(20)
    assert bytes(data.payload) == stream and (data.kind, end.kind) == (Kind.STREAM_DATA, Kind.STREAM_END)
    # a 3 MiB message is 15 chunks: helpers claim some of them. Which thread wins a chunk is the scheduler's
    # choice, and on two loaded cores the owner can seal all 15 before a helper wakes: so up to 20 more sends
    def claimed() -> bool:
        return (not sender or _helpers(thread_log["seal"])) and (not receiver or _helpers(thread_log["open"]))

    for _ in range(20):
        if claimed():
            break
        cli.send(srv.identity, Kind.TENSOR_DATA, tensor)
        assert bytes(inbox.get(20).payload) == tensor
    assert claimed(), thread_log


def test_helpers_take_only_messages_from_the_threshold_on_either_end(make_transport, thread_log):
    """With helpers on both ends, a message below ``crypto_pipeline_min_len`` is sealed and opened by the sending
    and the reading thread alone; one at the threshold goes to the pipelines of both ends. Both arrive whole."""
    inbox = Inbox()
    srv = make_transport(SERVER_IP, crypto_workers=2, crypto_pipeline_min_len=2**21)
    srv.serve(inbox.on_message)
    cli = make_transport(CLIENT_IP, crypto_workers=2, crypto_pipeline_min_len=2**21)
    small, large = os.urandom(2**21 - 1), os.urandom(2**21)
    for _ in range(3):
        cli.send(srv.identity, Kind.TENSOR_DATA, small)
        assert bytes(inbox.get(20).payload) == small
    assert thread_log == {"seal": set(), "open": set()}  # no job at all: not even one run by its owner
    for _ in range(20):  # as in test_large_messages_round_trip: a helper may wake after the owner did it all
        cli.send(srv.identity, Kind.TENSOR_DATA, large)
        assert bytes(inbox.get(20).payload) == large
        if _helpers(thread_log["seal"]) and _helpers(thread_log["open"]):
            break
    assert thread_log["seal"] and thread_log["open"], thread_log


@pytest.mark.parametrize("suite", [Suite.AES_256_GCM, Suite.UNPROTECTED, Suite.HMAC_SHA256])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_gathered_stream_message_arrives_as_the_concatenation(make_transport, suite, workers):
    """``StreamWriter.write`` of a list of buffers: the receiver sees one message, their bytes in order."""
    inbox = Inbox()
    srv = make_transport(SERVER_IP, crypto_workers=workers, suite=suite)
    srv.serve(inbox.on_message)
    cli = make_transport(CLIENT_IP, crypto_workers=workers, suite=suite)
    pieces = [b"\x02\x00\x00\x00\x07", os.urandom(300_001), memoryview(os.urandom(700_000))[5:], b"", os.urandom(3)]
    small = [b"ab", memoryview(b"cdef")]
    with cli.open_stream(srv.identity) as s:
        s.write(pieces)
        s.write(small)
    big, short, end = inbox.get(20), inbox.get(20), inbox.get(20)
    assert bytes(big.payload) == b"".join(bytes(p) for p in pieces)
    assert bytes(short.payload) == b"abcdef" and end.kind == Kind.STREAM_END


def test_helpers_stop_when_the_transport_closes(make_transport):
    srv = make_transport(SERVER_IP, crypto_workers=2, crypto_pipeline_min_len=0)
    inbox = Inbox()
    srv.serve(inbox.on_message)
    cli = make_transport(CLIENT_IP, crypto_workers=2, crypto_pipeline_min_len=0)
    before = set(threading.enumerate())
    cli.send(srv.identity, Kind.TENSOR_DATA, bytes(2**20))
    inbox.get(10)
    helpers = [t for t in set(threading.enumerate()) - before if t.name.startswith("mlxcel-cluster-crypto")]
    assert len(helpers) == 4  # two per transport, started by the first large message
    cli.close()
    srv.close()
    assert not [t for t in helpers if t.is_alive()]


def test_sequence_limit_inside_a_pipelined_message(make_transport, caplog):
    """Seven frames do not fit in a limit of 5: the sender closes at the limit, the
    receiver never sees a part of the message, and the next message dials afresh."""
    inbox = Inbox()
    srv = make_transport(SERVER_IP, crypto_workers=2, crypto_pipeline_min_len=0)
    srv.serve(inbox.on_message)
    cli = make_transport(CLIENT_IP, crypto_workers=2, seq_limit=5, chunk_ramp_len=0, crypto_pipeline_min_len=0)
    with pytest.raises(SequenceExhausted):
        cli.send(srv.identity, Kind.TENSOR_DATA, bytes(6 * 256 * 1024))
    cli.send(srv.identity, Kind.CONTROL, b"fresh")
    assert bytes(inbox.get().payload) == b"fresh"
    assert inbox.q.empty()


# --- attacks on the chunks of one message (authenticated raw client) -----------------------------------


def _frames(raw: RawClient, body: bytes, kind: Kind = Kind.TENSOR_DATA) -> list[bytes]:
    return [raw.seal(k, bytes(p)) for k, p in plan(kind, body, chunk_len=CHUNK)]


def _closed_and_nothing_delivered(srv: Transport, secret, raw: RawClient, inbox: Inbox) -> None:
    assert raw.closed_by_peer()
    assert inbox.q.empty()
    assert_serves(srv, secret)
    assert inbox.q.empty()


#: (crypto_workers, crypto_pipeline_min_len): the chunks of the raw clients' messages (1.5 MiB at most) opened by
#: helpers; by the reader's thread with helpers present, the message being below the threshold; without helpers
TARGETS = {"helpers": (2, 0), "below-threshold": (2, 4 * 2**20), "inline": (0, 0)}


@pytest.fixture(params=list(TARGETS))
def target(request, make_transport):
    inbox = Inbox()
    workers, min_len = TARGETS[request.param]
    srv = make_transport(SERVER_IP, handshake_timeout=1.0, crypto_workers=workers, crypto_pipeline_min_len=min_len)
    srv.serve(inbox.on_message, inbox.on_request)
    return srv, inbox


@pytest.fixture
def raw(target, secret, raw_clients):
    client = RawClient(target[0], secret).handshake()
    raw_clients.append(client)
    return client


def test_honest_chunked_message_from_a_raw_client(target, raw, thread_log):
    srv, inbox = target
    body = os.urandom(5 * CHUNK + 11)
    raw.send(b"".join(_frames(raw, body)))
    assert bytes(inbox.get(10).payload) == body
    piped = bool(srv.options.crypto_workers) and len(body) >= srv.options.crypto_pipeline_min_len
    assert bool(thread_log["open"]) == piped  # the five full chunks went to the pipeline, or none did


@pytest.mark.parametrize("index", [1, 3, 6])  # first, a middle and the last chunk (frame 0 is MESSAGE_BEGIN)
@pytest.mark.parametrize("where", ["ciphertext", "tag"])
def test_tampered_chunk_fails_the_whole_message(target, raw, secret, caplog, index, where):
    srv, inbox = target
    frames = [bytearray(f) for f in _frames(raw, os.urandom(6 * CHUNK))]
    frames[index][12 if where == "ciphertext" else -1] ^= 0x01
    with caplog.at_level(logging.WARNING, "mlxcel.cluster"):
        raw.send(b"".join(frames))
        _closed_and_nothing_delivered(srv, secret, raw, inbox)
        assert wait_until(lambda: any(f"frame {index} failed authentication" in r.getMessage() for r in caplog.records))


def test_reordered_chunks(target, raw, secret):
    srv, inbox = target
    frames = _frames(raw, bytes(6 * CHUNK))  # equal chunks: only the sequence number tells them apart
    frames[2], frames[3] = frames[3], frames[2]
    raw.send(b"".join(frames))
    _closed_and_nothing_delivered(srv, secret, raw, inbox)


def test_replayed_chunk(target, raw, secret):
    srv, inbox = target
    frames = _frames(raw, bytes(6 * CHUNK))
    raw.send(b"".join(frames[:3] + [frames[2]] + frames[4:]))  # chunk 2 again instead of chunk 3
    _closed_and_nothing_delivered(srv, secret, raw, inbox)


def test_chunk_from_another_connection(target, raw, secret, raw_clients):
    srv, inbox = target
    other = RawClient(srv, secret, HONEST_IP).handshake()
    raw_clients.append(other)
    mine, theirs = _frames(raw, bytes(6 * CHUNK)), _frames(other, bytes(6 * CHUNK))
    raw.send(b"".join(mine[:4] + [theirs[4]] + mine[5:]))  # same position and length, other keys
    _closed_and_nothing_delivered(srv, secret, raw, inbox)


def test_announced_message_beyond_the_cap_is_refused_before_allocation(target, raw, secret, caplog, monkeypatch):
    srv, inbox = target
    sizes: list[int] = []
    alloc = messages_module.alloc
    monkeypatch.setattr(messages_module, "alloc", lambda n: sizes.append(n) or alloc(n))
    with caplog.at_level(logging.WARNING, "mlxcel.cluster"):
        raw.send(raw.seal(Kind.MESSAGE_BEGIN, MESSAGE_BEGIN.pack(Kind.TENSOR_DATA, 2**40)))
        _closed_and_nothing_delivered(srv, secret, raw, inbox)
        assert wait_until(lambda: any("exceeds the cap of 268435456" in r.getMessage() for r in caplog.records))
    assert all(n < 2**20 for n in sizes)


def test_chunk_header_beyond_the_frame_cap_is_refused_unread(target, raw, secret, caplog):
    srv, inbox = target
    frames = _frames(raw, bytes(4 * CHUNK))
    with caplog.at_level(logging.WARNING, "mlxcel.cluster"):
        raw.send(b"".join(frames[:2]) + FRAME_HEADER.pack(Kind.MESSAGE_CONTINUE, 0xFFFFFFFF))  # no body follows
        _closed_and_nothing_delivered(srv, secret, raw, inbox)
        assert wait_until(lambda: any("above the cap of 268435456" in r.getMessage() for r in caplog.records))


def test_chunk_running_past_the_announced_length_is_refused_from_its_header(target, raw, secret, caplog):
    srv, inbox = target
    body = bytes(3 * CHUNK)
    frames = _frames(raw, body)
    long_last = raw.seal(Kind.MESSAGE_CONTINUE, bytes(CHUNK + 1))  # one byte more than what is left
    with caplog.at_level(logging.WARNING, "mlxcel.cluster"):
        raw.send(b"".join(frames[:3]) + long_last[:5])  # the header alone: refused before its body
        _closed_and_nothing_delivered(srv, secret, raw, inbox)
        assert wait_until(lambda: any("runs past the announced message length" in r.getMessage() for r in caplog.records))


def test_other_frame_inside_a_chunked_message(target, raw, secret):
    srv, inbox = target
    frames = _frames(raw, bytes(4 * CHUNK))
    raw.send(b"".join(frames[:2]) + raw.seal(Kind.CONTROL, b"interleaved"))
    _closed_and_nothing_delivered(srv, secret, raw, inbox)
