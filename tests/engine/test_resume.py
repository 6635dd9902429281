"""Resuming a request whose node failed (``mlxcel.engine.resume``), on the scheduler with a fake executor.

A step that fails with a node failure the executor calls ``resumable`` does not end its requests: each
is released, prepared again with ``prompt + generated`` and its sampler ``len(generated)`` draws on,
prefilled, and goes on; the client's stream has every token once, in order. The bounds hold: at most
``max_resumes`` resumes, each waiting at most ``wait_s``, then a 503 (the failure's retryable code); a
failure on the request itself, an executor without the hook, or ``max_resumes`` 0 fails as before.
The sampler keys that make a resumed seeded stream continue are checked against the real sampler.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import mlx.core as mx
import pytest

from mlxcel.engine.executor import ExecutorError
from mlxcel.engine.interface import EngineOverloaded, EngineRequest, FinishEvent, TokenEvent
from mlxcel.engine.resume import RETRY_S, ResumePolicy
from mlxcel.engine.runner import RowSampler, sample_rows
from mlxcel.engine.sampling import SamplingParams, draw_seed, make_sampler
from mlxcel.engine.scheduler import Scheduler
from mlxcel.error_codes import ErrorCode
from tests.engine.fakes import FakeExecutor, FakeTokenizer, collect, events_now, held_of, run_async, until
from tests.engine.test_scheduler import http_of

pytestmark = pytest.mark.timeout(60)
LOST = ExecutorError("pipeline stage stage-1 is unreachable", ErrorCode.UNREACHABLE)


class ResumingExecutor(FakeExecutor):
    """A fake that can resume: a retryable failure is a node failure; records every prepare's draws."""

    def __init__(self, *, policy: ResumePolicy = ResumePolicy(3, 5.0), **kw: Any):
        super().__init__(**kw)
        self.resume_policy = policy
        self.draws: list[tuple[str, tuple[int, ...], int]] = []
        self.prepare_failures: list[Exception] = []  # raised by the next prepares, in order
        self.checked = 0
        self.attempts: list[int] = []

    def resumable(self, exc: BaseException) -> bool:
        return isinstance(exc, ExecutorError) and exc.code.retryable

    def check_peers(self) -> None:
        self.checked += 1

    def prepare(self, rid: str, params: SamplingParams, top_logprobs: int, prompt: Sequence[int], *,
                draws: int = 0, attempt: int = 0) -> int:
        if self.prepare_failures:
            raise self.prepare_failures.pop(0)
        self.draws.append((rid, tuple(prompt), draws))
        self.attempts.append(attempt)
        return super().prepare(rid, params, top_logprobs, prompt)


def request(rid: str, prompt: tuple[int, ...] = (1, 2, 3), **params: Any) -> EngineRequest:
    params.setdefault("max_tokens", 6)
    return EngineRequest(prompt, SamplingParams(**params), request_id=rid)


@contextlib.contextmanager
def scheduler(executor: FakeExecutor, **kw: Any) -> Iterator[Scheduler]:
    sched = Scheduler(executor, FakeTokenizer(), context_length=1024, warmup=False, **kw).start()
    try:
        yield sched
    finally:
        sched.close(timeout=5)


async def fail_decode_after(ex: FakeExecutor, tokens: int, rid: str = "a", error: Exception = LOST) -> None:
    """Complete steps until ``rid`` sampled ``tokens`` tokens, then fail its next decode step with ``error``."""
    while True:
        step = await ex.next_step()
        if step.kind == "decode" and ex._sampled.get(rid, 0) >= tokens:  # noqa: SLF001 - the fake's own count
            ex.complete(step, error)
            return
        ex.complete(step)


