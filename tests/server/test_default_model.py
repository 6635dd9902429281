"""The real default model behind the server (slow: skipped when models/smollm2-135m-instruct is absent)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180), pytest.mark.proc]
QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?"]


def test_concurrent_greedy_chat_equals_single_sequence(start_server, default_model):
    from mlxcel.engine.generate import stream_generate
    from mlxcel.engine.prompts import encode_chat
    from mlxcel.engine.sampling import SamplingParams
    from mlxcel.models.loading import load_checkpoint

    server = start_server(default_model, "--parallel", "4", "--served-model-name", "smol")
    loaded = load_checkpoint(default_model)

    def single(question: str) -> str:
        ids = encode_chat(loaded.tokenizer, [{"role": "user", "content": question}])
        return "".join(c.text for c in stream_generate(loaded.model, loaded.tokenizer, ids,
                                                        SamplingParams(max_tokens=16)))

    def served(question: str) -> dict:
        body = {"model": "smol", "messages": [{"role": "user", "content": question}], "max_tokens": 16,
                "temperature": 0}
        return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        answers = list(pool.map(served, QUESTIONS))
    for question, answer in zip(QUESTIONS, answers):
        assert answer["choices"][0]["message"]["content"] == single(question)
    assert "Paris" in answers[0]["choices"][0]["message"]["content"]
