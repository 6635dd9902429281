"""A scripted ``Executor`` and a tiny tokenizer for driving the scheduler without a model.

``FakeExecutor`` records every call and answers each step with scripted ``Sampled`` tokens, either
at once (``auto``) or when the test completes it (deferred, to hold steps in flight). It also checks
the executor contract as steps arrive and keeps the violations in ``violations``.
"""

from __future__ import annotations

import asyncio
import functools
import re
import threading
import time
from typing import Any, Callable, Sequence

from mlxcel.engine.executor import Done, ExecutorBase, Step, StepOutcome
from mlxcel.engine.interface import EventStream, FinishEvent, TokenEvent
from mlxcel.engine.runner import Sampled
from mlxcel.engine.sampling import SamplingParams

EOS = 2
WAIT_S = 10.0  # a ceiling, not a delay: a passing wait returns at once; a loaded 2-core box needed more than 3 s
_DEFAULT = object()


class FakeDetokenizer:
    """Concatenates each token's piece; ``last_segment`` is the text added since the last read."""

    def __init__(self, pieces: Callable[[int], str]):
        self._piece = pieces
        self.reset()

    def reset(self) -> None:
        self.text, self.offset = "", 0

    def add_token(self, token: int) -> None:
        self.text += self._piece(token)

    def finalize(self) -> None:
        pass

    @property
    def last_segment(self) -> str:
        segment, self.offset = self.text[self.offset:], len(self.text)
        return segment


class FakeTokenizer:
    """EOS is token 2; token t reads as ``pieces[t]`` or ``<t>``."""

    eos_token_ids = {EOS}

    def __init__(self, pieces: dict[int, str] | None = None):
        self.pieces = pieces or {}

    def piece(self, token: int) -> str:
        return self.pieces.get(token, f"<{token}>")

    @property
    def detokenizer(self) -> FakeDetokenizer:
        return FakeDetokenizer(self.piece)


def logprob_of(n: int) -> float:
    """The log-probability the fake reports for a sequence's n-th sampled token."""
    return -0.5 - n


class FakeExecutor(ExecutorBase):
    """An ``Executor`` that samples ``script[rid]`` in order (then 100, 101, ...), and records everything."""

    def __init__(self, *, depth: int = 1, micro_batch_size: int = 4, auto: bool = False,
                 script: dict[str, Sequence[int]] | None = None, cached: int = 0, adopt: bool = True,
                 fill: bool = False):
        self.depth = depth
        self.micro_batch_size = micro_batch_size
        self.fill_micro_batches = fill  # the pipeline's policy on a CPU: fill one group before the next
        self.auto = auto
        self.script = {rid: list(tokens) for rid, tokens in (script or {}).items()}
        self.cached = cached  # prompt tokens prepare() reports as already cached
        self.prepared: dict[str, tuple[SamplingParams, int, tuple[int, ...]]] = {}
        self.adopted: dict[str, tuple[Any, int]] = {}
        self.released: list[tuple[str, list[int] | None]] = []
        self.steps: list[Step] = []
        self.pending: list[tuple[Step, Done]] = []
        self.violations: list[str] = []
        self.max_inflight = 0
        self.fail_prepare: Exception | None = None
        self.closed = False
        self._sampled: dict[str, int] = {}
        self._last: dict[str, int] = {}  # the token each rid sampled last (what its next decode must feed)
        self._lock = threading.Lock()
        self.adopts = adopt  # False: an executor that cannot take prefilled sequences

    # -- the Executor protocol --------------------------------------------------------------------

    def prepare(self, rid: str, params: SamplingParams, top_logprobs: int, prompt: Sequence[int]) -> int:
        if self.fail_prepare is not None:
            raise self.fail_prepare
        self.prepared[rid] = (params, top_logprobs, tuple(prompt))
        return min(self.cached, len(prompt) - 1)

    def adopt(self, rid: str, params: SamplingParams, top_logprobs: int, cache: Any, length: int) -> None:
        if self.fail_prepare is not None:
            raise self.fail_prepare
        self.adopted[rid] = (cache, length)

    def submit(self, step: Step, done: Done) -> None:
        with self._lock:
            self._check(step)
            self.steps.append(step)
            self.pending.append((step, done))
            self.max_inflight = max(self.max_inflight, len(self.pending))
        if self.auto:
            self.complete(step)

    def release(self, rid: str, tokens: Sequence[int] | None = None) -> None:
        self.released.append((rid, None if tokens is None else list(tokens)))

    def stats(self) -> dict[str, float]:
        return {"fake_steps": float(len(self.steps))}

    def health(self) -> dict[str, Any]:
        return {"status": "ok"}

    def close(self) -> None:
        self.closed = True

    # -- driving it from a test -------------------------------------------------------------------

    def outcome(self, step: Step) -> list[Sampled] | None:
        """What the step returns by the script: None for an intermediate prompt chunk."""
        if step.kind == "prefill" and not step.sample:
            return None
        return [self._sample(rid) for rid in step.rids]

    def complete(self, step: Step | None = None, outcome: StepOutcome | object = _DEFAULT) -> Step:
        """Finish ``step`` (default: the oldest in flight) with ``outcome`` (default: the script)."""
        with self._lock:
            index = 0 if step is None else next(i for i, (s, _) in enumerate(self.pending) if s is step)
            step, done = self.pending.pop(index)
        done(step, self.outcome(step) if outcome is _DEFAULT else outcome)  # type: ignore[arg-type]
        return step

    async def next_step(self, index: int = 0) -> Step:
        """The ``index``-th step in flight, once there is one."""
        await until(lambda: len(self.pending) > index, f"{index + 1} steps in flight")
        return self.pending[index][0]

    async def drive(self, finished: Callable[[], bool]) -> None:
        """Complete steps in the order they were submitted, as they come, until ``finished()``."""
        while True:
            await until(lambda: bool(self.pending) or finished(), "a step in flight or the end")
            if finished():
                return
            self.complete()

    def released_ids(self) -> list[str]:
        return [rid for rid, _ in self.released]

    def _sample(self, rid: str) -> Sampled:
        n = self._sampled.get(rid, 0)
        self._sampled[rid] = n + 1
        tokens = self.script.get(rid, [])
        token = tokens[n] if n < len(tokens) else 100 + n
        self._last[rid] = token
        return Sampled(token, logprob_of(n), ((token, logprob_of(n)), (7, -9.0)))

    def _check(self, step: Step) -> None:
        """The contract a scheduler must keep, checked as each step arrives."""
        if len(self.pending) >= self.depth:
            self.violations.append(f"step {step.id} submitted with {len(self.pending)} in flight (depth {self.depth})")
        if step.kind == "prefill":
            if any(s.kind == "prefill" for s, _ in self.pending):
                self.violations.append(f"prefill of {step.rids} while another prefill is in flight")
            return
        if len(step.rids) > self.micro_batch_size:
            self.violations.append(f"decode step of {len(step.rids)} rows (micro-batch {self.micro_batch_size})")
        if any(s.kind == "decode" and s.slot == step.slot for s, _ in self.pending):
            self.violations.append(f"micro-batch {step.slot} submitted twice at once")
        for rid, tokens in zip(step.rids, step.tokens):
            if rid in self._last and tokens != [self._last[rid]]:
                self.violations.append(f"{rid} fed {tokens}, last sampled {self._last[rid]}")


