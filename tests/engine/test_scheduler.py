"""The scheduler on its own: a scripted fake executor, a fake tokenizer, no model.

Admission and the queue bound, the prefill budget, micro-batch groups, cancellation, emission
(text, EOS, max_tokens, logprobs, stop strings), failures and how they reach HTTP, and the
admission of a sequence prefilled elsewhere (``submit_prefilled``).
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from mlxcel.engine.executor import ExecutorError
from mlxcel.engine.interface import (
    EngineOverloaded,
    EngineRequest,
    EngineUnavailable,
    FinishEvent,
    TokenEvent,
    finish_error,
)
from mlxcel.engine.runner import Sampled
from mlxcel.engine.sampling import SamplingParams
from mlxcel.engine.requests import TRANSITIONS, IllegalTransition, RequestState, Seq
from mlxcel.engine.scheduler import Scheduler
from mlxcel.error_codes import ErrorCode
from mlxcel.server.errors import error_reply
from tests.engine.fakes import (
    EOS,
    FakeExecutor,
    FakeTokenizer,
    collect,
    events_now,
    logprob_of,
    next_event,
    run_async,
    settle,
    until,
)

pytestmark = pytest.mark.timeout(60)


def request(rid: str, prompt: tuple[int, ...] = (1,), *, top_logprobs: int = 0, ignore_eos: bool = False,
            **params) -> EngineRequest:
    params.setdefault("max_tokens", 8)
    return EngineRequest(prompt, SamplingParams(**params), top_logprobs=top_logprobs, ignore_eos=ignore_eos,
                         request_id=rid)


@contextlib.contextmanager
def scheduler(executor: FakeExecutor, tokenizer: FakeTokenizer | None = None, **kw) -> Iterator[Scheduler]:
    sched = Scheduler(executor, tokenizer or FakeTokenizer(), context_length=1024, warmup=False, **kw).start()
    try:
        yield sched
    finally:
        sched.close(timeout=5)
    assert not executor.violations, executor.violations


def texts(events: list[TokenEvent]) -> list[str]:
    return [e.text for e in events]


# -- admission --------------------------------------------------------------------------------------


@run_async
async def test_parallel_slots_are_filled_in_order_and_the_rest_waits():
    ex = FakeExecutor()
    with scheduler(ex, parallel=2, max_queue=4) as sched:
        a, b, c = (sched.submit(request(r, max_tokens=1)) for r in "abc")
        await until(lambda: sched.counters.waiting == 1 and len(ex.prepared) == 2, "two admitted, one waiting")
        assert list(ex.prepared) == ["a", "b"] and sched.counters.running == 2
        ex.complete()  # a's prompt: its only token, max_tokens 1
        tokens, finish = await collect(a)
        assert (len(tokens), finish.finish_reason) == (1, "length")
        await until(lambda: "c" in ex.prepared, "c admitted once a finished")
        for stream in (b, c):
            await ex.next_step()
            ex.complete()
            assert (await collect(stream))[1].finish_reason == "length"


@run_async
async def test_the_queue_bound_refuses_with_overloaded_until_a_slot_frees():
    ex = FakeExecutor()
    with scheduler(ex, parallel=1, max_queue=1) as sched:
        a = sched.submit(request("a", max_tokens=1))
        sched.submit(request("b", max_tokens=1))
        with pytest.raises(EngineOverloaded, match="at capacity"):
            sched.submit(request("c"))
        await ex.next_step()
        ex.complete()
        await collect(a)
        await until(lambda: "b" in ex.prepared, "b admitted")
        sched.submit(request("c"))  # a's slot is free again


@run_async
async def test_a_request_cancelled_while_waiting_never_reaches_the_executor():
    ex = FakeExecutor()
    with scheduler(ex, parallel=1, max_queue=1) as sched:
        a = sched.submit(request("a", max_tokens=1))
        b = sched.submit(request("b", max_tokens=1))
        await until(lambda: sched.counters.waiting == 1, "b waiting")
        b.cancel()
        await until(lambda: sched.counters.waiting == 0, "b dropped")
        sched.submit(request("c", max_tokens=1))  # b's place in the queue is free
        await ex.next_step()
        ex.complete()
        await collect(a)
        await until(lambda: "c" in ex.prepared, "c admitted")
        await settle()
        assert "b" not in ex.prepared and "b" not in ex.released_ids()
        assert await events_now(b) == []


# -- the prefill budget -------------------------------------------------------------------------------


@run_async
async def test_prompts_go_in_chunks_of_prefill_step_one_sequence_at_a_time():
    ex = FakeExecutor(depth=2)  # room for two steps, yet prompt chunks of two sequences never overlap
    with scheduler(ex, parallel=2, prefill_step=4) as sched:
        a = sched.submit(request("a", tuple(range(10, 20)), max_tokens=1))
        b = sched.submit(request("b", tuple(range(30, 35)), max_tokens=1))
        for _ in range(6):
            await ex.next_step()
            await settle()
            assert len(ex.pending) == 1  # nothing else to run while a chunk is in flight
            ex.complete()
        await collect(a)
        await collect(b)
    chunks = [(s.rids[0], s.tokens[0], s.sample) for s in ex.steps]
    # the tokens before the last in chunks of at most prefill_step, then the last alone (what
    # generate_tokens and mlx-lm run: the same forward calls, so the same logits bit for bit)
    assert chunks == [
        ("a", [10, 11, 12, 13], False), ("a", [14, 15, 16, 17], False), ("a", [18], False), ("a", [19], True),
        ("b", [30, 31, 32, 33], False), ("b", [34], True),
    ]
    assert sched.counters.prompt_tokens == 15


@run_async
async def test_a_cached_prefix_is_not_prefilled_again():
    ex = FakeExecutor(cached=6)
    with scheduler(ex, prefill_step=4) as sched:
        stream = sched.submit(request("a", tuple(range(10, 20)), max_tokens=1))
        for _ in range(2):
            await ex.next_step()
            ex.complete()
        await collect(stream)
    assert [s.tokens[0] for s in ex.steps] == [[16, 17, 18], [19]]


# -- micro-batch groups and alternation ---------------------------------------------------------------


@run_async
async def test_two_micro_batches_of_at_most_micro_batch_size_rows():
    script = {r: [10 * (i + 1) + k for k in range(6)] for i, r in enumerate("abcd")}
    ex = FakeExecutor(depth=2, micro_batch_size=2, script=script)
    with scheduler(ex, parallel=4) as sched:
        streams = [sched.submit(request(r, (1, 2), max_tokens=6)) for r in "abcd"]
        await until(lambda: len(ex.prepared) == 4, "all admitted")
        await ex.drive(lambda: len(ex.released) == 4)
        for rid, stream in zip("abcd", streams):
            tokens, finish = await collect(stream)
            assert [t.token for t in tokens] == script[rid] and finish.finish_reason == "length"
    decodes = [s for s in ex.steps if s.kind == "decode"]
    assert max(s.rows for s in decodes) == 2 and {s.slot for s in decodes} == {0, 1}
    groups = {rid: {s.slot for s in decodes if rid in s.rids} for rid in "abcd"}
    assert all(len(slots) == 1 for slots in groups.values()), groups  # a row never changes group
    assert ex.max_inflight == 2 and sched.counters.overlapped_steps > 0
    assert sched.counters.max_rows == 2 and sched.counters.decode_steps == len(decodes)


async def _decode_slots(fill: bool, rids: str) -> tuple[list, dict[str, set[int]]]:
    """Run ``rids`` (20 tokens each: none ends before all have joined) through depth 2, micro-batches of 4;
    the decode steps and each row's slots."""
    script = {r: [100 * (i + 1) + k for k in range(20)] for i, r in enumerate(rids)}
    ex = FakeExecutor(depth=2, micro_batch_size=4, script=script, fill=fill)
    with scheduler(ex, parallel=len(rids)) as sched:
        streams = [sched.submit(request(r, (1, 2), max_tokens=20)) for r in rids]
        await until(lambda: len(ex.prepared) == len(rids), "all admitted")
        await ex.drive(lambda: len(ex.released) == len(rids))
        for rid, stream in zip(rids, streams):
            assert [t.token for t in (await collect(stream))[0]] == script[rid]
    decodes = [s for s in ex.steps if s.kind == "decode"]
    return decodes, {rid: {s.slot for s in decodes if rid in s.rids} for rid in rids}


