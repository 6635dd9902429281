"""The prefill node's side of a split handoff (docs/disagg.md §4.9): a header stream and N part streams.

HEADER and SPLIT go on the handoff's lane; part stream i goes on lane (lane + i) mod N from its own worker
thread, so each part is sealed on its own core. The header stream stays open until every part stream ended;
when one fails (its lane died) or the request is cancelled, every other stream of the handoff is aborted, so
the decode node drops all of it, and the failure is raised for the caller to report (the router then fails the
request over or resumes it as after any failed handoff).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Executor
from typing import Any, Callable

from mlxcel.cluster.errors import ClusterError
from mlxcel.disagg.kv_codec import contiguous_runs
from mlxcel.disagg.kv_split import encode_part, encode_split, range_parts, ranges, total_bytes
from mlxcel.error_codes import ErrorCode


def send_split(transport: Any, target: Any, header: bytes, tensors: Any, lane: int, count: int,
               workers: Executor, stopped: Callable[[], bool]) -> int | None:
    """Send the handoff: the bytes sent, None when ``stopped()`` turned true on the way; ``ClusterError`` when
    a stream of it failed (every other one aborted)."""
    writer = transport.open_stream(target, lane)
    writer.write(header)
    writer.write(encode_split(count))
    failed: list[ClusterError] = []
    futures = [workers.submit(_send_part, transport, target, writer.id, i, count, tensors, span, (lane + i) % count,
                              stopped, failed) for i, span in enumerate(ranges(total_bytes(tensors), count))]
    sent = [f.result() for f in futures]
    if failed or any(n is None for n in sent):
        with contextlib.suppress(ClusterError):  # the decode node drops the whole handoff
            writer.abort(ErrorCode.UNREACHABLE if failed else ErrorCode.CANCELLED,
                         "a part stream of the handoff failed" if failed else "the request was cancelled")
        if failed:
            raise failed[0]
        return None
    writer.close()
    return len(header) + 2 + sum(n for n in sent if n is not None)


def _send_part(transport: Any, target: Any, header_stream: int, index: int, count: int, tensors: Any,
               span: tuple[int, int], lane: int, stopped: Callable[[], bool], failed: list[ClusterError]) -> int | None:
    """Part stream ``index`` on ``lane`` (a worker thread): the bytes sent, None when it stopped early."""
    try:
        writer = transport.open_stream(target, lane)
        head = encode_part(header_stream, index, count)
        writer.write(head)
        sent = len(head)
        for part in range_parts((v for t in tensors for v in contiguous_runs(t)), *span):
            if stopped() or failed:
                with contextlib.suppress(ClusterError):
                    writer.abort(ErrorCode.CANCELLED, "the handoff stopped")
                return None
            writer.write(part)
            sent += sum(len(p) for p in part)
        writer.close()
        return sent
    except ClusterError as exc:
        failed.append(exc)
        return None
