"""Disaggregated prefill and decode nodes of deepseek_v41 (LayerCache has no ``merge``) take concurrent requests.

Router -> prefill -> decode on real transports over loopback: three greedy requests sent at once all complete with
one node's tokens, alone. Both nodes' executors read the cap from the model's caches: every decode step is one row,
the other sequences wait their turn.
"""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.timeout(120)


async def all_at_once(engine, prompts) -> list[list[int]]:
    from tests.disagg.test_families import greedy
    from tests.engine.fakes import collect_tokens

    return list(await asyncio.gather(*(collect_tokens(engine.submit(greedy(p, f"r{i}")))
                                       for i, p in enumerate(prompts))))


@pytest.mark.proc  # loading a checkpoint runs ldconfig (tests/proc_marker.py)
def test_concurrent_deepseek_v41_requests_hand_off_and_decode_one_row_at_a_time(tiny_deepseek_v41):
    from mlxcel.engine.executor import LocalExecutor
    from mlxcel.engine.scheduler import Scheduler
    from mlxcel.models.loading import load_checkpoint
    from tests.disagg.test_families import role_services

    prompts = [tuple(range(40, 40 + n)) for n in (5, 8, 13)]
    loaded = load_checkpoint(tiny_deepseek_v41)
    reference = []
    for p in prompts:
        single = Scheduler(LocalExecutor(loaded.model, max_batch_size=1), loaded.tokenizer, context_length=2048,
                           parallel=1, warmup=False).start()
        try:
            reference += asyncio.run(all_at_once(single, [p]))
        finally:
            single.close()
    with role_services(tiny_deepseek_v41) as (router, prefill, decode):
        assert asyncio.run(all_at_once(router, prompts)) == reference
        assert decode.counters["handoffs"] == 3
        for node in (prefill, decode):
            assert node.executor.micro_batch_size == 1 and node.scheduler.counters.max_rows <= 1
