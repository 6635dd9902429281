"""``--kv-bits``: quantized KV caches (``mlxcel.engine.kv_quant``) on one node, batched, in the prefix cache.

The tiny checkpoint here has 32-wide heads, so ``--kv-group-size 32`` fits (the shared tiny_llama's 16 do not).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from mlxcel.engine.executor import LocalExecutor, Step
from mlxcel.engine.kv_quant import BatchQuantizedKVCache, KVBitsError, KVQuant, kv_quant, use_kv_bits
from mlxcel.engine.sampling import SamplingParams

Q8 = KVQuant(8, 32)
PROMPTS = ([1, 40, 41, 42, 43, 44, 45, 46], [1, 50, 51], [1, 60, 61, 62, 63, 64])


def make_llama(tmp_path_factory: pytest.TempPathFactory, name: str = "kv-llama") -> Path:
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    return make_random_checkpoint(tmp_path_factory.mktemp(name), family="llama", layers=4, hidden=128, heads=4,
                                  kv_heads=2)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory)


def load(path: Path, quant: KVQuant | None = None) -> Any:
    from mlxcel.models.loading import load_checkpoint

    model = load_checkpoint(path).model
    use_kv_bits(model, quant)
    return model


def greedy(ex: LocalExecutor, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Prefill each prompt, then decode all rows together in one micro-batch for ``n`` steps."""
    rids = [f"r{i}" for i in range(len(prompts))]
    tokens = []
    for rid, prompt in zip(rids, prompts):
        cached = ex.prepare(rid, SamplingParams(), 0, prompt)
        [s] = ex.run(Step("prefill", [rid], [list(prompt[cached:])]))
        tokens.append([s.token])
    for _ in range(n - 1):
        out = ex.run(Step("decode", rids, [[t[-1]] for t in tokens], slot=0))
        for t, s in zip(tokens, out):
            t.append(s.token)
    return tokens


def test_the_model_makes_quantized_caches_from_the_first_token(llama_dir):
    model = load(llama_dir, Q8)
    caches = make_prompt_cache(model)
    assert [type(c) for c in caches] == [QuantizedKVCache] * 4
    assert {(c.bits, c.group_size) for c in caches} == {(8, 32)}
    use_kv_bits(model, Q8)  # applying the same setting again changes nothing
    assert type(make_prompt_cache(model)[0]) is QuantizedKVCache


def test_bad_widths_and_group_sizes_are_refused_by_name(llama_dir):
    assert kv_quant(None) is None
    with pytest.raises(KVBitsError, match="--kv-bits must be one of 4, 8, got 3"):
        KVQuant(3)
    with pytest.raises(KVBitsError, match="--kv-group-size must be one of 32, 64, 128, got 16"):
        KVQuant(8, 16)
    model = load(llama_dir)
    with pytest.raises(KVBitsError, match="--kv-group-size 64: llama's head width 32 is not a whole number of groups"):
        use_kv_bits(model, KVQuant(8, 64))
    assert type(make_prompt_cache(model)[0]) is KVCache  # refused: nothing changed


def test_a_family_with_sliding_window_layers_is_refused_by_name(tmp_path):
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    model = load(make_random_checkpoint(tmp_path, family="gemma3_text", layers=2, hidden=128, heads=4, kv_heads=2))
    with pytest.raises(KVBitsError, match="gemma3_text's layer 0 keeps a RotatingKVCache, which mlx-lm cannot quantize"):
        use_kv_bits(model, Q8)


def test_8_bit_logits_stay_close_to_full_precision(llama_dir):
    full, q8 = load(llama_dir), load(llama_dir, Q8)
    prompt = mx.array([PROMPTS[0]])
    a, b = full(prompt, cache=make_prompt_cache(full)), q8(prompt, cache=make_prompt_cache(q8))
    err = mx.abs(a - b).max().item()
    assert 0 < err < 0.05 * mx.abs(a).max().item()  # quantized (not equal), yet close


@pytest.mark.parametrize("bits", [4, 8])
def test_batched_rows_decode_as_each_row_alone(llama_dir, bits):
    """Rows of different lengths in one quantized micro-batch (``BatchQuantizedKVCache``) give each row's own
    tokens: the left padding is masked and the rows' caches merge, extend and leave intact."""
    model = load(llama_dir, KVQuant(bits, 32))
    alone = [greedy(LocalExecutor(model, max_batch_size=1), [p], 6)[0] for p in PROMPTS]
    assert greedy(LocalExecutor(model, max_batch_size=3), list(PROMPTS), 6) == alone


def test_a_batched_quantized_cache_filters_and_extracts_rows(llama_dir):
    rows = []
    for n in (5, 2, 3):
        c = QuantizedKVCache(group_size=32, bits=8)
        c.update_and_fetch(mx.random.normal((1, 2, n, 32)), mx.random.normal((1, 2, n, 32)))
        rows.append(c)
    batch = BatchQuantizedKVCache.merge(rows)
    assert batch.size() == 5 and batch.left_padding.tolist() == [0, 3, 2]
    row = batch.extract(2)
    assert row.offset == 3
    assert all(mx.array_equal(a, b[..., :3, :]) for a, b in zip(row.keys, rows[2].keys))
    batch.filter([1, 2])  # the 2 columns both rows pad are cut
    assert batch.size() == 3 and batch.left_padding.tolist() == [1, 0]
    other = BatchQuantizedKVCache.merge([rows[0]])
    batch.extend(other)
    assert batch.size() == 5 and batch.left_padding.tolist() == [3, 2, 0]
    assert all(mx.array_equal(a, b[..., :5, :]) for a, b in zip(batch.extract(2).keys, rows[0].keys))


