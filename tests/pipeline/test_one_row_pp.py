"""Pipeline stages of a family whose caches cannot merge (llama4): the coordinator's micro-batches hold one row.

Real ``StageService``s and a real ``PipelineExecutor`` on loopback, under the scheduler: three concurrent
requests all complete with each one's greedy tokens alone on one node, every decode step one row (the two
stages still overlap: each micro-batch is one sequence); /health says why.
"""

from __future__ import annotations

import asyncio

import pytest

from mlxcel.engine.interface import EngineRequest
from mlxcel.engine.sampling import SamplingParams
from tests.engine.fakes import collect_tokens
from tests.pipeline.members import COORDINATOR_IP, STAGE_IPS, LAYERS, cluster_config, free_port, start_coordinator, \
    start_stage

pytestmark = pytest.mark.timeout(120)
PROMPTS = [(40, 41, 42, 43, 44), (50, 51, 52), (60, 61, 62, 63, 64, 65, 66)]
N = 4


def greedy(sched, prompts):
    async def main():
        streams = [sched.submit(EngineRequest(p, SamplingParams(max_tokens=N), ignore_eos=True, request_id=f"r{i}"))
                   for i, p in enumerate(prompts)]
        return await asyncio.gather(*(collect_tokens(s) for s in streams))

    return asyncio.run(main())


def test_llama4_stages_decode_one_row_per_micro_batch(tmp_path):
    from mlxcel.engine.executor import LocalExecutor, cap_rows, slice_runner
    from mlxcel.engine.scheduler import Scheduler
    from mlxcel.models.facts import model_facts
    from mlxcel.models.loading import load_checkpoint
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    path = make_random_checkpoint(tmp_path / "llama4", family="llama4", layers=4)
    loaded, facts = load_checkpoint(path), model_facts(path)
    alone = []
    for p in PROMPTS:
        single = Scheduler(LocalExecutor(loaded.model, max_batch_size=1), loaded.tokenizer, context_length=512,
                           warmup=False).start()
        try:
            alone += greedy(single, [p])
        finally:
            single.close()
    config = cluster_config(f"{COORDINATOR_IP}:{free_port(COORDINATOR_IP)}",
                            [f"{ip}:{free_port(ip)}" for ip in STAGE_IPS], exchange_s=10)
    stages = [start_stage(config, i, slice_runner(loaded.model, a, b, max_rows=4), facts)
              for i, (a, b) in enumerate(LAYERS)]
    sched = None
    try:
        coordinator, _ = start_coordinator(config, facts, one_row=cap_rows(loaded.model))
        sched = Scheduler(coordinator, loaded.tokenizer, context_length=512, parallel=3, warmup=False).start()
        assert greedy(sched, PROMPTS) == alone
        assert coordinator.micro_batch_size == 1 and sched.counters.max_rows == 1
        assert sched.health()["batching"] == "one row at a time (ChunkedKVCache has no merge)"
    finally:
        if sched is not None:
            sched.close()
        for s in stages:
            s.close()


def test_the_coordinator_role_reads_the_cap_from_the_model_it_loads_without_weights(tmp_path, monkeypatch):
    """``coordinator_factory`` (the coordinator role's engine) hands the lazily built model's cap to its executor."""
    from types import SimpleNamespace

    import mlxcel.pipeline.coordinator as coordinator
    from mlxcel.entrypoints.coordinator import coordinator_factory
    from mlxcel.models.loading import load_checkpoint
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    class Stop(Exception):
        pass

    seen = {}

    class Executor:
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)

        def start(self):
            raise Stop

        def close(self):
            pass

    monkeypatch.setattr(coordinator, "PipelineExecutor", Executor)
    dist = SimpleNamespace(cluster=None, micro_batch_size=None, return_logits=False)
    for family, batching in (("llama4", "one row at a time (ChunkedKVCache has no merge)"), ("llama", None)):
        path = make_random_checkpoint(tmp_path / family, family=family, layers=4)
        loaded = load_checkpoint(path, lazy=True)
        with pytest.raises(Stop):
            coordinator_factory(dist, object())(loaded.model, loaded.tokenizer, 512,
                                                SimpleNamespace(model=path, max_batch_size=4))
        assert (seen["one_row"] and seen["one_row"].batching) == batching