@run_async
async def test_filled_micro_batches_take_a_second_group_only_when_the_first_is_full():
    decodes, slots = await _decode_slots(True, "abcd")
    assert {s.slot for s in decodes} == {0} and max(s.rows for s in decodes) == 4  # 4 rows: one group
    decodes, slots = await _decode_slots(True, "abcdef")
    assert max(s.rows for s in decodes) == 4 and {s.slot for s in decodes} == {0, 1}
    assert sum(slot == {1} for slot in slots.values()) == 2 and all(len(v) == 1 for v in slots.values())
    decodes, _ = await _decode_slots(False, "abcd")  # spread (the default): two groups of two
    assert {s.slot for s in decodes} == {0, 1} and max(s.rows for s in decodes) == 2


@run_async
async def test_prompt_chunks_and_decode_steps_alternate():
    ex = FakeExecutor()
    with scheduler(ex, parallel=2, prefill_step=2) as sched:
        sched.submit(request("a", (1,), max_tokens=20))
        await ex.next_step()
        ex.complete()  # a decodes from now on
        first_decode = await until_step(ex, "decode")
        sched.submit(request("b", (5, 6, 7, 8, 9, 10), max_tokens=20))  # chunks [5, 6] [7, 8] [9] [10]
        await until(lambda: "b" in ex.prepared, "b admitted")
        ex.complete(first_decode)
        for _ in range(7):
            await ex.next_step()
            ex.complete()
    kinds = [(s.kind, s.rids, s.tokens[0] if s.kind == "prefill" else None) for s in ex.steps[2:9]]
    # b's last token follows its chunk at once (no decode step of a between them delays b's first token)
    assert kinds == [("prefill", ["b"], [5, 6]), ("decode", ["a"], None), ("prefill", ["b"], [7, 8]),
                     ("decode", ["a"], None), ("prefill", ["b"], [9]), ("prefill", ["b"], [10]),
                     ("decode", ["a", "b"], None)]


