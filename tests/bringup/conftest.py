"""Fixtures of the bring-up tests: a cluster of real processes per test, the single-node reference."""

from __future__ import annotations

import pytest

from tests.bringup.procs import Bringup

CHAT = [{"role": "user", "content": "hello there"}]
CHAT_TOKENS = 12


def chat_text(url: str, *, stream: bool) -> str:
    """Greedy chat through the official openai client (streamed or whole)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    if not stream:
        reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=CHAT_TOKENS, temperature=0)
        return reply.choices[0].message.content or ""
    chunks = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=CHAT_TOKENS, temperature=0,
                                            stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.fixture(scope="session")
def single_node_chat(tiny_llama) -> str:
    """The tiny checkpoint's greedy chat answer as one node gives it (the engine core, in this process)."""
    from tests.server.util import chat_reference

    return chat_reference(tiny_llama, CHAT, CHAT_TOKENS)


@pytest.fixture
def bringup(tmp_path, tiny_llama):
    b = Bringup(tmp_path, tiny_llama)
    yield b
    b.stop()
