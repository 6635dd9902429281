"""One greedy request through an in-process engine: its tokens and the seconds between consecutive ones (the
in-process pipelines of bench/pipeline_bench.py and bench/protection_bench.py time decode this way)."""

from __future__ import annotations

import asyncio
import time
from typing import Any


def greedy_tokens_and_gaps(engine: Any, loop: asyncio.AbstractEventLoop, prompt: list[int],
                           tokens: int) -> tuple[list[int], list[float]]:
    """``tokens`` greedy tokens (EOS ignored) from ``engine`` run on ``loop``, and the gaps between them."""
    from mlxcel.engine.interface import EngineRequest, TokenEvent
    from mlxcel.engine.sampling import SamplingParams

    async def go() -> tuple[list[int], list[float]]:
        stream = engine.submit(EngineRequest(tuple(prompt), SamplingParams(max_tokens=tokens), ignore_eos=True))
        out: list[int] = []
        gaps: list[float] = []
        last = None
        async for event in stream:
            if isinstance(event, TokenEvent):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
                out.append(event.token)
        return out, gaps

    return loop.run_until_complete(go())
