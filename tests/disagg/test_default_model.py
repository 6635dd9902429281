"""The default model (SmolLM2-135M-Instruct) through router, prefill and decode: a single node's greedy text."""

from __future__ import annotations

import openai
import pytest

from tests.disagg.cluster import DisaggCluster
from tests.server.util import ServerProcess

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]


@pytest.mark.slow
def test_default_model_router_prefill_decode_equal_a_single_node(tmp_path, default_model):
    single = ServerProcess(default_model, "--no-warmup")
    cluster = DisaggCluster(tmp_path, default_model, node_flags=("--no-warmup", "--parallel", "2"))
    try:
        single.wait_ready(180)
        cluster.start()
        for text in PROMPTS:
            kw = dict(model="tiny", messages=[{"role": "user", "content": text}], max_tokens=12, temperature=0)
            ref = openai.OpenAI(base_url=f"{single.url}/v1", api_key="x", max_retries=0).chat.completions.create(**kw)
            api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0, timeout=120)
            got = api.chat.completions.create(**kw)
            assert got.choices[0].message.content == ref.choices[0].message.content
            assert got.choices[0].finish_reason == ref.choices[0].finish_reason
            streamed = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(**kw, stream=True)
                               if c.choices)
            assert streamed == ref.choices[0].message.content
        metrics = cluster.stats()["metrics"]
        assert metrics["router_handoffs"] == 2 * len(PROMPTS)
        assert metrics["router_handoff_bytes"] > 46_000 * 20  # 30 layers x K,V x 3 heads x 64 x 4 B per token
    finally:
        cluster.stop()
        single.stop()
