"""Stages whose worker and readers poll before they sleep (``MLXCEL_SPIN_US``, mlxcel/spin.py).

Real ``StageService`` stages and a real ``PipelineExecutor`` over the authenticated transport, in this process,
on the 4-layer tiny llama: with the window set, every transport and stage worker polls, and two sequences decoded
in two micro-batches give one device's tokens, also after a pause longer than the window (the worker and the
readers have gone back to sleeping)."""

from __future__ import annotations

import time

import pytest

from mlxcel.engine.executor import LocalExecutor, slice_runner
from mlxcel.models.facts import model_facts
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


def test_polling_stages_give_one_devices_tokens(tiny_llama, monkeypatch):
    from mlxcel.models.loading import load_checkpoint

    model = load_checkpoint(tiny_llama).model
    expected = [GreedyRun(LocalExecutor(model, max_batch_size=MAX_ROWS), f"ref-{i}", p).run(N)
                for i, p in enumerate(PROMPTS)]
    monkeypatch.setenv("MLXCEL_SPIN_US", str(WINDOW_US))
    facts = model_facts(tiny_llama)
    config = cluster_config(f"{COORDINATOR_IP}:{free_port(COORDINATOR_IP)}",
                            [f"{ip}:{free_port(ip)}" for ip in STAGE_IPS], exchange_s=10.0)
    stages = []
    coordinator = None
    try:
        for i, (a, b) in enumerate(LAYERS):
            stages.append(start_stage(config, i, slice_runner(model, a, b, max_rows=MAX_ROWS), facts))
        coordinator, _ = start_coordinator(config, facts)
        assert [s.spin_s for s in stages] == [WINDOW_US / 1e6] * 2
        assert all(s.transport.options.spin_s == WINDOW_US / 1e6 for s in stages)
        runs = [GreedyRun(coordinator, f"seq-{i}", p, slot=i) for i, p in enumerate(PROMPTS)]
        for r in runs:
            r.step()
        time.sleep(3 * WINDOW_US / 1e6)  # longer than the window: every poller sleeps again
        assert [r.run(N) for r in runs] == expected
    finally:
        if coordinator is not None:
            coordinator.close()
        for s in stages:
            s.close()
