"""The bounds of resuming (``ResumePolicy``) and how often a waiting request tries again (``RETRY_S``).

Shared by the scheduler's resume object (``mlxcel.engine.resume``, which re-exports both), the hold of
new requests (``mlxcel.engine.holding``), the pipeline coordinator and the disaggregated router
(``mlxcel.disagg.waiting``). It imports nothing of the engine, so any of them may import it. The
decisions both the scheduler and the router make about a request in flight are its methods, over any
record with the resume fields (``ResumeRecord``: the scheduler's ``Seq``, the router's ``Routed``):
``allows`` (the bounds), ``begin`` (a resume starts: its deadline and first try) and ``again`` (a try
failed: the next one, or give up past the deadline).

``ResumePolicy`` bounds a resume: at most ``max_resumes`` resumes per request (0: fail as before), each
waiting at most ``wait_s`` for a node to take the request again; after that the request ends with the
failure's own retryable code (HTTP 503 + Retry-After). ``--max-resumes`` and ``--resume-timeout`` set
them (``mlxcel.config``); docs/pipeline.md §5.6 and docs/disagg.md §6 say what cannot be resumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from mlxcel.config import DEFAULT_MAX_RESUMES, DEFAULT_RESUME_TIMEOUT_S, MAX_RESUMES

RETRY_S = 0.5  # a request waiting to resume (or held) tries again this often


class ResumeRecord(Protocol):
    """What the policy reads and writes of a request being resumed."""

    resumes: int  # resumes begun so far
    resume_deadline: float  # while resuming: give up at this time (monotonic)
    resume_next: float  # while resuming: the next try (monotonic)


@dataclass(frozen=True)
class ResumePolicy:
    """How often one request may be resumed, and how long each resume may wait for a node."""

    max_resumes: int = DEFAULT_MAX_RESUMES
    wait_s: float = DEFAULT_RESUME_TIMEOUT_S

    def __post_init__(self) -> None:
        if not 0 <= self.max_resumes <= MAX_RESUMES:
            raise ValueError(f"max_resumes must be 0 to {MAX_RESUMES}, got {self.max_resumes}")
        if not self.wait_s > 0:
            raise ValueError(f"the resume timeout must be > 0 seconds, got {self.wait_s}")

    @property
    def enabled(self) -> bool:
        return self.max_resumes > 0

    def allows(self, resumes: int, length: int, context_length: int) -> bool:
        """Whether a request resumed ``resumes`` times so far may be resumed again: resuming is on, its
        bound is not spent, and its ``length`` tokens (prompt + generated) fit the context to prefill again."""
        return self.enabled and resumes < self.max_resumes and length <= context_length

    def begin(self, record: ResumeRecord, now: float) -> None:
        """A resume of ``record`` begins at ``now``: one more counted, ``wait_s`` from now at most, the first
        try ``RETRY_S`` later."""
        record.resumes += 1
        record.resume_deadline, record.resume_next = now + self.wait_s, now + RETRY_S

    def again(self, record: ResumeRecord, now: float) -> bool:
        """A try to resume ``record`` failed at ``now``: True with the next try ``RETRY_S`` later, False (give
        up) once its deadline has passed."""
        if now >= record.resume_deadline:
            return False
        record.resume_next = now + RETRY_S
        return True