def test_the_prefix_cache_reuses_a_quantized_prefix(llama_dir):
    model = load(llama_dir, Q8)
    plain = greedy(LocalExecutor(model, max_batch_size=1), [PROMPTS[0] + [70, 71]], 4)
    ex = LocalExecutor(model, max_batch_size=1, prefix_cache_bytes=1 << 24)
    [out] = greedy(ex, [PROMPTS[0]], 3)
    ex.release("r0", PROMPTS[0] + out[:2])  # the tokens its cache holds: stored as a prefix entry
    assert ex.prefix.nbytes > 0
    assert greedy(ex, [PROMPTS[0] + [70, 71]], 4) == plain
    assert ex.stats()["prefix_tokens"] == len(PROMPTS[0])  # the quantized entry was cut to the shared prefix


def test_stages_loaded_with_kv_bits_decode_as_the_whole_model_with_them(llama_dir):
    """What a remote stage loads (``load_stage_runner``, --kv-bits through ``prepare``) chains to the whole
    quantized model's tokens exactly, rows batched."""
    from mlxcel.engine.executor import whole_model_runner
    from mlxcel.pipeline.slice_loading import load_stage_runner
    from tests.engine.test_families import stage_tokens

    prompts = {"a": PROMPTS[0], "b": PROMPTS[1]}
    whole = stage_tokens([whole_model_runner(load(llama_dir, Q8), max_rows=4)], prompts, 4)
    runners = [load_stage_runner(llama_dir, a, b, max_rows=4, prepare=lambda m: use_kv_bits(m, Q8))[0]
               for a, b in ((0, 2), (2, 4))]
    assert all(type(c) is QuantizedKVCache for r in runners for c in r._make_cache())  # noqa: SLF001
    assert stage_tokens(runners, prompts, 4) == whole


def test_a_served_model_holds_quantized_caches_and_a_sliding_family_fails_to_load_by_name(llama_dir, tmp_path):
    """``mlxcel serve --kv-bits`` (``ServerConfig``) reaches the engine's caches; a refusal is the load's error."""
    from mlxcel.models.random_checkpoint import make_random_checkpoint
    from mlxcel.server.runtime import ServerConfig, ServerRuntime

    runtime = ServerRuntime(ServerConfig(model=llama_dir, served_model_name="t", kv_bits=4, kv_group_size=32,
                                         warmup=False, parallel=2))
    runtime._load(pytest.fail)  # noqa: SLF001 - the loading thread's body, on this thread
    try:
        runner = runtime.engine.executor.runners[0]
        assert {(type(c), c.bits) for c in runner._make_cache()} == {(QuantizedKVCache, 4)}  # noqa: SLF001
    finally:
        runtime.engine.close()
    gemma = make_random_checkpoint(tmp_path, family="gemma3_text", layers=2, hidden=128, heads=4, kv_heads=2)
    failed = ServerRuntime(ServerConfig(model=gemma, served_model_name="g", kv_bits=8, warmup=False))
    errors: list[str] = []
    failed._load(errors.append)  # noqa: SLF001
    assert failed.state == "failed" and "gemma3_text's layer 0 keeps a RotatingKVCache" in errors[0]


def test_serve_parses_the_kv_flags_into_every_roles_server_config(tiny_llama):
    from mlxcel.cli import build_parser
    from mlxcel.commands.serve import serve_config
    from mlxcel.errors import CLIError

    def config(*argv: str):
        return serve_config(build_parser().parse_args(["serve", "--no-warmup", "-m", str(tiny_llama), *argv])).server

    assert (config().kv_bits, config().kv_group_size) == (None, 64)
    assert (config("--kv-bits", "4").kv_bits, config("--kv-bits", "8", "--kv-group-size", "32").kv_group_size) == (4, 32)
    with pytest.raises(CLIError, match="--kv-group-size needs --kv-bits"):
        config("--kv-group-size", "32")


def test_rows_joining_and_leaving_a_quantized_batch_mid_decode_keep_their_tokens(llama_dir):
    """r2 joins a running batch (``extend``), then r0 leaves it (``filter``): every row's tokens are its own."""
    model = load(llama_dir, Q8)
    alone = [greedy(LocalExecutor(model, max_batch_size=1), [p], 7)[0] for p in PROMPTS]
    ex = LocalExecutor(model, max_batch_size=3)
    out: dict[str, list[int]] = {}

    def start(rid: str, prompt: list[int]) -> None:
        ex.prepare(rid, SamplingParams(), 0, prompt)
        out[rid] = [ex.run(Step("prefill", [rid], [list(prompt)]))[0].token]

    def step(rids: list[str]) -> None:
        for rid, s in zip(rids, ex.run(Step("decode", rids, [[out[r][-1]] for r in rids], slot=0))):
            out[rid].append(s.token)

    start("r0", PROMPTS[0])
    start("r1", PROMPTS[1])
    step(["r0", "r1"])
    step(["r0", "r1"])
    start("r2", PROMPTS[2])
    for _ in range(4):
        step(["r0", "r1", "r2"])
    step(["r1", "r2"])  # r0 has its 7 tokens and leaves
    step(["r1", "r2"])
    assert [out["r0"], out["r1"][:7], out["r2"][:7]] == alone