# -- asyncio helpers ------------------------------------------------------------------------------


def run_async(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run an async test function on a fresh event loop (EventStreams need a running loop)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return asyncio.run(asyncio.wait_for(fn(*args, **kwargs), 30))

    return wrapper


async def until(condition: Callable[[], bool], what: str = "condition", timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


async def settle() -> None:
    """Give the scheduler thread time to act on what it was told (for checks that nothing happened)."""
    await asyncio.sleep(0.05)


async def next_event(stream: EventStream, timeout: float = WAIT_S) -> TokenEvent | FinishEvent:
    return await asyncio.wait_for(stream.__anext__(), timeout)


async def events_now(stream: EventStream) -> list[TokenEvent | FinishEvent]:
    """The events already delivered (after a settle), without waiting for more."""
    await settle()
    out: list[TokenEvent | FinishEvent] = []
    while not stream.finished:
        try:
            out.append(await asyncio.wait_for(stream.__anext__(), 0.01))
        except asyncio.TimeoutError:
            break
    return out


async def collect(stream: EventStream) -> tuple[list[TokenEvent], FinishEvent]:
    """Every event up to the FinishEvent."""
    tokens: list[TokenEvent] = []
    while True:
        event = await next_event(stream)
        if isinstance(event, FinishEvent):
            return tokens, event
        tokens.append(event)


async def collect_tokens(stream: EventStream) -> list[int]:
    """The token ids of every event up to the FinishEvent, which must carry no error (no deadline per event:
    for real engines across processes; the test's own timeout bounds it)."""
    return [token for token, _ in await collect_scored(stream)]


async def collect_scored(stream: EventStream) -> list[tuple[int, float | None]]:
    """``collect_tokens`` with each token's log-probability (None unless the request asked for logprobs)."""
    scored: list[tuple[int, float | None]] = []
    async for event in stream:
        if isinstance(event, FinishEvent):
            assert event.error is None, event.error
            break
        scored.append((event.token, event.logprob))
    return scored


def held_of(message: str) -> float:
    """How long a held request's 503 says it was held (docs/pipeline.md §5.6)."""
    m = re.search(r"held (\d+\.\d)s of them; --resume-timeout", message)
    assert m, message
    return float(m.group(1))