@run_async
async def test_a_decode_step_lost_to_a_node_resumes_with_prompt_plus_tokens_and_the_stream_goes_on():
    ex = ResumingExecutor()
    with scheduler(ex) as sched:
        stream = sched.submit(request("a", max_tokens=6))
        await fail_decode_after(ex, 3)
        await ex.drive(lambda: stream.finished or sched.counters.generated_tokens >= 6)
        tokens, finish = await collect(stream)
        assert [t.token for t in tokens] == [100, 101, 102, 103, 104, 105]  # each once, in order
        assert "".join(t.text for t in tokens) == "".join(f"<{n}>" for n in range(100, 106))
        assert (finish.finish_reason, finish.error, finish.completion_tokens) == ("length", None, 6)
        # prepared again with the prompt and the 3 tokens streamed, its sampler 3 draws on
        assert ex.draws == [("a", (1, 2, 3), 0), ("a", (1, 2, 3, 100, 101, 102), 3)]
        assert ex.released_ids()[0] == "a" and ex.checked == 1 and ex.attempts == [0, 1]
        assert (sched.counters.resumed, sched.counters.resume_failed) == (1, 0)


@run_async
async def test_a_prompt_chunk_lost_to_a_node_prefills_the_prompt_again():
    ex = ResumingExecutor()
    with scheduler(ex) as sched:
        stream = sched.submit(request("a", max_tokens=2))
        first = await ex.next_step()
        assert first.kind == "prefill"
        ex.complete(first, LOST)
        await ex.drive(lambda: stream.finished or sched.counters.generated_tokens >= 2)
        tokens, finish = await collect(stream)
        assert [t.token for t in tokens] == [100, 101] and finish.error is None
        assert ex.draws == [("a", (1, 2, 3), 0), ("a", (1, 2, 3), 0)]


@run_async
async def test_a_resume_waits_for_the_node_then_goes_on():
    ex = ResumingExecutor()
    with scheduler(ex) as sched:
        stream = sched.submit(request("a", max_tokens=4))
        ex.prepare_failures = []
        await fail_decode_after(ex, 2)
        ex.prepare_failures = [LOST, LOST]  # the node is still down for two tries (0.5 s apart)
        await ex.drive(lambda: stream.finished or sched.counters.generated_tokens >= 4)
        tokens, finish = await collect(stream)
        assert [t.token for t in tokens] == [100, 101, 102, 103] and finish.error is None
        assert sched.counters.resumed == 1


@run_async
async def test_no_node_within_the_resume_timeout_is_a_503_and_counts_resume_failed():
    ex = ResumingExecutor(policy=ResumePolicy(3, 1.0))
    with scheduler(ex) as sched:
        stream = sched.submit(request("a", max_tokens=6))
        await fail_decode_after(ex, 2)
        ex.prepare_failures = [LOST] * 10
        tokens, finish = await collect(stream)
        assert [t.token for t in tokens] == [100, 101]
        assert finish.finish_reason == "error" and finish.code is ErrorCode.UNREACHABLE  # 503 + Retry-After
        assert "could not be resumed" in (finish.error or "")
        assert (sched.counters.resumed, sched.counters.resume_failed) == (0, 1)


@run_async
async def test_the_resumes_are_bounded_then_the_failure_is_the_clients_503():
    ex = ResumingExecutor(policy=ResumePolicy(2, 5.0))
    with scheduler(ex) as sched:
        stream = sched.submit(request("a", max_tokens=50))
        for n in (1, 2, 3):
            await fail_decode_after(ex, n)
        tokens, finish = await collect(stream)
        assert [t.token for t in tokens] == [100, 101, 102]
        assert finish.code is ErrorCode.UNREACHABLE and "unreachable" in (finish.error or "")
        assert sched.counters.resumed == 2


@run_async
async def test_a_failure_of_the_request_itself_is_not_resumed():
    ex = ResumingExecutor()
    with scheduler(ex) as sched:
        stream = sched.submit(request("a"))
        await fail_decode_after(ex, 1, error=ExecutorError("stage refused the tensor", ErrorCode.INTERNAL))
        _, finish = await collect(stream)
        assert finish.code is ErrorCode.INTERNAL and sched.counters.resumed == 0


@pytest.mark.parametrize("make", [lambda: FakeExecutor(), lambda: ResumingExecutor(policy=ResumePolicy(0, 5.0))],
                         ids=["no-hook", "max-resumes-0"])