async def until_step(ex: FakeExecutor, kind: str):
    step = await ex.next_step()
    assert step.kind == kind, step
    return step


async def complete_until(ex: FakeExecutor, done: Callable[[], bool]) -> None:
    """Complete the oldest step in flight, waiting for one if need be, until ``done()`` (checked before each)."""
    while not done():
        await ex.next_step()
        ex.complete()


# -- cancellation ----------------------------------------------------------------------------------


@run_async
async def test_cancelling_a_decoding_sequence_releases_it_once_after_its_step_returns():
    ex = FakeExecutor()
    with scheduler(ex, parallel=2) as sched:
        a = sched.submit(request("a", max_tokens=50))
        b = sched.submit(request("b", max_tokens=50))
        await complete_until(ex, lambda: any(s.kind == "decode" and s.rows == 2 for s in ex.steps))
        step = await ex.next_step()
        assert step.rids == ["a", "b"]
        await events_now(a)
        a.cancel()
        await settle()
        assert "a" not in ex.released_ids()  # its row is still in the step in flight
        ex.complete(step)
        await until(lambda: "a" in ex.released_ids(), "a released")
        assert ex.released == [("a", None)]  # cancelled: its KV is not offered to the prefix cache
        assert (await ex.next_step()).rids == ["b"]
        assert await events_now(a) == []  # the token of the returned step is not sent
        b.cancel()
    assert ex.released_ids().count("a") == 1


@run_async
async def test_cancelling_during_a_prompt_chunk_releases_after_the_chunk():
    ex = FakeExecutor()
    with scheduler(ex, prefill_step=2) as sched:
        a = sched.submit(request("a", (1, 2, 3, 4, 5)))
        chunk = await ex.next_step()
        a.cancel()
        await settle()
        assert ex.released == []
        ex.complete(chunk)
        await until(lambda: ex.released == [("a", None)], "a released")
        await settle()
        assert ex.pending == [] and len(ex.steps) == 1  # no further chunk of a
        assert sched.counters.running == 0


# -- emission --------------------------------------------------------------------------------------


@run_async
async def test_tokens_carry_text_eos_is_not_emitted_and_max_tokens_ends_with_length():
    tok = FakeTokenizer({10: "Hi", 11: " there", 12: "!"})
    ex = FakeExecutor(auto=True, script={"eos": [10, 11, EOS, 12], "len": [10, 11, 12, 12], "ign": [10, EOS, 12]})
    with scheduler(ex, tok) as sched:
        tokens, finish = await collect(sched.submit(request("eos", (1, 2, 3))))
        assert [(t.token, t.text) for t in tokens] == [(10, "Hi"), (11, " there")]
        assert (finish.finish_reason, finish.completion_tokens, finish.prompt_tokens) == ("stop", 2, 3)
        tokens, finish = await collect(sched.submit(request("len", (1, 2, 3), max_tokens=3)))
        assert texts(tokens) == ["Hi", " there", "!"] and finish.finish_reason == "length"
        tokens, finish = await collect(sched.submit(request("ign", max_tokens=3, ignore_eos=True)))
        assert [t.token for t in tokens] == [10, EOS, 12] and finish.finish_reason == "length"
    # finished sequences offer their KV under prompt + generated tokens (EOS left out)
    assert ("eos", [1, 2, 3, 10, 11]) in ex.released and ("len", [1, 2, 3, 10, 11, 12]) in ex.released
    assert sched.counters.generated_tokens == 8


@run_async
async def test_logprobs_are_reported_only_when_asked():
    ex = FakeExecutor(auto=True)  # the fake reports logprobs either way
    with scheduler(ex) as sched:
        plain, _ = await collect(sched.submit(request("plain", max_tokens=2)))
        asked, _ = await collect(sched.submit(request("asked", max_tokens=2, logprobs=True, top_logprobs=2)))
    assert all(t.logprob is None and t.top_logprobs == () for t in plain)
    assert [t.logprob for t in asked] == [logprob_of(0), logprob_of(1)]
    assert asked[0].top_logprobs == ((asked[0].token, logprob_of(0)), (7, -9.0))
    assert ex.prepared["asked"][:2] == (SamplingParams(max_tokens=2, logprobs=True), 2)


# -- stop strings -------------------------------------------------------------------------------------

STOP_PIECES = {10: "ab", 11: "c#", 12: "#d", 13: "ef"}


async def generate(script: list[int], **params) -> tuple[list[TokenEvent], FinishEvent]:
    ex = FakeExecutor(auto=True, script={"s": script})
    with scheduler(ex, FakeTokenizer(STOP_PIECES)) as sched:
        return await collect(sched.submit(request("s", **params)))


@run_async
async def test_a_stop_string_cuts_the_text_and_finishes_with_stop():
    tokens, finish = await generate([10, 11, 12, 13], stop=("##",))
    assert texts(tokens) == ["ab", "c", ""]  # "#" held back until "#d" completes "##"
    assert (finish.finish_reason, finish.text, finish.completion_tokens) == ("stop", "", 3)


@run_async
async def test_text_held_back_is_released_when_the_stop_string_does_not_follow():
    tokens, finish = await generate([10, 11, 12, 13], stop=("#x",), max_tokens=4)
    assert texts(tokens) == ["ab", "c", "##d", "ef"] and finish.finish_reason == "length"


