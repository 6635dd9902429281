"""The default model (SmolLM2-135M-Instruct) through router, prefill and decode: a single node's greedy text
(the engine's single-device answer, computed in this process)."""

from __future__ import annotations

import openai
import pytest

from tests.disagg.cluster import DisaggCluster
from tests.server.util import chat_reference_reply

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]


@pytest.mark.slow
def test_default_model_router_prefill_decode_equal_a_single_node(tmp_path, default_model):
    cluster = DisaggCluster(tmp_path, default_model, node_flags=("--no-warmup", "--parallel", "2"))
    try:
        cluster.start()
        for text in PROMPTS:
            messages = [{"role": "user", "content": text}]
            ref_text, ref_reason = chat_reference_reply(default_model, messages, 12)
            kw = dict(model="tiny", messages=messages, max_tokens=12, temperature=0)
            api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0, timeout=120)
            got = api.chat.completions.create(**kw)
            assert got.choices[0].message.content == ref_text
            assert got.choices[0].finish_reason == ref_reason
            streamed = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(**kw, stream=True)
                               if c.choices)
            assert streamed == ref_text
        metrics = cluster.stats()["metrics"]
        assert metrics["router_handoffs"] == 2 * len(PROMPTS)
        assert metrics["router_handoff_bytes"] > 46_000 * 20  # 30 layers x K,V x 3 heads x 64 x 4 B per token
    finally:
        cluster.stop()
