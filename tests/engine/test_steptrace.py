"""The scheduler's step timeline (``MLXCEL_STEP_TRACE``): written, well-formed, summarised."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import step_trace
from mlxcel.engine import steptrace
from mlxcel.engine.interface import EngineRequest, FinishEvent, TokenEvent
from mlxcel.engine.sampling import SamplingParams
from mlxcel.engine.scheduler import local_scheduler
from tests.engine.fakes import FakeTokenizer, collect, run_async

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model(tiny_llama) -> Any:
    from mlxcel.models.loading import load_checkpoint

    return load_checkpoint(tiny_llama).model


@pytest.fixture
def trace(tmp_path: Path):
    trace = steptrace.StepTrace(tmp_path / "steps.jsonl")
    steptrace.install(trace)
    yield trace
    steptrace.install(None)
    trace.close()


@run_async
async def run_streams(model: Any, n: int, max_tokens: int) -> list[list[TokenEvent]]:
    sched = local_scheduler(model, FakeTokenizer(), context_length=256, parallel=n, warmup=True).start()
    try:
        assert sched.wait_ready(60)
        streams = [sched.submit(EngineRequest((1, 5 + i, 9), SamplingParams(max_tokens=max_tokens),
                                              ignore_eos=True)) for i in range(n)]
        out = []
        for s in streams:
            tokens, finish = await collect(s)
            assert isinstance(finish, FinishEvent) and finish.finish_reason == "length"
            out.append(tokens)
        return out
    finally:
        sched.close(timeout=10)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_every_pass_that_touched_a_step_is_one_well_formed_line(model, trace, asynchronous, monkeypatch):
    monkeypatch.setenv("MLXCEL_ASYNC_SCHED", "1" if asynchronous else "0")
    streams = run_streams(model, 3, 6)
    assert [len(t) for t in streams] == [6, 6, 6]
    trace.close()
    lines = [json.loads(raw) for raw in trace.path.read_text().splitlines()]
    assert lines, "no trace lines"
    for line in lines:
        assert set(steptrace.PHASES + steptrace.OFF_PHASES) | {"t", "wall_ms", "submitted", "applied", "other", "running", "waiting"} == set(line)
        assert line["wall_ms"] >= 0 and all(line[p] >= 0 for p in steptrace.PHASES)
        # the phases are parts of the pass (timer granularity aside)
        assert sum(line[p] for p in steptrace.PHASES) <= line["wall_ms"] + 0.05
        assert all(kind in ("prefill", "decode") and rows >= 1 for kind, rows in line["submitted"] + line["applied"])
    assert [ln["t"] for ln in lines] == sorted(ln["t"] for ln in lines)
    applied = [s for ln in lines for s in ln["applied"]]
    # warmup is not traffic; synchronous, the 3 prompts prefill in 2 steps each (the last token alone) and the
    # 5 later tokens of each come from decode steps of up to 3 rows; asynchronous, the last token of each prompt
    # after the first rides a decode step (batched tails: the first token too; the first prompt's has none to
    # ride), plus at most one queued step past each row's end
    tails = 2 if asynchronous else 0
    assert 3 * 5 + tails <= sum(rows for kind, rows in applied if kind == "decode") <= 3 * 5 + tails + 3
    assert sum(1 for kind, _ in applied if kind == "prefill") == 6 - tails
    assert sum(ln["device"] for ln in lines) > 0 and sum(ln["build"] for ln in lines) > 0
    # detokenization and delivery: on the emitter thread with asynchronous scheduling
    assert sum(ln["detok"] + ln["off_detok"] for ln in lines) > 0 and sum(ln["emit"] for ln in lines) > 0
    if asynchronous:
        assert sum(ln["off_emit"] for ln in lines) > 0


def test_the_summary_gives_shares_that_add_up(model, trace):
    run_streams(model, 2, 4)
    trace.close()
    s = step_trace.summarise(step_trace.load(trace.path))
    assert s["decode_steps"] >= 3 and s["prefill_steps"] == 4
    assert abs(sum(s["share"].values()) - 1.0) < 0.01
    assert step_trace.main([str(trace.path)]) == 0


def test_tracing_is_off_without_the_variable(monkeypatch):
    monkeypatch.delenv("MLXCEL_STEP_TRACE", raising=False)
    steptrace.install(None)
    assert steptrace.from_env() is None
    with steptrace.phase("build"):  # a no-op
        pass
