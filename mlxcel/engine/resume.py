"""Resuming a request whose node failed mid-stream: the bounds, and the executor hook that allows it.

A request in flight holds everything needed to go on after the node (a pipeline stage, a decode
node) that held its KV cache died, froze or restarted: its prompt and the tokens already streamed.
A resume re-prefills ``prompt + generated`` (on the restarted node or another one), samples the next
token with the sampler advanced past the ``len(generated)`` draws already made (``draw_seed`` in
``mlxcel.engine.sampling``: a token's random key depends only on the seed and its position), and
goes on streaming: the client sees neither an error nor a duplicated or missing token, greedy output
equals an undisturbed run and a seeded one continues its random sequence.

``ResumePolicy`` bounds it: at most ``max_resumes`` resumes per request (0: fail as before), each
waiting at most ``wait_s`` for a node to take the request again; after that the request ends with the
failure's own retryable code (HTTP 503 + Retry-After). ``--max-resumes`` and ``--resume-timeout``
set them (``mlxcel.config``); docs/pipeline.md §5.6 and docs/disagg.md §6 say what cannot be resumed.

An executor that can resume (``mlxcel.pipeline.coordinator.PipelineExecutor``) has a
``resume_policy`` attribute and a ``resumable(exc)`` method: whether a failed step lost the
sequence's state to a node failure (resume it) rather than failed on the request itself (end it).
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
