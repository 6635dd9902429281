"""``mlxcel generate --tp-size N``: rank 0 generates through the scheduler over a ``TPExecutor``.

The same path as the server (one request, no warmup), so generate and serve share every step the
followers replay. Rank 0 prints; a fatal group failure prints one line, stops the local followers
and exits 1 at once (a rank stuck in a collective cannot be joined).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from mlxcel.cluster.secret import ClusterSecret
from mlxcel.engine.interface import EngineRequest, FinishEvent, TokenEvent
from mlxcel.engine.sampling import SamplingParams
from mlxcel.parallel.errors import TPError
from mlxcel.parallel.options import TPOptions
from mlxcel.parallel.session import RankZero
from mlxcel.process import error_line


class TPGeneration:
    """Rank 0 of a generate run: ``with TPGeneration(...) as gen: gen.stream(prompt, params)``."""

    def __init__(self, tp: TPOptions, model_dir: Path, secret: ClusterSecret | None, kv: Any = None):
        self.tp = tp
        self.model_dir = model_dir
        self.kv = kv  # --kv-bits: a KVQuant, the same on every rank (None: full precision)
        self.rank0 = RankZero(tp, model_dir, secret, max_batch_size=1, prefix_cache_bytes=0,
                              **({"kv_bits": kv.bits, "kv_group_size": kv.group_size} if kv is not None else {}))
        self.loaded: Any = None
        self.scheduler: Any = None
        self.backend = ""

    def __enter__(self) -> "TPGeneration":
        from mlxcel.engine.kv_quant import use_kv_bits
        from mlxcel.engine.scheduler import Scheduler
        from mlxcel.models.loading import load_checkpoint
        from mlxcel.models.facts import context_length

        try:
            self.rank0.start()
            assert self.rank0.spec is not None
            self.backend = self.rank0.spec.backend
            self.loaded = load_checkpoint(self.model_dir, lazy=True)
            use_kv_bits(self.loaded.model, self.kv)
            self.rank0.shard(self.loaded.model)
            executor = self.rank0.executor(self.loaded.model, self._fatal)
            self.scheduler = Scheduler(executor, self.loaded.tokenizer, context_length=context_length(self.loaded.config),
                                       parallel=1, max_queue=0, warmup=False).start()
        except BaseException:
            self.rank0.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        self.rank0.close()

    def _fatal(self, message: str) -> None:
        error_line(self.rank0.explain(message))
        self.rank0.kill_followers()
        sys.stdout.flush()
        os._exit(1)

    def stream(self, prompt: list[int], params: SamplingParams) -> Iterator[TokenEvent | FinishEvent]:
        """The request's events, as they come."""
        loop = asyncio.new_event_loop()

        async def submit() -> Any:
            return self.scheduler.submit(EngineRequest(tuple(prompt), params))

        try:
            events = loop.run_until_complete(submit())
            while True:
                event = loop.run_until_complete(events.__anext__())
                yield event
                if isinstance(event, FinishEvent):
                    if event.error:
                        raise TPError(event.error)
                    return
        finally:
            loop.close()


def timed(events: Iterator[TokenEvent | FinishEvent], stats: Any) -> Iterator[TokenEvent | FinishEvent]:
    """Fill ``stats`` (an ``engine.generate.GenerationStats``) from event arrival times."""
    start = last = time.perf_counter()
    for event in events:
        now = time.perf_counter()
        if isinstance(event, TokenEvent):
            if stats.generation_tokens == 0:
                stats.prompt_seconds = now - start
            else:
                stats.token_times.append(now - last)
                stats.decode_seconds += now - last
            stats.generation_tokens += 1
            last = now
        yield event
