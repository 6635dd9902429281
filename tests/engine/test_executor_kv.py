"""``LocalExecutor``'s KV handoff pair, driven directly: ``export_on_finish`` / ``request_finished`` /
``finished_sending`` on the sending side, ``adopt`` of a ``KVImport`` on the receiving side."""

from __future__ import annotations

import time
from typing import Any

import pytest

from mlxcel.engine.executor import KVExport, KVImport, LocalExecutor, Step
from mlxcel.engine.sampling import SamplingParams

PROMPT = [1, 40, 41, 42, 43, 44, 45, 46]
SEEDED = SamplingParams(max_tokens=8, temperature=1.5, seed=7)


@pytest.fixture(scope="module")
def model(tiny_llama) -> Any:
    from mlxcel.models.loading import load_checkpoint

    return load_checkpoint(tiny_llama).model


class Spy:
    """An exporter that records its calls and tags what it returns (or raises ``fail``)."""

    def __init__(self, fail: Exception | None = None):
        self.calls: list[int] = []
        self.fail = fail

    def __call__(self, cache: list, length: int) -> tuple[str, list]:
        self.calls.append(length)
        if self.fail is not None:
            raise self.fail
        return "exported", cache


def prefilled(ex: LocalExecutor, rid: str, params: SamplingParams = SamplingParams()) -> int:
    """Prepare and prefill ``PROMPT`` as ``rid``; the first token sampled."""
    ex.prepare(rid, params, 0, PROMPT)
    [first] = ex.run(Step("prefill", [rid], [list(PROMPT)]))
    return first.token


def decoded(ex: LocalExecutor, rid: str, token: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        [s] = ex.run(Step("decode", [rid], [[token]], slot=0))
        token = s.token
        out.append(token)
    return out


def test_a_marked_sequence_is_exported_when_it_ends_and_held_until_its_send_is_reported(model):
    spy = Spy()
    ex = LocalExecutor(model, max_batch_size=1, exporter=spy)
    ex.export_on_finish("a")
    first = prefilled(ex, "a")
    assert ex.request_finished("a") is None  # not ended yet
    ex.release("a", PROMPT + [first])
    kv = ex.request_finished("a")
    assert isinstance(kv, KVExport) and kv.length == len(PROMPT) and kv.data[0] == "exported"
    assert [c.offset for c in kv.data[1]] == [len(PROMPT)] * 4
    assert "a" not in ex.runners[0]  # the runner's row is gone; the export is what is held
    assert ex.request_finished("a") is kv  # held: asking again gives the same export
    ex.finished_sending("a")
    assert ex.request_finished("a") is None and spy.calls == [len(PROMPT)]


def test_unmarked_cancelled_and_given_up_sequences_export_nothing(model):
    spy = Spy()
    ex = LocalExecutor(model, max_batch_size=1, exporter=spy)
    prefilled(ex, "plain")
    ex.release("plain", PROMPT)  # never marked: an ordinary request
    ex.export_on_finish("cancelled")
    prefilled(ex, "cancelled")
    ex.release("cancelled", None)  # its client gave up: no tokens, no KV kept
    ex.export_on_finish("given-up")
    prefilled(ex, "given-up")
    ex.finished_sending("given-up")  # the sender gave up before it ended
    ex.release("given-up", PROMPT)
    assert spy.calls == [] and len(ex.runners[0]) == 0
    assert [ex.request_finished(r) for r in ("plain", "cancelled", "given-up")] == [None] * 3


def test_a_failed_export_is_raised_to_the_sender_and_freed_by_its_report(model):
    ex = LocalExecutor(model, max_batch_size=1, exporter=Spy(fail=ValueError("no room on the wire")))
    ex.export_on_finish("a")
    prefilled(ex, "a")
    ex.release("a", PROMPT)
    assert "a" not in ex.runners[0]
    with pytest.raises(ValueError, match="no room on the wire"):
        ex.request_finished("a")
    ex.finished_sending("a")
    assert ex.request_finished("a") is None


def test_an_adopted_import_continues_the_senders_seeded_stream_token_for_token(model):
    """Prefill and sample on one executor, adopt its export on another: the same tokens as one executor."""
    ref = LocalExecutor(model, max_batch_size=1)
    first = prefilled(ref, "r", SEEDED)
    want = decoded(ref, "r", first, 6)

    imported: list[Any] = []
    sender = LocalExecutor(model, max_batch_size=1)
    receiver = LocalExecutor(model, max_batch_size=1, importer=lambda data: imported.append(data) or data)
    sender.export_on_finish("s")
    assert prefilled(sender, "s", SEEDED) == first
    sender.release("s", PROMPT + [first])
    kv = sender.request_finished("s")
    assert kv is not None
    receiver.adopt("s", SEEDED, 0, KVImport(kv.data, draws=1), len(PROMPT))  # one draw: the first token
    assert imported == [kv.data]
    assert decoded(receiver, "s", first, 6) == want


def test_an_import_that_does_not_fit_the_prompt_is_refused(model):
    sender = LocalExecutor(model, max_batch_size=1)
    sender.export_on_finish("s")
    prefilled(sender, "s")
    sender.release("s", PROMPT)
    kv = sender.request_finished("s")
    assert kv is not None
    with pytest.raises(ValueError, match="holds 8 tokens, its prompt has 7"):
        LocalExecutor(model, max_batch_size=1).adopt("s", SamplingParams(), 0, KVImport(kv.data), len(PROMPT) - 1)


def test_step_delay_sleeps_before_decode_steps_only(model):
    ex = LocalExecutor(model, max_batch_size=1, step_delay_s=0.5)
    start = time.perf_counter()
    first = prefilled(ex, "a")
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    decoded(ex, "a", first, 1)
    assert prefill_s < 0.5 <= time.perf_counter() - start