@run_async
async def test_without_the_hook_or_with_max_resumes_0_a_node_failure_fails_the_request(make):
    ex = make()
    with scheduler(ex) as sched:
        stream = sched.submit(request("a"))
        await fail_decode_after(ex, 1)
        _, finish = await collect(stream)
        assert finish.code is ErrorCode.UNREACHABLE and sched.counters.resumed == 0


@run_async
async def test_a_request_cancelled_while_it_waits_to_resume_is_freed():
    ex = ResumingExecutor()
    with scheduler(ex) as sched:
        stream = sched.submit(request("a", max_tokens=20))
        await fail_decode_after(ex, 1)
        ex.prepare_failures = [LOST] * 100
        await until(lambda: bool(sched.table.resuming), "a resuming sequence")  # noqa: SLF001
        stream.cancel()
        await until(lambda: not sched._seqs, "the request freed")  # noqa: SLF001
        assert sched._inflight_requests == 0  # noqa: SLF001 - its slot is free


# -- holding a new request while its node is down (the same policy) -----------------------------------


@run_async
async def test_new_requests_while_a_node_is_down_are_held_then_start_in_order_when_it_is_back():
    ex = ResumingExecutor()
    with scheduler(ex) as sched:
        ex.fail_prepare = LOST  # the node is down: every start fails with a node failure
        first, second = sched.submit(request("a", max_tokens=3)), sched.submit(request("b", max_tokens=3))
        await until(lambda: sched.counters.held == 2, "both requests held")
        await asyncio.sleep(1.2)  # a few tries, 0.5 s apart: still held, no event, nothing prepared
        assert await events_now(first) == [] and await events_now(second) == [] and not ex.prepared
        ex.fail_prepare = None  # the node is back
        await ex.drive(lambda: sched._inflight_requests == 0)  # noqa: SLF001 - both served
        for stream in (first, second):
            tokens, finish = await collect(stream)
            assert [t.token for t in tokens] == [100, 101, 102] and finish.error is None
        assert list(ex.prepared) == ["a", "b"]  # in arrival order
        c = sched.counters
        assert (c.held, c.holds, c.hold_failed, c.resumed) == (0, 2, 0, 0)


@run_async
async def test_a_request_held_past_the_resume_timeout_is_a_503_with_retry_after():
    ex = ResumingExecutor(policy=ResumePolicy(3, 1.0))
    with scheduler(ex) as sched:
        ex.fail_prepare = LOST
        start = time.monotonic()
        tokens, finish = await collect(sched.submit(request("a")))
        waited = time.monotonic() - start
        assert tokens == [] and finish.code is ErrorCode.UNREACHABLE
        assert "stage-1 is unreachable" in finish.error and 1.0 <= held_of(finish.error) < 1.6, finish.error
        reply = http_of(finish)
        assert (reply.status, reply.headers["Retry-After"]) == (503, "1")
        assert 1.0 <= waited < 2.5, waited
        assert (sched.counters.held, sched.counters.hold_failed) == (0, 1)
        assert sched._inflight_requests == 0  # noqa: SLF001 - its slot is free
        ex.fail_prepare = None  # the next request starts at once: holding ended with the last held one
        stream = sched.submit(request("b", max_tokens=2))
        await ex.drive(lambda: sched._inflight_requests == 0)  # noqa: SLF001 - served
        tokens, finish = await collect(stream)
        assert len(tokens) == 2 and finish.error is None


@pytest.mark.parametrize("policy, error", [(ResumePolicy(0, 5.0), LOST),
                                           (ResumePolicy(3, 5.0), ExecutorError("bad tensor", ErrorCode.INTERNAL))],
                         ids=["max-resumes-0", "not-a-node-failure"])
@run_async
async def test_with_resume_off_or_a_failure_of_the_request_a_failed_start_fails_at_once(policy, error):
    ex = ResumingExecutor(policy=policy)
    with scheduler(ex) as sched:
        ex.fail_prepare = error
        start = time.monotonic()
        _, finish = await collect(sched.submit(request("a")))
        assert finish.code is error.code and time.monotonic() - start < 0.5
        assert sched.counters.holds == 0