@run_async
async def test_text_held_back_at_max_tokens_comes_with_the_finish():
    tokens, finish = await generate([10, 11], stop=("#x",), max_tokens=2)
    assert texts(tokens) == ["ab", "c"] and (finish.finish_reason, finish.text) == ("length", "#")


# -- a sequence prefilled elsewhere ------------------------------------------------------------------


@run_async
async def test_a_prefilled_sequence_sends_its_first_token_at_once_then_decodes():
    tok = FakeTokenizer({10: "Hi"})
    ex = FakeExecutor(script={"a": [11, 12]})
    with scheduler(ex, tok, parallel=2) as sched:
        stream = sched.submit_prefilled(request("a", (1, 2, 3), max_tokens=3), Sampled(10), cache="kv-of-a")
        first = await next_event(stream)
        assert (first.token, first.text) == (10, "Hi")
        assert ex.adopted == {"a": ("kv-of-a", 3)} and "a" not in ex.prepared
        step = await ex.next_step()
        assert (step.kind, step.rids, step.tokens) == ("decode", ["a"], [[10]])
        ex.complete()
        ex.complete(await ex.next_step())
        tokens, finish = await collect(stream)
        assert [t.token for t in tokens] == [11, 12] and finish.finish_reason == "length"
    assert not any(s.kind == "prefill" for s in ex.steps)
    assert ex.released == [("a", [1, 2, 3, 10, 11, 12])]
    assert sched.counters.adopted == 1 and sched.counters.prompt_tokens == 0


@run_async
async def test_a_prefilled_sequence_joins_running_decodes_and_counts_against_parallel():
    ex = FakeExecutor()
    with scheduler(ex, parallel=1, max_queue=1) as sched:
        a = sched.submit(request("a", max_tokens=2))
        b = sched.submit_prefilled(request("b", max_tokens=3), Sampled(10), cache="kv-of-b")
        with pytest.raises(EngineOverloaded):
            sched.submit_prefilled(request("c"), Sampled(10), cache="kv-of-c")
        await settle()
        assert ex.adopted == {} and await events_now(b) == []  # waits for a's slot
        while not a.finished:
            await ex.next_step()
            ex.complete()
            await events_now(a)
        await until(lambda: "b" in ex.adopted, "b adopted")
        assert (await next_event(b)).token == 10
        ex.complete(await ex.next_step())
        ex.complete(await ex.next_step())
        tokens, finish = await collect(b)
        assert len(tokens) == 2 and finish.finish_reason == "length"


@run_async
async def test_a_prefilled_sequence_with_a_decode_partner_shares_its_steps():
    ex = FakeExecutor(script={"a": [20, 21, 22, 23]})
    with scheduler(ex, parallel=2) as sched:
        a = sched.submit(request("a", max_tokens=4))
        ex.complete(await ex.next_step())  # a's prompt
        decode = await ex.next_step()
        b = sched.submit_prefilled(request("b", max_tokens=3), Sampled(10), cache="kv-of-b")
        await until(lambda: "b" in ex.adopted, "b adopted")
        ex.complete(decode)
        shared = await ex.next_step()
        assert shared.rids == ["a", "b"] and shared.tokens == [[21], [10]]
        b.cancel()
        await settle()
        assert "b" not in ex.released_ids()
        ex.complete(shared)
        await until(lambda: "b" in ex.released_ids(), "b released")
        assert (await ex.next_step()).rids == ["a"]
        ex.complete()
        tokens, _ = await collect(a)
        assert [t.token for t in tokens] == [20, 21, 22, 23]
    assert ex.released_ids().count("b") == 1


@run_async
async def test_a_prefilled_sequence_cancelled_while_waiting_is_never_adopted():
    ex = FakeExecutor()
    with scheduler(ex, parallel=1) as sched:
        sched.submit(request("a"))
        b = sched.submit_prefilled(request("b"), Sampled(10), cache="kv-of-b")
        await until(lambda: sched.counters.waiting == 1, "b waiting")
        b.cancel()
        await until(lambda: sched.counters.waiting == 0, "b dropped")
    assert ex.adopted == {} and "b" not in ex.released_ids()


@pytest.mark.parametrize("first, params, reason, emitted, text", [
    (EOS, {}, "stop", [], ""),
    (10, {"max_tokens": 1}, "length", [10], "Hi"),
    (10, {"stop": ("i",)}, "stop", [10], "H"),
])
@run_async
async def test_the_first_token_of_a_prefilled_sequence_can_end_it(first, params, reason, emitted, text):
    ex = FakeExecutor()
    with scheduler(ex, FakeTokenizer({10: "Hi"})) as sched:
        tokens, finish = await collect(sched.submit_prefilled(request("a", (1, 2), **params), Sampled(first), "kv"))
        assert [t.token for t in tokens] == emitted and "".join(texts(tokens)) == text
        assert finish.finish_reason == reason
        await until(lambda: ex.released, "a released")
    assert ex.steps == [] and ex.released == [("a", [1, 2] + emitted)]


