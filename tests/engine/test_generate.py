"""Generation: greedy matches mlx-lm, seeds reproduce, stops and limits end with the right reason."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from mlxcel.engine.generate import GenerationStats, stream_generate
from mlxcel.engine.sampling import SamplingError, SamplingParams
from mlxcel.engine.stops import StopMatcher
from mlxcel.models.loading import load_checkpoint
from mlxcel.pipeline.inprocess import InProcessPipeline
from mlxcel.topology.partition import layer_costs, plan_stages

PROMPT = [1, 40, 41, 42, 43, 44]


@pytest.fixture(scope="module")
def loaded(tiny_llama):
    return load_checkpoint(tiny_llama)


def tokens_of(loaded, params, **kw):
    return [c.token for c in stream_generate(loaded.model, loaded.tokenizer, PROMPT, params, **kw) if c.token is not None]


def test_greedy_equals_mlx_lm_generate_step(loaded):
    ours = tokens_of(loaded, SamplingParams(max_tokens=16, logprobs=True))
    reference = []
    for token, _ in generate_step(mx.array(PROMPT), loaded.model, max_tokens=16):
        if token in loaded.tokenizer.eos_token_ids:
            break
        reference.append(token)
    assert ours == reference
    assert len(ours) >= 8


def test_pipeline_of_slices_generates_the_same_tokens(loaded):
    ranges = [(s.start, s.end) for s in plan_stages(layer_costs(loaded.path), 2)]  # the engine's own split
    assert ranges == [(0, 2), (2, 4)]
    pipe = InProcessPipeline(loaded.model, ranges)
    params = SamplingParams(max_tokens=8, logprobs=True)
    piped = [c.token for c in stream_generate(pipe, loaded.tokenizer, PROMPT, params) if c.token is not None]
    assert piped == tokens_of(loaded, params)


def test_seed_reproduces_and_differs(loaded):
    hot = dict(max_tokens=16, temperature=1.5, logprobs=True)
    a = tokens_of(loaded, SamplingParams(seed=7, **hot))
    b = tokens_of(loaded, SamplingParams(seed=7, **hot))
    c = tokens_of(loaded, SamplingParams(seed=8, **hot))
    assert a == b
    assert a != c


def test_top_k_one_is_greedy(loaded):
    greedy = tokens_of(loaded, SamplingParams(max_tokens=8, logprobs=True))
    topk = tokens_of(loaded, SamplingParams(max_tokens=8, temperature=1.0, top_k=1, seed=3, logprobs=True))
    assert topk == greedy


def test_length_finish_and_stats(loaded):
    stats = GenerationStats()
    chunks = list(stream_generate(loaded.model, loaded.tokenizer, PROMPT, SamplingParams(max_tokens=5), stats=stats))
    assert chunks[-1].finish_reason == "length"
    assert stats.generation_tokens == 5
    assert stats.prompt_tokens == len(PROMPT)
    assert stats.prompt_tps > 0 and stats.decode_tps > 0
    assert len(stats.token_times) == 4


def test_eos_finishes_with_stop(loaded, monkeypatch):
    first = tokens_of(loaded, SamplingParams(max_tokens=1, logprobs=True))[0]
    monkeypatch.setattr(type(loaded.tokenizer), "eos_token_ids", property(lambda self: {first}))
    chunks = list(stream_generate(loaded.model, loaded.tokenizer, PROMPT, SamplingParams(max_tokens=10)))
    assert chunks[-1].finish_reason == "stop"
    assert "".join(c.text for c in chunks) == ""


def test_stop_string_truncates_output(loaded):
    full = "".join(c.text for c in stream_generate(loaded.model, loaded.tokenizer, PROMPT, SamplingParams(max_tokens=12)))
    assert len(full) >= 4
    stop = full[2:4]
    chunks = list(stream_generate(loaded.model, loaded.tokenizer, PROMPT, SamplingParams(max_tokens=12, stop=(stop,))))
    text = "".join(c.text for c in chunks)
    assert text == full[: full.find(stop)]
    assert chunks[-1].finish_reason == "stop"


def test_stop_matcher_holds_back_partial_stop():
    m = StopMatcher(["END"])
    assert m.feed("abcE") == "abc"
    assert m.feed("N") == ""
    assert m.feed("X") == "ENX"
    assert m.feed("yyEND zz") == "yy"
    assert m.stopped
    assert m.feed("more") == ""


def test_stop_matcher_flush_returns_held_text():
    m = StopMatcher(["</s>"])
    assert m.feed("hi </") == "hi "
    assert m.flush() == "</"


@pytest.mark.parametrize("kwargs,param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"stop": ("",)}, "stop"),
])
def test_sampling_params_validation(kwargs, param):
    with pytest.raises(SamplingError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
