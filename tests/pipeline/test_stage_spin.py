"""Stages whose worker and readers poll before they sleep (``MLXCEL_SPIN_US``, mlxcel/spin.py).

Real ``StageService`` stages and a real ``PipelineExecutor`` over the authenticated transport, in this process,
on the 4-layer tiny llama: with the window set, every transport and stage worker polls, and two sequences decoded
in two micro-batches give one device's tokens, also after a pause longer than the window (the worker and the
readers have gone back to sleeping); a server's scheduler over that pipeline, polling its inbox while steps are
out, streams the tokens of a scheduler over one device."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from mlxcel.engine.executor import LocalExecutor, slice_runner
from mlxcel.engine.interface import EngineRequest
from mlxcel.engine.sampling import SamplingParams
from mlxcel.engine.scheduler import Scheduler
from mlxcel.models.facts import model_facts
from tests.engine.fakes import collect_tokens, run_async
from tests.pipeline.members import (
    COORDINATOR_IP,
    LAYERS,
    MAX_ROWS,
    STAGE_IPS,
    GreedyRun,
    cluster_config,
    free_port,
    start_coordinator,
    start_stage,
)

pytestmark = pytest.mark.timeout(120)

PROMPTS = ([1, 40, 41, 42, 43], [1, 50, 51, 52, 53, 54, 55])
N = 6
WINDOW_US = 20_000


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    from mlxcel.models.loading import load_checkpoint

    return load_checkpoint(tiny_llama)


@pytest.fixture
def polling(tiny, tiny_llama, monkeypatch) -> Iterator[tuple[object, list]]:
    """A coordinator and two stages, every one started with ``MLXCEL_SPIN_US`` set."""
    monkeypatch.setenv("MLXCEL_SPIN_US", str(WINDOW_US))
    facts = model_facts(tiny_llama)
    config = cluster_config(f"{COORDINATOR_IP}:{free_port(COORDINATOR_IP)}",
                            [f"{ip}:{free_port(ip)}" for ip in STAGE_IPS], exchange_s=10.0)
    stages: list = []
    coordinator = None
    try:
        for i, (a, b) in enumerate(LAYERS):
            stages.append(start_stage(config, i, slice_runner(tiny.model, a, b, max_rows=MAX_ROWS), facts))
        coordinator, _ = start_coordinator(config, facts)
        yield coordinator, stages
    finally:
        if coordinator is not None:
            coordinator.close()
        for s in stages:
            s.close()


def test_polling_stages_give_one_devices_tokens(tiny, polling):
    coordinator, stages = polling
    expected = [GreedyRun(LocalExecutor(tiny.model, max_batch_size=MAX_ROWS), f"ref-{i}", p).run(N)
                for i, p in enumerate(PROMPTS)]
    assert [s.spin_s for s in stages] == [WINDOW_US / 1e6] * 2
    assert all(s.transport.options.spin_s == WINDOW_US / 1e6 for s in stages)
    runs = [GreedyRun(coordinator, f"seq-{i}", p, slot=i) for i, p in enumerate(PROMPTS)]
    for r in runs:
        r.step()
    time.sleep(3 * WINDOW_US / 1e6)  # longer than the window: every poller sleeps again
    assert [r.run(N) for r in runs] == expected


def _streams(executor, tokenizer) -> list[list[int]]:
    """Both prompts' greedy tokens, streamed at once by a scheduler over ``executor``."""

    @run_async
    async def both() -> list[list[int]]:
        sched = Scheduler(executor, tokenizer, context_length=2048, parallel=2, warmup=False).start()
        try:
            reqs = [EngineRequest(tuple(p), SamplingParams(max_tokens=8), ignore_eos=True, request_id=f"r{i}")
                    for i, p in enumerate(PROMPTS)]
            return list(await asyncio.gather(*(collect_tokens(sched.submit(r)) for r in reqs)))
        finally:
            sched.close()

    return both()


def test_a_scheduler_polling_its_inbox_over_polling_stages_streams_one_devices_tokens(tiny, polling, monkeypatch):
    coordinator, _ = polling
    served = _streams(coordinator, tiny.tokenizer)  # its scheduler read MLXCEL_SPIN_US when it started
    monkeypatch.delenv("MLXCEL_SPIN_US")
    assert served == _streams(LocalExecutor(tiny.model, max_batch_size=MAX_ROWS), tiny.tokenizer)