@run_async
async def test_prefilled_sequences_need_an_executor_that_adopts_and_a_prompt():
    with scheduler(FakeExecutor(adopt=False)) as sched:
        with pytest.raises(TypeError, match="no adopt method"):
            sched.submit_prefilled(request("a"), Sampled(10), cache="kv")
    with scheduler(FakeExecutor()) as sched:
        with pytest.raises(ValueError, match="prompt"):
            sched.submit_prefilled(request("a", ()), Sampled(10), cache="kv")


# -- failures and their HTTP status (written last: against mlxcel.error_codes.ErrorCode) -----------------


def http_of(finish: FinishEvent):
    """The reply the serving layer sends for a failed FinishEvent (serving.py raises finish_error)."""
    assert finish.finish_reason == "error" and finish.error
    return error_reply(finish_error(finish))


@pytest.mark.parametrize("exc, status, retry_after, type_", [
    (ExecutorError("stage 1 did not answer in time", ErrorCode.TIMEOUT), 503, "1", "service_unavailable"),
    (ExecutorError("stage 1 is down", ErrorCode.UNREACHABLE), 503, "1", "service_unavailable"),
    (RuntimeError("shape mismatch in layer 3"), 500, None, "server_error"),
])
@run_async
async def test_a_failed_step_ends_its_rows_with_an_error_and_the_other_group_goes_on(exc, status, retry_after,
                                                                                      type_):
    ex = FakeExecutor(depth=2, micro_batch_size=1)
    with scheduler(ex, parallel=2) as sched:
        a = sched.submit(request("a", max_tokens=4))
        b = sched.submit(request("b", max_tokens=4))
        ex.complete(await ex.next_step())  # a's prompt
        await until(lambda: any(s.kind == "decode" and s.rids == ["a"] for s, _ in ex.pending), "a decoding")
        failing = next(s for s, _ in ex.pending if s.rids == ["a"])
        ex.complete(failing, exc)
        tokens, finish = await collect(a)
        assert finish.code == (exc.code if isinstance(exc, ExecutorError) else ErrorCode.INTERNAL)
        assert str(exc) in finish.error and finish.completion_tokens == len(tokens)
        await until(lambda: "a" in ex.released_ids(), "a released")
        await ex.drive(lambda: b.finished or len(ex.released) == 2)
        tokens, finish_b = await collect(b)
        assert len(tokens) == 4 and finish_b.finish_reason == "length"
        assert sched.counters.failed_steps == 1
    assert ex.released_ids().count("a") == 1 and ("a", None) in ex.released
    reply = http_of(finish)
    assert (reply.status, reply.headers.get("Retry-After"), reply.json()["error"]["type"]) == (status, retry_after,
                                                                                                 type_)


@pytest.mark.parametrize("exc, status", [
    (ExecutorError("stage 1 is down", ErrorCode.UNREACHABLE), 503),
    (RuntimeError("shape mismatch in layer 3"), 500),
])
@pytest.mark.parametrize("chunk", ["intermediate", "last"])  # last: the chunk that samples the first token
@run_async
async def test_a_failed_prompt_chunk_frees_its_sequence_and_the_next_request_is_served(chunk, exc, status):
    ex = FakeExecutor()
    with scheduler(ex, parallel=1, prefill_step=2) as sched:
        a = sched.submit(request("a", (1, 2, 3, 4, 5)))
        step = await ex.next_step()
        if chunk == "last":
            ex.complete(step)
            ex.complete(await ex.next_step())
            step = await ex.next_step()
        assert (step.kind, step.sample) == ("prefill", chunk == "last")
        ex.complete(step, exc)
        tokens, finish = await collect(a)
        assert tokens == [] and str(exc) in finish.error and http_of(finish).status == status
        await until(lambda: "a" in ex.released_ids(), "a released")
        assert ex.released == [("a", None)] and sched.releases.deferred == []  # freed once, its KV not offered
        b = sched.submit(request("b", max_tokens=2))
        await ex.drive(lambda: "b" in ex.released_ids())
        tokens, ok = await collect(b)
        assert sched.counters.failed_steps == 1 and sched.counters.running == 0
    assert ok.finish_reason == "length" and len(tokens) == 2
    assert [s.rids for s in ex.steps if s.kind == "prefill"].count(["a"]) == (1 if chunk == "intermediate" else 3)
    assert ex.released_ids() == ["a", "b"]


@run_async
async def test_a_prompt_chunk_that_fails_after_its_request_was_cancelled_frees_it_once():
    ex = FakeExecutor()
    with scheduler(ex, prefill_step=2) as sched:
        a = sched.submit(request("a", (1, 2, 3, 4, 5)))
        chunk = await ex.next_step()
        a.cancel()
        await settle()
        ex.complete(chunk, RuntimeError("boom"))
        await until(lambda: ex.released == [("a", None)], "a released")
        await settle()
        assert ex.released == [("a", None)] and sched.releases.deferred == [] and sched.counters.running == 0
        assert sched.counters.failed_steps == 1 and len(ex.steps) == 1


