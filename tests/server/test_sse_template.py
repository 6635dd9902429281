"""The text-only SSE chunk renderer gives the bytes the pydantic path gives, for any text."""

from __future__ import annotations

import pytest

from mlxcel.server import protocol as p
from mlxcel.server.serving import sse, text_template

TEXTS = ["hi", " world", "é\n\"\\", "\x00", "日本語", "\ud83d", "</s>", "data: [DONE]\n\n", ""]


@pytest.mark.parametrize("text", TEXTS)
def test_chat_chunks_match_the_model_dump(text):
    def render(t: str) -> str:
        choice = p.ChatChunkChoice(delta=p.Delta(content=t), logprobs=None, finish_reason=None)
        return sse(p.ChatCompletionChunk(id="chatcmpl-1", created=1, model="m", choices=[choice]))

    assert text_template(render)(text) == render(text)


@pytest.mark.parametrize("text", TEXTS)
def test_completion_chunks_match_the_model_dump(text):
    def render(t: str) -> str:
        return sse(p.Completion(id="cmpl-1", created=1, model="m",
                                choices=[p.CompletionChoice(text=t, logprobs=None, finish_reason=None)]))

    assert text_template(render)(text) == render(text)


def test_a_renderer_that_does_not_show_the_text_once_is_used_as_it_is():
    render = lambda t: sse({"a": t, "b": t})  # noqa: E731
    assert text_template(render) is render
