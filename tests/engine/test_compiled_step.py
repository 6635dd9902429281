"""The compiled decode step computes what the plain forward computes, on every family it accepts.

It is off by default (it measured slower on the H200) and forced on here, so these tests prove the
arithmetic an opt-in (MLXCEL_COMPILE_STEP=1) relies on: the same logits (float32, within 1e-5; seen exactly equal) and the same
greedy tokens over a decode that crosses a KVCache block (256 positions, where the buffers grow
and the step is traced again), for the whole model and for pipeline slices; and that every call
it does not accept (a prompt chunk, two rows, a rotating cache) takes the plain forward.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxcel.engine.compiled_step import COMPILE_ENV, CompiledDecode, compile_enabled, decode_forward
from mlxcel.engine.executor import slice_runner
from mlxcel.engine.model_slice import ModelSlice
from mlxcel.engine.runner import RowSampler
from mlxcel.engine.sampling import SamplingParams
from mlxcel.models.loading import load_checkpoint
from mlxcel.models.random_checkpoint import make_random_checkpoint

FAMILIES = ["llama", "qwen3", "qwen3_moe", "deepseek_v3"]  # deepseek_v3: MLA latents in a KVCache


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tmp_path_factory):
    path = make_random_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param, layers=4,
                                  hidden=64, heads=4, kv_heads=2, seed=3)
    return load_checkpoint(path).model


def _decode(forward, model, prompt: list[int], steps: int) -> tuple[list[int], list[mx.array]]:
    cache = make_prompt_cache(model)
    out = forward(mx.array([prompt]), cache)
    tokens, logits = [], []
    for _ in range(steps):
        tok = mx.argmax(out[:, -1], axis=-1)
        tokens.append(tok.item())
        out = forward(tok[None], cache)
        logits.append(out[:, -1].astype(mx.float32))
    return tokens, logits


def test_whole_model_same_logits_and_tokens_across_a_cache_block(model):
    plain = lambda x, c: model(x, cache=c)  # noqa: E731
    compiled = CompiledDecode(plain)
    prompt = [5, 6, 7, 8, 9] * 50 + [3]  # 251 positions: the decode crosses 256
    want, want_logits = _decode(plain, model, prompt, 12)
    got, got_logits = _decode(compiled, model, prompt, 12)
    assert got == want
    assert compiled.compiled_steps == 12  # every decode step ran compiled, the prompt did not
    worst = max(mx.abs(a - b).max().item() for a, b in zip(want_logits, got_logits))
    assert worst <= 1e-5


def test_pipeline_slices_compiled_match_the_whole_model(model):
    n = len(model.model.layers)
    pieces = [ModelSlice(model, 0, n // 2), ModelSlice(model, n // 2, n)]
    steps = [CompiledDecode(lambda x, c, p=p: p(x, c)) for p in pieces]

    def chained(x, cache):
        h = steps[0](x, cache[: n // 2])
        return steps[1](h, cache[n // 2:])

    want, _ = _decode(lambda x, c: model(x, cache=c), model, [4, 5, 6, 7], 6)
    got, _ = _decode(chained, model, [4, 5, 6, 7], 6)
    assert got == want
    assert [s.compiled_steps for s in steps] == [6, 6]


def test_a_stage_runner_decodes_compiled_when_enabled(model, monkeypatch):
    monkeypatch.setenv(COMPILE_ENV, "1")
    n = len(model.model.layers)
    runner = slice_runner(model, 0, n, max_rows=4)
    assert isinstance(runner.forward, CompiledDecode)
    runner.prepare("a", RowSampler(SamplingParams()))
    first = runner.prefill("a", mx.array([[4, 5, 6, 7]]), sample=True)
    tokens = [first[0].token]
    for _ in range(5):
        tokens.append(runner.decode(0, ["a"], mx.array([[tokens[-1]]]))[0].token)
    want, _ = _decode(lambda x, c: model(x, cache=c), model, [4, 5, 6, 7], 6)
    assert tokens == want
    assert runner.forward.compiled_steps == 5


def test_calls_it_does_not_accept_take_the_plain_forward(model):
    calls = []

    def plain(x, c):
        calls.append(x.shape)
        return model(x, cache=c)

    compiled = CompiledDecode(plain)
    cache = make_prompt_cache(model)
    compiled(mx.array([[1, 2, 3]]), cache)  # a prompt chunk
    two = [KVCache() for _ in cache]
    assert not CompiledDecode.accepts(mx.array([[1], [2]]), two)  # two rows
    assert not CompiledDecode.accepts(mx.array([[1]]), [KVCache() for _ in cache])  # nothing cached yet
    assert compiled.compiled_steps == 0 and calls == [(1, 3)]
    from mlx_lm.models.cache import RotatingKVCache

    rotating = RotatingKVCache(max_size=8)
    rotating.update_and_fetch(mx.zeros((1, 2, 1, 16)), mx.zeros((1, 2, 1, 16)))
    assert not CompiledDecode.accepts(mx.array([[1]]), [rotating])


def test_the_switch_is_off_unless_asked_and_refuses_typos(monkeypatch):
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    assert compile_enabled() is False
    monkeypatch.setenv(COMPILE_ENV, "0")
    f = lambda x, c: x  # noqa: E731
    assert decode_forward(f) is f
    monkeypatch.setenv(COMPILE_ENV, "1")
    assert isinstance(decode_forward(f), CompiledDecode)
    monkeypatch.setenv(COMPILE_ENV, "maybe")
    with pytest.raises(ValueError, match=COMPILE_ENV):
        compile_enabled()
