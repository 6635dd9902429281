"""``TransportOptions``: every bound and default of one transport (docs/protocol.md §8)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .aead_pipeline import auto_pipeline_min_len, auto_workers
from .wire import (
    ASSIGNMENT_MAX_PENDING_HANDSHAKES,
    ASSIGNMENT_MAX_PENDING_HANDSHAKES_PER_SOURCE,
    DEFAULT_CHUNK_LEN,
    DEFAULT_CHUNK_RAMP_LEN,
    DEFAULT_SOCKET_BUFFER,
    DEFAULT_SUITE,
    HANDSHAKE_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_FRAME_LEN,
    MAX_MESSAGE_LEN,
    MAX_PENDING_HANDSHAKES,
    MAX_PENDING_HANDSHAKES_PER_SOURCE,
    MAX_RECONNECT_ATTEMPTS,
    RECONNECT_BASE_DELAY_S,
    RECONNECT_MARGIN_S,
    RECONNECT_MAX_DELAY_S,
    SEQ_LIMIT,
    Channel,
    Suite,
)


@dataclass(frozen=True)
class TransportOptions:
    """Bounds and defaults of one transport (reference defaults)."""

    suite: Suite = DEFAULT_SUITE
    channel: Channel = Channel.TRANSPORT
    max_connections: int = MAX_CONNECTIONS
    max_pending_handshakes: int = MAX_PENDING_HANDSHAKES
    max_pending_handshakes_per_ip: int = MAX_PENDING_HANDSHAKES_PER_SOURCE
    handshake_timeout: float = HANDSHAKE_TIMEOUT_S
    connect_timeout: float = HANDSHAKE_TIMEOUT_S
    max_frame_len: int = MAX_FRAME_LEN
    max_message_len: int = MAX_MESSAGE_LEN
    chunk_len: int = DEFAULT_CHUNK_LEN
    max_reconnect_attempts: int = MAX_RECONNECT_ATTEMPTS
    reconnect_base_delay: float = RECONNECT_BASE_DELAY_S
    reconnect_max_delay: float = RECONNECT_MAX_DELAY_S
    #: seconds a dial keeps retrying retryable failures (beyond max_reconnect_attempts);
    #: None: handshake_timeout + RECONNECT_MARGIN_S; 0: the attempt count alone
    reconnect_budget: float | None = None
    send_timeout: float = 60.0
    request_timeout: float = 30.0
    seq_limit: int = SEQ_LIMIT
    bind_outbound: bool = True
    #: SO_SNDBUF/SO_RCVBUF in bytes (capped by the kernel); None keeps its autotuning
    socket_buffer: int | None = DEFAULT_SOCKET_BUFFER
    #: helper threads that seal and open the chunks of large AEAD messages beside the
    #: socket copy (pipeline.py); None: 2 on a host with 4+ usable cores, else 0; 0: off
    crypto_workers: int | None = None
    #: with helpers, a fragmented message's first chunks grow from this length to
    #: chunk_len and its last ones shrink back to it (messages.chunk_sizes); 0: no ramp
    chunk_ramp_len: int = DEFAULT_CHUNK_RAMP_LEN
    #: with helpers, only messages of at least this many body bytes use them, on either end; 0: every
    #: fragmented message; None: MLXCEL_CRYPTO_PIPELINE_MIN_LEN if set, else 4 MiB (resolved when a transport starts)
    crypto_pipeline_min_len: int | None = None

    @property
    def effective_crypto_workers(self) -> int:
        """``crypto_workers`` with None resolved for this host."""
        if self.crypto_workers is None:
            return auto_workers()
        return self.crypto_workers

    @property
    def effective_crypto_pipeline_min_len(self) -> int:
        """``crypto_pipeline_min_len`` with None resolved (the environment, else 4 MiB)."""
        if self.crypto_pipeline_min_len is None:
            return auto_pipeline_min_len()
        return self.crypto_pipeline_min_len

    @property
    def dial_budget(self) -> float:
        """Seconds from a dial's first attempt during which retryable failures are retried."""
        if self.reconnect_budget is None:
            return self.handshake_timeout + RECONNECT_MARGIN_S
        return self.reconnect_budget

    @classmethod
    def for_assignment(cls, **overrides: object) -> "TransportOptions":
        """The --pp-auto stage assignment channel: its own keys and a pending pool of 8 (4 per source)."""
        base = cls(
            channel=Channel.ASSIGNMENT,
            max_pending_handshakes=ASSIGNMENT_MAX_PENDING_HANDSHAKES,
            max_pending_handshakes_per_ip=ASSIGNMENT_MAX_PENDING_HANDSHAKES_PER_SOURCE,
        )
        return replace(base, **overrides)  # type: ignore[arg-type]