@run_async
async def test_held_requests_count_toward_the_queue_and_one_cancelled_frees_its_slot():
    ex = ResumingExecutor()
    with scheduler(ex, parallel=1, max_queue=1) as sched:
        ex.fail_prepare = LOST
        held = [sched.submit(request(rid)) for rid in ("a", "b")]
        await until(lambda: sched.counters.held == 2, "two requests held")
        with pytest.raises(EngineOverloaded):  # parallel 1 + queue 1: full
            sched.submit(request("c"))
        held[0].cancel()  # its client went away
        await until(lambda: sched.counters.held == 1, "the cancelled one dropped")
        assert sched._inflight_requests == 1 and list(sched._seqs) == ["b"]  # noqa: SLF001
        third = sched.submit(request("c", max_tokens=2))  # its slot is free again
        ex.fail_prepare = None
        await ex.drive(lambda: sched._inflight_requests == 0)  # noqa: SLF001 - both served
        assert [(await collect(s))[1].error for s in (held[1], third)] == [None, None]
        assert "a" not in ex.prepared and sched.counters.hold_failed == 0


@run_async
async def test_an_unseeded_sampled_request_gets_a_seed_so_a_resume_replays_its_stream():
    ex = ResumingExecutor()
    with scheduler(ex) as sched:
        stream = sched.submit(request("a", max_tokens=4, temperature=0.7))
        await fail_decode_after(ex, 2)
        await ex.drive(lambda: stream.finished or sched.counters.generated_tokens >= 4)
        await collect(stream)
    seeds = {params.seed for params, _, _ in ex.prepared.values()}
    assert len(seeds) == 1 and None not in seeds


def test_a_sampler_started_after_n_draws_samples_what_the_undisturbed_one_did():
    params = SamplingParams(temperature=1.0, seed=1234)
    logits = mx.random.normal((1, 50), key=mx.random.key(0))
    undisturbed = make_sampler(params)
    tokens = [undisturbed(logits).item() for _ in range(8)]
    resumed = make_sampler(params, draws=5)
    assert [resumed(logits).item() for _ in range(3)] == tokens[5:]
    row = RowSampler(params)
    row.skip(5)  # a stage's sampler for a resumed sequence (PREPARE draws 5)
    assert [sample_rows(logits, [row])[0].token for _ in range(3)] == tokens[5:]
    assert len(set(tokens)) > 1  # really random: the check above is not trivially true


def test_draw_seeds_are_splitmix64():
    # SplitMix64's reference outputs for seed 0 (state += 0x9E3779B97F4A7C15, then the mix)
    assert [draw_seed(0, n) for n in range(3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert draw_seed(-1, 0) == draw_seed(2**64 - 1, 0)


# -- the bounds: flags, the cluster TOML, the policy ------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--max-resumes", "17"], "must be at most 16"),
    (["--max-resumes", "-1"], "must be >= 0"),
    (["--resume-timeout", "0"], "must be > 0 seconds"),
    (["--resume-timeout", "601"], "must be at most 600 seconds"),
])
def test_resume_flags_are_bounded(capsys, argv, message):
    from mlxcel.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_the_flags_override_the_cluster_toml_and_reach_the_coordinator_and_the_router(tmp_path):
    from mlxcel.cli import build_parser
    from mlxcel.commands.serve import pipeline_options
    from mlxcel.disagg.flags import _resume
    from mlxcel.topology.cluster_config import load_cluster_config
    from tests.pipeline.cluster_toml import COORDINATOR_AND_STAGE_0, write_toml

    path = write_toml(tmp_path, f"[pipeline]\nmax_resumes = 5\n[timeouts]\nresume_s = 12\n{COORDINATOR_AND_STAGE_0}")
    cluster = load_cluster_config(path)
    assert (cluster.max_resumes, cluster.timeouts.resume_s) == (5, 12.0)
    args = build_parser().parse_args(["serve", "--max-resumes", "2", "--resume-timeout", "7"])
    options = pipeline_options(args)
    assert cluster.with_resume(options.max_resumes, options.resume_timeout_s).max_resumes == 2
    assert cluster.with_resume(None, None).timeouts.resume_s == 12.0
    assert _resume((args.max_resumes, args.resume_timeout), 30.0) == (2, 7.0)
    assert _resume((None, None), 12.0) == (3, 12.0)  # the defaults, the TOML's timeout


