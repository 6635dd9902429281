"""Asynchronous scheduling over ``LocalExecutor`` (lookahead 1: step N+1 queued on the device before step N's
tokens are read) gives exactly what the synchronous scheduler gives: the same tokens in the same order, the
same stops, lengths, log-probabilities and cancellations, and the same prefix-cache entries.

Each test runs the same requests through both (``lookahead`` 0 and 1) on a tiny random llama and compares
every event; a token emitted out of order, or one past a stop, EOS, ``max_tokens`` or a cancel, differs.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mlxcel.engine.executor import PREVIOUS, LocalExecutor, Step
from mlxcel.engine.interface import EngineRequest, FinishEvent, TokenEvent
from mlxcel.engine.sampling import SamplingParams
from mlxcel.engine.scheduler import Scheduler
from tests.engine.fakes import FakeTokenizer, collect

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def model(tiny_llama) -> Any:
    from mlxcel.models.loading import load_checkpoint

    return load_checkpoint(tiny_llama).model


class Tokenizer(FakeTokenizer):
    """The fake tokenizer with a chosen EOS set."""

    def __init__(self, eos: set[int] | None = None, pieces: dict[int, str] | None = None):
        super().__init__(pieces)
        self.eos_token_ids = eos if eos is not None else set()


def prompts(n: int) -> list[tuple[int, ...]]:
    return [tuple([1] + [(7 * i + 3 * k) % 250 + 3 for k in range(4 + i)]) for i in range(n)]


def run(model: Any, lookahead: int, requests: list[EngineRequest], *, tokenizer: Any = None,
        cancel_after: dict[str, int] | None = None, prefix_bytes: int = 0,
        parallel: int = 8, batch_tails: bool = False) -> tuple[list[tuple[list[TokenEvent], FinishEvent]], Scheduler]:
    """Every request's events through a scheduler over ``LocalExecutor(lookahead=...)``; the scheduler is
    closed, its executor kept for inspection. Prompt tails run alone unless ``batch_tails`` (the plans compared
    here are those of asynchronous scheduling; tests/engine/test_batch_tails.py has the batched tails)."""
    ex = LocalExecutor(model, max_batch_size=parallel, lookahead=lookahead, prefix_cache_bytes=prefix_bytes)
    assert ex.lookahead == 0  # until a driver that polls starts it
    sched = Scheduler(ex, tokenizer or Tokenizer(), context_length=512, parallel=parallel, warmup=False,
                      batch_tails=batch_tails)
    assert ex.lookahead == lookahead

    async def main() -> list[tuple[list[TokenEvent], FinishEvent]]:
        streams = [sched.submit(r) for r in requests]  # all queued before the first pass: the same plan each run
        sched.start()

        async def one(stream: Any) -> tuple[list[TokenEvent], FinishEvent]:
            limit = (cancel_after or {}).get(stream.request.request_id)
            if limit is None:
                return await collect(stream)
            tokens: list[TokenEvent] = []
            async for event in stream:
                if isinstance(event, FinishEvent):
                    return tokens, event
                tokens.append(event)
                if len(tokens) == limit:
                    stream.cancel()
                    await asyncio.sleep(0.3)  # whatever the scheduler had queued for it would arrive now
                    left = []
                    while not stream._queue.empty():  # noqa: SLF001 - what was delivered after the cancel
                        left.append(stream._queue.get_nowait())  # noqa: SLF001
                    return tokens + left, FinishEvent("cancelled")
            raise AssertionError("stream ended without a FinishEvent")

        return list(await asyncio.gather(*(one(s) for s in streams)))

    try:
        out = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        sched.close(timeout=10)
    return out, sched


def req(rid: str, prompt: tuple[int, ...], max_tokens: int, **kw: Any) -> EngineRequest:
    top = kw.pop("top_logprobs", 0)
    ignore_eos = kw.pop("ignore_eos", False)
    return EngineRequest(prompt, SamplingParams(max_tokens=max_tokens, **kw), top_logprobs=top,
                         ignore_eos=ignore_eos, request_id=rid)


def events(out: list[tuple[list[TokenEvent], FinishEvent]]) -> list[tuple[list[tuple], tuple]]:
    """Every event: token, text, log-probability, alternatives; the finish."""
    return [([(e.token, e.text, e.logprob, e.top_logprobs) for e in toks],
             (fin.finish_reason, fin.text, fin.completion_tokens, fin.error)) for toks, fin in out]


def same(a: list, b: list) -> None:
    """``a`` and ``b`` (from ``run``) agree event for event: tokens, texts, alternatives' ids and finishes exactly,
    log-probabilities within 1e-5. Which rows share a decode step depends on when each prompt's prefill ran,
    in either mode, and a batch of another size may differ in the last bits of a float32 logit."""
    ea, eb = events(a), events(b)
    assert [(len(t), f) for t, f in ea] == [(len(t), f) for t, f in eb]
    for (ta, _), (tb, _) in zip(ea, eb):
        assert [e[:2] for e in ta] == [e[:2] for e in tb]
        for x, y in zip(ta, tb):
            assert (x[2] is None) == (y[2] is None) and (x[2] is None or abs(x[2] - y[2]) < 1e-5)
            assert len(x[3]) == len(y[3])
            assert all(abs(u[1] - v[1]) < 1e-5 for u, v in zip(x[3], y[3]))
            assert {t for t, _ in x[3]} == {t for t, _ in y[3]} or len({round(v, 4) for _, v in x[3]}) < len(x[3])


def test_the_same_tokens_lengths_and_order_at_every_batch_size(model):
    for n in (1, 3, 8):
        reqs = [req(f"r{i}", p, 3 + 4 * i % 11, ignore_eos=True) for i, p in enumerate(prompts(n))]
        sync, _ = run(model, 0, reqs)
        fast, sched = run(model, 1, reqs)
        same(fast, sync)
        assert [len(t) for t, _ in fast] == [r.params.max_tokens for r in reqs]
        assert all(f.finish_reason == "length" for _, f in fast)
        assert sched.counters.overlapped_steps > 0  # step N+1 was queued while step N ran
        assert len(sched.executor.runners[0]) == 0  # every row freed, the queued ones past their end too


def test_the_same_steps_in_the_same_order_and_bit_identical_logprobs(model, monkeypatch):
    """Asynchronous scheduling keeps the synchronous plan: prompt steps and decode steps alternate as before
    (no decode step queued ahead of a prompt's next step), each decode step with the same rows, so every
    log-probability is the same float."""
    submitted: list[tuple[str, list[str], list[list[int]]]] = []
    submit = LocalExecutor.submit

    def spy(self: LocalExecutor, step: Step, done: Any) -> None:
        submitted.append((step.kind, list(step.rids), [len(t) for t in step.tokens]))
        submit(self, step, done)

    monkeypatch.setattr(LocalExecutor, "submit", spy)
    reqs = [req(f"r{i}", p, 5 + 2 * i, ignore_eos=True, logprobs=True, top_logprobs=2) for i, p in enumerate(prompts(5))]
    plans, outs = [], []
    for lookahead in (0, 1):
        submitted.clear()
        out, _ = run(model, lookahead, reqs)
        plans.append(list(submitted))
        outs.append(events(out))
    assert plans[1] == plans[0]
    assert outs[1] == outs[0]


def test_eos_ends_a_row_where_the_synchronous_scheduler_ends_it(model):
    reqs = [req(f"r{i}", p, 16, ignore_eos=True) for i, p in enumerate(prompts(4))]
    base, _ = run(model, 0, reqs)
    eos = {base[1][0][5].token}  # a token row 1 samples as its 6th: now EOS, for every row
    reqs = [req(f"r{i}", p, 16) for i, p in enumerate(prompts(4))]
    sync, _ = run(model, 0, reqs, tokenizer=Tokenizer(eos))
    fast, sched = run(model, 1, reqs, tokenizer=Tokenizer(eos))
    same(fast, sync)
    assert len(fast[1][0]) <= 5 and fast[1][1].finish_reason == "stop"
    assert all(e.token not in eos for toks, _ in fast for e in toks)
    assert len(sched.executor.runners[0]) == 0


def test_stop_strings_end_the_text_at_the_same_token(model):
    reqs = [req(f"r{i}", p, 16, ignore_eos=True) for i, p in enumerate(prompts(4))]
    base, _ = run(model, 0, reqs)
    stop_token = base[2][0][3].token
    pieces = {stop_token: "STOP"}
    reqs = [req(f"r{i}", p, 16, ignore_eos=True, stop=("TO",)) for i, p in enumerate(prompts(4))]
    sync, _ = run(model, 0, reqs, tokenizer=Tokenizer(set(), pieces))
    fast, _ = run(model, 1, reqs, tokenizer=Tokenizer(set(), pieces))
    same(fast, sync)
    assert len(fast[2][0]) <= 4 and fast[2][1].finish_reason == "stop"


def test_logprobs_and_sampled_rows_match(model):
    reqs = [req(f"g{i}", p, 6, ignore_eos=True, logprobs=True, top_logprobs=i % 4) for i, p in enumerate(prompts(3))]
    reqs += [req(f"s{i}", p, 7, ignore_eos=True, temperature=0.9, seed=11 + i, logprobs=bool(i % 2))
             for i, p in enumerate(prompts(3))]
    sync, _ = run(model, 0, reqs)
    fast, _ = run(model, 1, reqs)
    same(fast, sync)
    assert all(e.logprob is not None for e in fast[0][0]) and len(fast[2][0][0].top_logprobs) == 2


def test_a_cancel_stops_the_stream_at_once_and_frees_the_row(model):
    reqs = [req(f"r{i}", p, 40, ignore_eos=True) for i, p in enumerate(prompts(3))]
    cancel = {"r1": 4}
    sync, _ = run(model, 0, reqs, cancel_after=cancel)
    fast, sched = run(model, 1, reqs, cancel_after=cancel)
    assert [len(t) for t, _ in fast] == [40, 4, 40]  # nothing after the cancel reached the client
    same(fast, sync)
    assert len(sched.executor.runners[0]) == 0


def test_the_prefix_cache_keeps_the_tokens_not_the_queued_position_past_the_end(model):
    base, _ = run(model, 0, [req(f"r{i}", p, 12, ignore_eos=True) for i, p in enumerate(prompts(3))])
    eos = {base[2][0][4].token}  # row 2 ends on EOS (queued one step past it); rows 0 and 1 may too, or by length
    reqs = [req(f"r{i}", p, 9 + i) for i, p in enumerate(prompts(3))]
    entries = []
    for lookahead in (0, 1):
        out, sched = run(model, lookahead, reqs, tokenizer=Tokenizer(eos), prefix_bytes=64 << 20)
        prefix = sched.executor.prefix
        got = []
        for (toks, _), r in zip(out, reqs):
            full = list(r.prompt) + [e.token for e in toks]
            cache, n = prefix.lookup(full + [5])
            assert cache is not None and all(c.offset == n for c in cache)  # the entry holds exactly n positions
            got.append((full, n))
        entries.append(got)
    assert entries[1] == entries[0]
    # a follow-up turn reuses the entry and decodes what the synchronous scheduler decodes
    full = entries[0][0][0]
    follow = [req("f", tuple(full + [9, 10]), 6, ignore_eos=True)]
    sync, _ = run(model, 0, follow)
    again, _ = run(model, 1, follow, prefix_bytes=64 << 20)
    same(again, sync)


def test_a_driver_that_does_not_poll_gets_every_step_reported_at_once(model):
    ex = LocalExecutor(model, max_batch_size=2, lookahead=1)
    ex.prepare("a", SamplingParams(), 0, prompts(1)[0])
    done: list[Any] = []
    ex.submit(Step("prefill", ["a"], [list(prompts(1)[0])]), lambda s, o: done.append(o))
    assert len(done) == 1 and done[0][0].token >= 0 and not ex.poll()


def test_previous_reads_the_last_step_samples_on_the_device(model):
    ex = LocalExecutor(model, max_batch_size=4, lookahead=1)
    assert ex.start_async() == 1
    for rid, p in zip("ab", prompts(2)):
        ex.prepare(rid, SamplingParams(), 0, p)
    firsts = [ex.run(Step("prefill", [rid], [list(p)]))[0].token for rid, p in zip("ab", prompts(2))]
    done: list[Any] = []
    ex.submit(Step("decode", ["a", "b"], [[firsts[0]], [firsts[1]]], slot=0), lambda s, o: done.append(o))
    ex.submit(Step("decode", ["b", "a"][::-1], [[PREVIOUS], [PREVIOUS]], slot=0), lambda s, o: done.append(o))
    assert done == []  # queued, not reported
    while ex.poll():
        pass
    ref = LocalExecutor(model, max_batch_size=4, lookahead=0)
    for rid, p in zip("ab", prompts(2)):
        ref.prepare(rid, SamplingParams(), 0, p)
        ref.run(Step("prefill", [rid], [list(p)]))
    one = ref.run(Step("decode", ["a", "b"], [[firsts[0]], [firsts[1]]], slot=0))
    two = ref.run(Step("decode", ["a", "b"], [[s.token] for s in one], slot=0))
    assert [[s.token for s in o] for o in done] == [[s.token for s in one], [s.token for s in two]]


def test_caches_that_cannot_be_cut_keep_synchronous_scheduling(model, monkeypatch):
    from types import SimpleNamespace

    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    from mlxcel.engine.executor import default_lookahead

    monkeypatch.setenv("MLXCEL_ASYNC_SCHED", "1")  # on a CPU it is off unless asked for
    assert LocalExecutor(model, max_batch_size=2).max_lookahead == 1
    assert default_lookahead(SimpleNamespace(_make_cache=lambda: [KVCache(), KVCache()])) == 1
    assert default_lookahead(SimpleNamespace(_make_cache=lambda: [KVCache(), RotatingKVCache(16)])) == 0
    assert default_lookahead(SimpleNamespace(_make_cache=lambda: [ArraysCache(2), KVCache()])) == 0
    monkeypatch.setenv("MLXCEL_ASYNC_SCHED", "0")
    assert LocalExecutor(model, max_batch_size=2).start_async() == 0
    monkeypatch.delenv("MLXCEL_ASYNC_SCHED")
    import mlx.core as mx

    expected = 1 if mx.default_device().type == mx.DeviceType.gpu else 0
    assert LocalExecutor(model, max_batch_size=2).max_lookahead == expected
    monkeypatch.setenv("MLXCEL_ASYNC_SCHED", "maybe")
    with pytest.raises(ValueError, match="MLXCEL_ASYNC_SCHED"):
        LocalExecutor(model, max_batch_size=2)
