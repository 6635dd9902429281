"""The router's handoff timeout bounds silence, not work: a request queued on a busy decode node lives on."""

from __future__ import annotations

import threading
import time

import openai

from tests.disagg.cluster import DisaggCluster
import pytest

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)


def test_a_request_queued_longer_than_the_handoff_timeout_still_completes(tmp_path, tiny_llama):
    cluster = DisaggCluster(tmp_path, tiny_llama, router_flags=("--handoff-timeout", "5"),
                            node_flags=("--no-warmup", "--parallel", "1", "--max-queue", "4"),
                            decode_env={"MLXCEL_TEST_DECODE_STEP_DELAY_S": "0.05"})
    try:
        cluster.start()
        api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0, timeout=60)
        results: dict[str, object] = {}

        def ask(name: str, n: int) -> None:
            try:
                results[name] = api.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": name}], max_tokens=n, temperature=0,
                    extra_body={"ignore_eos": True})
            except openai.APIError as exc:
                results[name] = exc

        first = threading.Thread(target=ask, args=("holds the only slot", 160))  # about 8 s of decoding
        first.start()
        deadline = time.monotonic() + 10
        while cluster.stats()["nodes"][1]["in_flight"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        ask("waits in the decode queue", 4)  # queued behind it longer than --handoff-timeout 5
        first.join(60)
        for name, got in results.items():
            assert not isinstance(got, Exception), f"{name}: {got}"
        assert results["waits in the decode queue"].usage.completion_tokens == 4
        assert results["holds the only slot"].usage.completion_tokens == 160
        metrics = cluster.stats()["metrics"]
        assert metrics["router_failed"] == 0 and metrics["router_failovers"] == 0  # no attempt timed out
    finally:
        cluster.stop()