@run_async
async def test_a_request_the_executor_cannot_start_fails_alone():
    ex = FakeExecutor(auto=True)
    with scheduler(ex) as sched:
        ex.fail_prepare = ExecutorError("no downstream stage", ErrorCode.UNREACHABLE)
        _, finish = await collect(sched.submit(request("a")))
        ex.fail_prepare = None
        tokens, ok = await collect(sched.submit(request("b", max_tokens=2)))
    assert (finish.code, "no downstream stage") == (ErrorCode.UNREACHABLE, finish.error)
    assert http_of(finish).status == 503 and ok.finish_reason == "length" and len(tokens) == 2
    assert "a" not in ex.released_ids()  # never prepared, nothing to free


class _SubmitRaises(FakeExecutor):
    """An executor whose ``submit`` raises once (a bug: it should report failures through ``done``)."""

    def __init__(self, **options):
        super().__init__(**options)
        self.raise_once: Exception | None = RuntimeError("submit blew up")

    def submit(self, step, done) -> None:
        if self.raise_once is not None:
            exc, self.raise_once = self.raise_once, None
            raise exc
        super().submit(step, done)


@run_async
async def test_an_executor_that_raises_on_submit_fails_that_step_and_the_next_request_is_served():
    ex = _SubmitRaises(auto=True)
    with scheduler(ex) as sched:
        _, finish = await collect(sched.submit(request("a")))
        await until(lambda: "a" in ex.released_ids(), "a released")
        tokens, ok = await collect(sched.submit(request("b", max_tokens=2)))
        assert sched._thread.is_alive() and sched.counters.running == 0
    assert "submit blew up" in finish.error and http_of(finish).status == 500
    assert ok.finish_reason == "length" and len(tokens) == 2


@run_async
async def test_a_bug_on_the_scheduler_thread_fails_the_open_requests_and_the_next_is_served():
    ex = FakeExecutor(auto=True)
    with scheduler(ex) as sched:
        planned, calls = sched._submit_work, []

        def broken_once() -> None:  # a bug anywhere in one pass of the loop
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("a bug")
            planned()

        sched._submit_work = broken_once
        _, finish = await collect(sched.submit(request("a")))
        tokens, ok = await collect(sched.submit(request("b", max_tokens=2)))
        assert sched._thread.is_alive()
    assert finish.error == "internal error in the scheduler: a bug" and http_of(finish).status == 500
    assert ok.finish_reason == "length" and len(tokens) == 2 and "a" in ex.released_ids()


@run_async
async def test_shutdown_fails_running_requests_as_unavailable_and_refuses_new_ones():
    ex = FakeExecutor()
    sched = Scheduler(ex, FakeTokenizer(), context_length=1024, warmup=False).start()
    stream = sched.submit(request("a"))
    await ex.next_step()
    sched.close()
    _, finish = await collect(stream)
    reply = http_of(finish)
    assert (finish.code, reply.status, reply.headers["Retry-After"]) == (ErrorCode.UNAVAILABLE, 503, "1")
    with pytest.raises(EngineUnavailable) as refused:
        sched.submit(request("b"))
    assert error_reply(refused.value).status == 503 and ex.closed


@run_async
async def test_a_full_queue_is_a_503_with_retry_after():
    ex = FakeExecutor()
    with scheduler(ex, parallel=1, max_queue=0) as sched:
        sched.submit(request("a"))
        with pytest.raises(EngineOverloaded) as refused:
            sched.submit(request("b"))
    reply = error_reply(refused.value)
    assert (reply.status, reply.headers["Retry-After"], reply.json()["error"]["code"]) == (503, "1",
                                                                                           "server_overloaded")


# -- the request state machine ------------------------------------------------------------------------

S = RequestState
ENDS = {S.FINISHED_STOPPED, S.FINISHED_LENGTH, S.FINISHED_ERROR, S.FINISHED_CANCELLED}
ALLOWED = {
    S.WAITING: {S.PREFILLING, S.JOINING, S.FINISHED_ERROR, S.FINISHED_CANCELLED},
    S.PREFILLING: {S.JOINING, S.RESUMING, S.FINISHED_ERROR, S.FINISHED_CANCELLED},
    S.JOINING: {S.RUNNING} | ENDS,
    S.RUNNING: ENDS | {S.RESUMING},
    S.RESUMING: {S.PREFILLING, S.FINISHED_ERROR, S.FINISHED_CANCELLED},
    **{end: set() for end in ENDS},
}


@pytest.fixture
def moves(monkeypatch) -> dict[str, list[str]]:
    """Every request's states in the order it went through them, recorded at ``Seq.move``."""
    seen: dict[str, list[str]] = {}
    move = Seq.move

    def recording(seq: Seq, to: RequestState) -> RequestState:
        was = move(seq, to)
        seen.setdefault(seq.rid, [was.name]).append(to.name)
        return was

    monkeypatch.setattr(Seq, "move", recording)
    return seen


def path(*states: str) -> list[str]:
    return ["WAITING", *states]


async def step_until(ex: FakeExecutor, done: Callable[[], bool]) -> None:
    """Complete steps one at a time until ``done()``, checked while a step is in flight: with ``depth`` 1 the
    next step is submitted only after the last one was applied, so the states are settled then."""
    while True:
        step = await ex.next_step()
        if done():
            return
        ex.complete(step)


def state_of(sched: Scheduler, rid: str) -> RequestState | None:
    seq = sched._seqs.get(rid)
    return None if seq is None else seq.state


