"""A stage's worker: queued steps of two micro-batches run in arrival order, each to its end (docs/pipeline.md
§3.13; the build-ahead switch ``MLXCEL_STAGE_OVERLAP`` was removed, issue 41).

Real ``StageService`` stages and a real ``PipelineExecutor`` over the authenticated transport, in this
process, on the 4-layer tiny llama (layers 0-1 and 2-3). Two sequences decode in micro-batches 0 and 1,
each step of both submitted at once, so a stage holds the second while it runs the first: the tokens stay
those of one device, nothing is counted as built ahead, and a failing step fails alone.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mlxcel.engine.executor import ExecutorError, LocalExecutor, Step, slice_runner
from mlxcel.models.facts import model_facts
from mlxcel.pipeline.stage import StageService
from tests.pipeline.members import (
    COORDINATOR_IP,
    LAYERS,
    MAX_ROWS,
    STAGE_IPS,
    GreedyRun,
    Pending,
    cluster_config,
    free_port,
    start_coordinator,
    start_stage,
)

pytestmark = pytest.mark.timeout(120)

PROMPTS = ([1, 40, 41, 42, 43], [1, 50, 51, 52, 53, 54, 55])
N = 6  # tokens per sequence: the prompt's, then 5 decode steps


@pytest.fixture(scope="module")
def model(tiny_llama):
    from mlxcel.models.loading import load_checkpoint

    return load_checkpoint(tiny_llama).model


@pytest.fixture(scope="module")
def expected(model) -> list[list[int]]:
    """Each prompt's greedy tokens from the whole model in this process."""
    return [GreedyRun(LocalExecutor(model, max_batch_size=MAX_ROWS), f"ref-{i}", p).run(N)
            for i, p in enumerate(PROMPTS)]


def _pipeline(model, tiny_llama, step_delay_s: float) -> tuple[object, list[StageService]]:
    facts = model_facts(tiny_llama)
    config = cluster_config(f"{COORDINATOR_IP}:{free_port(COORDINATOR_IP)}",
                            [f"{ip}:{free_port(ip)}" for ip in STAGE_IPS], exchange_s=10.0)
    stages: list[StageService] = []
    try:
        for i, (a, b) in enumerate(LAYERS):
            stages.append(start_stage(config, i, slice_runner(model, a, b, max_rows=MAX_ROWS), facts,
                                      step_delay_s=step_delay_s))
        coordinator, _ = start_coordinator(config, facts)
    except BaseException:
        for s in stages:
            s.close()
        raise
    return coordinator, stages


@pytest.fixture
def pipeline(model, tiny_llama) -> Iterator[tuple[object, list[StageService]]]:
    # each step sleeps a little before it is built, so the other micro-batch's step is queued meanwhile
    coordinator, stages = _pipeline(model, tiny_llama, 0.05)
    yield coordinator, stages
    coordinator.close()
    for s in stages:
        s.close()


def _decode_both(coordinator, runs: list[GreedyRun]) -> list[object]:
    """One decode step of every run, all submitted before any is waited for; the outcomes in order."""
    pending = [Pending(coordinator, Step("decode", [r.rid], [[r.tokens[-1]]], slot=r.slot)) for r in runs]
    return [p.result() for p in pending]


def test_queued_micro_batches_give_one_devices_tokens(pipeline, expected):
    coordinator, stages = pipeline
    runs = [GreedyRun(coordinator, f"seq-{i}", p, slot=i) for i, p in enumerate(PROMPTS)]
    for r in runs:
        r.step()  # the prompt, and the first token
    for _ in range(N - 1):
        for r, outcome in zip(runs, _decode_both(coordinator, runs)):
            assert not isinstance(outcome, BaseException), outcome
            r.tokens.append(outcome[0].token)
    assert [r.tokens for r in runs] == expected
    assert [s.state()["overlapped"] for s in stages] == [0, 0]  # kept on the wire, never counted now
    assert all(s.steps > 0 for s in stages)
    for r in runs:
        r.release()


def test_a_step_failing_on_the_worker_beside_one_queued_fails_alone(pipeline, expected):
    coordinator, stages = pipeline
    good = GreedyRun(coordinator, "good", PROMPTS[0], slot=0)
    moved = GreedyRun(coordinator, "moved", PROMPTS[1], slot=1)
    good.step(), moved.step(), moved.step()  # "moved" now decodes in micro-batch 1
    moved.slot = 2  # its next step names micro-batch 2: the stage's runner refuses it when it builds it
    ok, failed = _decode_both(coordinator, [good, moved])
    assert isinstance(failed, ExecutorError) and "already decodes in micro-batch" in str(failed), failed
    assert not isinstance(ok, BaseException), ok
    good.tokens.append(ok[0].token)
    assert good.run(N) == expected[0]  # the stages serve on, the good sequence's tokens unchanged
    assert all(s._worker.is_alive() for s in stages)
