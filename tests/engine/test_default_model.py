"""End to end: the converted default model answers a simple factual chat question."""

import pytest

from mlxcel.engine.generate import stream_generate
from mlxcel.engine.prompts import encode_prompt
from mlxcel.engine.sampling import SamplingParams
from mlxcel.models.loading import load_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm(default_model):
    return load_checkpoint(default_model)


def answer(loaded, question: str, n: int = 24) -> str:
    prompt = encode_prompt(loaded.tokenizer, question)
    return "".join(c.text for c in stream_generate(loaded.model, loaded.tokenizer, prompt, SamplingParams(max_tokens=n)))


def test_capital_of_france(smollm):
    assert "Paris" in answer(smollm, "What is the capital of France?")


def test_answer_stops_at_end_of_turn(smollm):
    chunks = list(stream_generate(smollm.model, smollm.tokenizer,
                                  encode_prompt(smollm.tokenizer, "What is the capital of France?"),
                                  SamplingParams(max_tokens=40)))
    assert chunks[-1].finish_reason == "stop"
    assert "<|im_end|>" not in "".join(c.text for c in chunks)
