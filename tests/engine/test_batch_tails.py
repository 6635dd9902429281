"""Batched prompt tails (``Scheduler(batch_tails=True)``): a prompt's last token rides a decode step instead of
a prefill step of its own, on a tiny random llama over ``LocalExecutor``, synchronous and asynchronous.

The plan changes (no one-token prompt steps, the tail in a decode step beside the other rows); what the clients
get does not: the same tokens, texts, finishes and log-probabilities as with every tail alone.
"""

from __future__ import annotations

from typing import Any

import pytest

from mlxcel.commands.serve import CLIError, check_flags
from mlxcel.engine.executor import LocalExecutor, Step
from mlxcel.engine.scheduler import Scheduler, batch_tails_default

BATCH_TAILS_ENV = "MLXCEL_BATCH_TAILS"
from tests.engine.test_async_sched import Tokenizer, events, prompts, req, run, same

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def model(tiny_llama) -> Any:
    from mlxcel.models.loading import load_checkpoint

    return load_checkpoint(tiny_llama).model


@pytest.fixture
def plan(monkeypatch) -> list[tuple[str, list[str], list[int]]]:
    """Every step submitted to a ``LocalExecutor``: its kind, rows and each row's token count."""
    submitted: list[tuple[str, list[str], list[int]]] = []
    submit = LocalExecutor.submit

    def spy(self: LocalExecutor, step: Step, done: Any) -> None:
        submitted.append((step.kind, list(step.rids), [len(t) for t in step.tokens]))
        submit(self, step, done)

    monkeypatch.setattr(LocalExecutor, "submit", spy)
    return submitted


@pytest.mark.parametrize("lookahead", [0, 1])
def test_tails_ride_decode_steps_and_the_clients_get_the_same_events(model, plan, lookahead):
    reqs = [req(f"r{i}", p, 4 + 3 * i, ignore_eos=True, logprobs=True, top_logprobs=2)
            for i, p in enumerate(prompts(6))]
    alone, _ = run(model, 0, reqs)
    alone_plan = list(plan)
    plan.clear()
    batched, sched = run(model, lookahead, reqs, batch_tails=True)
    same(batched, alone)
    # alone: each prompt is a chunk, then its last token as a one-token prompt step
    assert [rids for kind, rids, sizes in alone_plan if kind == "prefill" and sizes == [1]] == [[r.request_id]
                                                                                                for r in reqs]
    # batched: the chunks, the first prompt's tail alone (nothing decodes yet), every later tail in a decode step
    prefills = [(rids, sizes) for kind, rids, sizes in plan if kind == "prefill"]
    assert prefills == [([r.request_id], [len(r.prompt) - 1]) for r in reqs[:1]] + [(["r0"], [1])] + \
        [([r.request_id], [len(r.prompt) - 1]) for r in reqs[1:]]
    decodes = [rids for kind, rids, _ in plan if kind == "decode"]
    assert len(decodes) < len([k for k, _, _ in alone_plan if k == "decode"]) + len(reqs)
    assert sum(len(rids) for rids in decodes) >= sum(r.params.max_tokens for r in reqs) - 1  # r0's first: a prefill
    assert len(sched.executor.runners[0]) == 0  # every row freed


def test_with_nothing_decoding_a_tail_runs_alone_as_before(model, plan):
    """One stream: no decode step to share, so the plan is the one of every tail alone, bit for bit."""
    reqs = [req("a", prompts(3)[2], 6, ignore_eos=True, logprobs=True, top_logprobs=3)]
    alone, _ = run(model, 0, reqs)
    alone_plan = list(plan)
    plan.clear()
    batched, _ = run(model, 0, reqs, batch_tails=True)
    assert events(batched) == events(alone) and plan == alone_plan
    assert [(k, sizes) for k, _, sizes in plan] == [("prefill", [len(reqs[0].prompt) - 1]), ("prefill", [1])] + \
        [("decode", [1])] * 5


def test_a_prompt_with_nothing_before_its_last_token_runs_it_alone(model, plan):
    """A one-token prompt has no cache to join a decode group with: its token stays a prompt step."""
    reqs = [req("one", (5,), 3, ignore_eos=True), req("two", prompts(1)[0], 3, ignore_eos=True)]
    alone, _ = run(model, 0, reqs)
    plan.clear()
    batched, _ = run(model, 0, reqs, batch_tails=True)
    same(batched, alone)
    assert ("prefill", ["one"], [1]) in plan and ("prefill", ["two"], [1]) not in plan


def test_eos_and_a_cancel_end_a_batched_tail_where_they_end_a_lone_one(model):
    base, _ = run(model, 0, [req(f"r{i}", p, 12, ignore_eos=True) for i, p in enumerate(prompts(4))])
    first = base[1][0][0].token  # r1's first token as its EOS: the tail's own decode step ends it
    reqs = [req(f"r{i}", p, 12) for i, p in enumerate(prompts(4))]
    alone, _ = run(model, 0, reqs, tokenizer=Tokenizer({first}), cancel_after={"r2": 2})
    batched, _ = run(model, 0, reqs, tokenizer=Tokenizer({first}), cancel_after={"r2": 2}, batch_tails=True)
    same(batched, alone)
    assert batched[1][1].finish_reason == "stop" and batched[1][0] == []  # ended by its first token


def test_on_where_scheduling_is_asynchronous_unless_the_environment_says(monkeypatch, model):
    monkeypatch.delenv(BATCH_TAILS_ENV, raising=False)
    assert (batch_tails_default(0), batch_tails_default(1)) == (False, True)
    monkeypatch.setenv(BATCH_TAILS_ENV, "1")
    assert batch_tails_default(0) is True
    ex = LocalExecutor(model, max_batch_size=2, lookahead=0)
    assert Scheduler(ex, Tokenizer(), context_length=64, warmup=False).batch_tails is True
    monkeypatch.setenv(BATCH_TAILS_ENV, "off")
    assert batch_tails_default(1) is False
    monkeypatch.setenv(BATCH_TAILS_ENV, "sometimes")
    with pytest.raises(ValueError, match="MLXCEL_BATCH_TAILS must be 1 or 0, got 'sometimes'"):
        batch_tails_default(1)


def test_serve_refuses_a_bad_switch_before_it_loads_anything(monkeypatch):
    from mlxcel.cli import build_parser

    monkeypatch.setenv(BATCH_TAILS_ENV, "maybe")
    args = build_parser().parse_args(["serve", "-m", "anything"])
    with pytest.raises(CLIError, match="MLXCEL_BATCH_TAILS must be 1 or 0, got 'maybe'"):
        check_flags(args)
