"""The bounds of resuming (``ResumePolicy``) and how often a waiting request tries again (``RETRY_S``).

Shared by the scheduler's resume object (``mlxcel.engine.resume``, which re-exports both), the hold of
new requests (``mlxcel.engine.holding``), the pipeline coordinator and the disaggregated router. It
imports nothing of the engine, so any of them may import it.

``ResumePolicy`` bounds a resume: at most ``max_resumes`` resumes per request (0: fail as before), each
waiting at most ``wait_s`` for a node to take the request again; after that the request ends with the
failure's own retryable code (HTTP 503 + Retry-After). ``--max-resumes`` and ``--resume-timeout`` set
them (``mlxcel.config``); docs/pipeline.md §5.6 and docs/disagg.md §6 say what cannot be resumed.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxcel.config import DEFAULT_MAX_RESUMES, DEFAULT_RESUME_TIMEOUT_S, MAX_RESUMES

RETRY_S = 0.5  # a request waiting to resume tries again this often


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