@pytest.mark.parametrize("text, message", [
    ("[pipeline]\nmax_resumes = 17\n", "max_resumes under [pipeline] must be an integer from 0 to 16"),
    ("[pipeline]\nmax_resumes = true\n", "max_resumes under [pipeline] must be an integer"),
    ("[timeouts]\nresume_s = 1000\n", "resume_s under [timeouts] must be at most 600"),
])
def test_the_toml_keys_are_bounded(tmp_path, text, message):
    from mlxcel.topology.cluster_config import ClusterConfigError, load_cluster_config
    from tests.pipeline.cluster_toml import COORDINATOR_AND_STAGE_0, write_toml

    with pytest.raises(ClusterConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_cluster_config(write_toml(tmp_path, text + COORDINATOR_AND_STAGE_0))


@pytest.mark.parametrize("kw, expected", [
    ({}, True),
    ({"resumes": 3}, False),  # bounds spent
    ({"closing": True}, False),
    ({"code": ErrorCode.BAD_REQUEST}, False),  # about the request itself
    ({"code": ErrorCode.CANCELLED}, False),
    ({"tokens": 8}, False),  # nothing left to generate
    ({"prompt": 1000}, False),  # prompt + tokens no longer fit the context: cannot be prefilled again
    ({"policy": ResumePolicy(0, 5.0)}, False),  # resuming off
])
def test_the_router_policy_resumes_only_within_its_bounds(kw, expected):
    from mlxcel.disagg.policy import may_resume

    args = dict(code=ErrorCode.UNREACHABLE, policy=ResumePolicy(3, 5.0), resumes=0, closing=False, tokens=4,
                prompt=10, max_tokens=8, context_length=1000)
    args.update(kw)
    code, policy = args.pop("code"), args.pop("policy")
    assert may_resume(code, policy, **args) is expected


@dataclass
class Record:
    """A request being resumed, as the policy sees it (``ResumeRecord``: the scheduler's Seq, the router's Routed)."""

    resumes: int = 0
    resume_deadline: float = 0.0
    resume_next: float = 0.0


def test_the_policy_bounds_a_resume_sets_its_deadline_and_its_cadence():
    """The decisions the scheduler's Resumer and the router both take from ``ResumePolicy``."""
    policy = ResumePolicy(2, 5.0)
    assert policy.allows(1, 100, 100) and not policy.allows(2, 10, 100) and not policy.allows(0, 101, 100)
    assert not ResumePolicy(0, 5.0).allows(0, 1, 100)
    rec = Record()
    policy.begin(rec, 100.0)
    assert (rec.resumes, rec.resume_deadline, rec.resume_next) == (1, 105.0, 100.0 + RETRY_S)
    assert policy.again(rec, 104.9) and rec.resume_next == 104.9 + RETRY_S
    assert not policy.again(rec, 105.0) and rec.resume_next == 104.9 + RETRY_S  # past its deadline: give up


@pytest.mark.parametrize("policy, params, seeded", [
    (ResumePolicy(3, 5.0), SamplingParams(temperature=0.7), True),  # a resume replays its random stream
    (ResumePolicy(3, 5.0), SamplingParams(temperature=0.7, seed=7), False),  # its own seed is kept
    (ResumePolicy(3, 5.0), SamplingParams(temperature=0.0), False),  # greedy: nothing to replay
    (ResumePolicy(0, 5.0), SamplingParams(temperature=0.7), False),  # resuming off
    (None, SamplingParams(temperature=0.7), False),
])
def test_a_sampled_request_without_a_seed_gets_one_where_it_may_be_resumed(policy, params, seeded):
    from mlxcel.engine.resume import replayable

    got = replayable(params, policy)
    assert (got.seed is not None and params.seed is None) is seeded
    assert got.seed == params.seed or seeded

