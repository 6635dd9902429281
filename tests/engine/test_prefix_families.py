"""The prefix cache on every family's real caches: a hit continues exactly like a cold prefill.

For each family (``RANDOM_FAMILIES``): a first request's KV is stored when it ends; a second request
that repeats that request's prompt and answer and adds tokens (a chat's next turn) starts from it, and
a third that diverges inside the first prompt can start from a cut copy only where every layer can be
cut (``KVCache``). A linear-attention state (qwen3_next's ``ArraysCache``) or a sliding window
(gemma3_text, gpt_oss) is reused whole or not at all. Greedy tokens always equal a scheduler's without
a prefix cache.
"""

from __future__ import annotations

import asyncio

import pytest

from mlxcel.config import RANDOM_FAMILIES
from mlxcel.engine.interface import EngineRequest
from mlxcel.engine.sampling import SamplingParams
from tests.family_checkpoints import family_checkpoint  # noqa: F401  (fixture)
from tests.engine.fakes import collect_tokens

FIRST = tuple(range(40, 52))  # 12 tokens
N = 4
DIVERGING = FIRST[:8] + (7, 7, 9)


def run(loaded, prompts: list[tuple[int, ...]], prefix_bytes: int) -> tuple[list[list[int]], object]:
    """Greedy tokens of ``prompts`` one after another on one scheduler; and its executor's prefix cache."""
    from mlxcel.engine.executor import LocalExecutor
    from mlxcel.engine.scheduler import Scheduler

    executor = LocalExecutor(loaded.model, max_batch_size=2, prefix_cache_bytes=prefix_bytes)
    sched = Scheduler(executor, loaded.tokenizer, context_length=2048, parallel=2, warmup=False).start()

    async def main() -> list[list[int]]:
        out = []
        for i, p in enumerate(prompts):
            out.append(await collect_tokens(sched.submit(EngineRequest(p, SamplingParams(max_tokens=N), ignore_eos=True,
                                                                request_id=f"r{i}"))))
        return out

    try:
        return asyncio.run(main()), executor.prefix
    finally:
        sched.close()


@pytest.mark.parametrize("family", RANDOM_FAMILIES)
def test_a_prefix_hit_continues_like_a_cold_prefill(family, family_checkpoint):  # noqa: F811
    from mlx_lm.models.cache import ArraysCache, RotatingKVCache, make_prompt_cache

    from mlxcel.models.loading import load_checkpoint

    loaded = load_checkpoint(family_checkpoint(family))
    [answer] = run(loaded, [FIRST], 0)[0]
    turn = FIRST + tuple(answer) + (3, 5)
    cold, _ = run(loaded, [FIRST, turn, DIVERGING], 0)
    warm, prefix = run(loaded, [FIRST, turn, DIVERGING], 64 << 20)
    assert warm == cold
    whole_only = any(type(c) in (ArraysCache, RotatingKVCache) for c in make_prompt_cache(loaded.model))
    held = len(FIRST) + N - 1  # the first request's cache: its prompt and all but its last token
    if whole_only:
        assert (prefix.hits, prefix.reused_tokens) == (1, held)  # the next turn, whole; the diverging prompt: none
    else:
        assert (prefix.hits, prefix.reused_tokens) == (2, held + 8)  # and 8 tokens cut for the diverging one