def test_the_transition_table_is_the_documented_one():
    assert {k: set(v) for k, v in TRANSITIONS.items()} == ALLOWED
    assert {s for s in S if s.finished} == ENDS


@pytest.mark.parametrize("start", list(S))
def test_a_move_outside_the_table_raises_and_leaves_the_state(start):
    for to in S:
        seq = Seq(request("a"), None, None, state=start)  # type: ignore[arg-type]
        if to in ALLOWED[start]:
            assert seq.move(to) is start and seq.state is to
        else:
            with pytest.raises(IllegalTransition, match=f"request a: {start.name} -> {to.name}"):
                seq.move(to)
            assert seq.state is start


def test_the_docs_table_lists_every_transition():
    text = (Path(__file__).resolve().parents[2] / "docs" / "engine.md").read_text()
    section = text.split("### Request states", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| (.*?) \|", section, re.M)
    documented = {S[name]: {S[to] for to in re.findall(r"`(\w+)`", targets)} for name, targets in rows}
    assert documented == {k: v for k, v in ALLOWED.items()}


@run_async
async def test_a_request_goes_waiting_prefilling_joining_running_finished(moves):
    ex = FakeExecutor(auto=True)
    with scheduler(ex, prefill_step=2) as sched:
        await collect(sched.submit(request("a", (1, 2, 3), max_tokens=3)))
    assert moves == {"a": path("PREFILLING", "JOINING", "RUNNING", "FINISHED_LENGTH")}


@run_async
async def test_eos_and_a_stop_string_finish_stopped_max_tokens_on_the_first_token_length(moves):
    tok = FakeTokenizer({10: "Hi", 11: "!"})
    ex = FakeExecutor(auto=True, script={"eos": [10, EOS], "stop": [10, 11], "one": [10]})
    with scheduler(ex, tok) as sched:
        await collect(sched.submit(request("eos")))
        await collect(sched.submit(request("stop", stop=("!",))))
        await collect(sched.submit(request("one", max_tokens=1)))
    assert moves == {"eos": path("PREFILLING", "JOINING", "RUNNING", "FINISHED_STOPPED"),
                     "stop": path("PREFILLING", "JOINING", "RUNNING", "FINISHED_STOPPED"),
                     "one": path("PREFILLING", "JOINING", "FINISHED_LENGTH")}


@run_async
async def test_a_sequence_prefilled_elsewhere_skips_prefilling(moves):
    ex = FakeExecutor(auto=True)
    with scheduler(ex) as sched:
        await collect(sched.submit_prefilled(request("a", max_tokens=2), Sampled(10), cache="kv"))
        await collect(sched.submit_prefilled(request("b"), Sampled(EOS), cache="kv"))
    assert moves == {"a": path("JOINING", "RUNNING", "FINISHED_LENGTH"), "b": path("JOINING", "FINISHED_STOPPED")}


@run_async
async def test_a_sequence_waits_in_joining_until_its_group_has_room(moves):
    ex = FakeExecutor(micro_batch_size=1)
    with scheduler(ex, parallel=2) as sched:
        a = sched.submit(request("a", max_tokens=3))
        b = sched.submit(request("b", max_tokens=2))
        await step_until(ex, lambda: state_of(sched, "b") is S.JOINING)
        assert (await ex.next_step()).rids == ["a"] and state_of(sched, "a") is S.RUNNING
        await settle()
        assert state_of(sched, "b") is S.JOINING  # the group of one row is full
        await ex.drive(lambda: "b" in ex.released_ids())
        await collect(a)
        await collect(b)
    assert moves["a"] == path("PREFILLING", "JOINING", "RUNNING", "FINISHED_LENGTH")
    assert moves["b"] == path("PREFILLING", "JOINING", "RUNNING", "FINISHED_LENGTH")


@run_async
async def test_cancelling_finishes_cancelled_from_waiting_prefilling_and_running(moves):
    ex = FakeExecutor()
    with scheduler(ex, parallel=2, prefill_step=2) as sched:
        run = sched.submit(request("run", (1,), max_tokens=50))
        pre = sched.submit(request("pre", (1, 2, 3, 4, 5, 6)))
        wait = sched.submit(request("wait"))
        await step_until(ex, lambda: state_of(sched, "run") is S.RUNNING and ex.pending[0][0].kind == "prefill")
        assert (state_of(sched, "pre"), state_of(sched, "wait")) == (S.PREFILLING, S.WAITING)
        for stream in (wait, pre, run):
            stream.cancel()
        await until(lambda: not sched._seqs, "all three gone")
    assert moves == {"run": path("PREFILLING", "JOINING", "RUNNING", "FINISHED_CANCELLED"),
                     "pre": path("PREFILLING", "FINISHED_CANCELLED"), "wait": path("FINISHED_CANCELLED")}


@run_async
async def test_failures_finish_error_from_waiting_and_prefilling(moves):
    ex = FakeExecutor()
    with scheduler(ex) as sched:
        ex.fail_prepare = ExecutorError("no downstream stage", ErrorCode.UNREACHABLE)
        await collect(sched.submit(request("refused")))
        ex.fail_prepare = None
        failed = sched.submit(request("failed"))
        ex.complete(await ex.next_step(), RuntimeError("boom"))
        await collect(failed)
    assert moves == {"refused": path("FINISHED_ERROR"), "failed": path("PREFILLING", "FINISHED_ERROR")}


@run_async
async def test_shutdown_finishes_every_request_with_an_error(moves):
    ex = FakeExecutor()
    sched = Scheduler(ex, FakeTokenizer(), context_length=1024, parallel=1, warmup=False).start()
    running, waiting = sched.submit(request("run")), sched.submit(request("wait"))
    await step_until(ex, lambda: state_of(sched, "run") is S.RUNNING)
    sched.close(timeout=5)
    assert (await collect(running))[1].code is ErrorCode.UNAVAILABLE
    assert (await collect(waiting))[1].code is ErrorCode.UNAVAILABLE
    assert moves == {"run": path("PREFILLING", "JOINING", "RUNNING", "FINISHED_ERROR"), "wait": path("FINISHED_ERROR")}


# -- a prefilled sequence on the real LocalExecutor ------------------------------------------------------

PROMPT = (1, 40, 41, 42, 43, 44, 45, 46)
OTHER = (1, 50, 51, 52)


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    from mlxcel.models.loading import load_checkpoint

    return load_checkpoint(tiny_llama)


@contextlib.contextmanager
def local(tiny) -> Iterator[Scheduler]:
    from mlxcel.engine.executor import LocalExecutor

    sched = Scheduler(LocalExecutor(tiny.model, max_batch_size=2), tiny.tokenizer, context_length=2048,
                      parallel=2, warmup=False).start()
    try:
        yield sched
    finally:
        sched.close()


def greedy(prompt: tuple[int, ...], rid: str, n: int = 12) -> EngineRequest:
    return EngineRequest(prompt, SamplingParams(max_tokens=n), ignore_eos=True, request_id=rid)


def prefill_elsewhere(tiny, request: EngineRequest):
    """What a prefill node does: run the whole prompt, sample the first token, hand over the cache."""
    from mlxcel.engine.executor import LocalExecutor, Step

    node = LocalExecutor(tiny.model, max_batch_size=1)
    node.prepare(request.request_id, request.params, 0, request.prompt)
    [first] = node.run(Step("prefill", [request.request_id], [list(request.prompt)]))
    cache, length = node.runners[0].take_cache(request.request_id)
    assert length == len(request.prompt)
    return first, cache


@run_async
async def test_a_sequence_prefilled_on_another_executor_continues_token_for_token(tiny):
    with local(tiny) as sched:  # the reference: one scheduler does it all, one request after the other
        ref = [await collect(sched.submit(greedy(p, f"ref{i}"))) for i, p in enumerate((PROMPT, OTHER))]
    first, cache = prefill_elsewhere(tiny, greedy(PROMPT, "handoff"))
    with local(tiny) as sched:
        other = sched.submit(greedy(OTHER, "other"))  # decodes beside the adopted row
        adopted = sched.submit_prefilled(greedy(PROMPT, "handoff"), first, cache)
        results = [await collect(adopted), await collect(other)]
        assert sched.counters.adopted == 1 and sched.counters.shared_steps > 0
    for (tokens, finish), (ref_tokens, ref_finish) in zip(results, ref):
        assert [t.token for t in tokens] == [t.token for t in ref_tokens]
        assert "".join(texts(tokens)) == "".join(texts(ref_tokens))
        assert finish.finish_reason == ref_finish.finish_reason == "length"


@run_async
async def test_a_cache_that_does_not_fit_the_prompt_fails_the_request(tiny):
    first, cache = prefill_elsewhere(tiny, greedy(PROMPT, "handoff"))
    with local(tiny) as sched:
        _, finish = await collect(sched.submit_prefilled(greedy(PROMPT[:-1], "short"), first, cache))
        assert finish.finish_reason == "error" and "holds 8 tokens, its prompt has 7" in finish.error
        _, finish = await collect(sched.submit_prefilled(greedy(PROMPT, "layers"), first, cache[:-1]))
        assert finish.finish_reason == "error" and "list of 4 layer caches" in finish.error
        tokens, _ = await collect(sched.submit(greedy(OTHER, "after", 2)))  # the scheduler goes on
        assert len(tokens) == 2


class CancellingExecutor(FakeExecutor):
    """An executor with the optional ``cancel`` (the pipeline's CANCEL, which every stage acknowledges)."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self.cancelled: list[str] = []

    def cancel(self, rid: str) -> None:
        self.cancelled.append(rid)


@run_async
async def test_a_client_that_gives_up_is_cancelled_a_finished_request_released():
    ex = CancellingExecutor()
    with scheduler(ex, parallel=2) as sched:
        a = sched.submit(request("a", max_tokens=50))
        b = sched.submit(request("b", max_tokens=2))
        await complete_until(ex, lambda: "b" in ex.released_ids())
        step = await ex.next_step()
        a.cancel()
        await settle()
        assert ex.cancelled == []  # not while its row is in the step in flight
        ex.complete(step)
        await until(lambda: ex.cancelled == ["a"], "a cancelled")
        assert "a" not in ex.released_ids() and ex.released_ids() == ["b"]  # b finished: released, not cancelled
