"""A stage that builds its next step while the device runs the current one (``StageService(overlap=1)``,
``MLXCEL_STAGE_OVERLAP=1``).

Real ``StageService`` stages and a real ``PipelineExecutor`` over the authenticated transport, in this
process, on the 4-layer tiny llama (layers 0-1 and 2-3). Two sequences decode in micro-batches 0 and 1,
each step of both submitted at once, so a stage holds the second while it builds the first: with overlap
it builds the second before it waits for the first (counted in ``overlapped``), and the tokens stay those
of one device; without it nothing is built ahead.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mlxcel.engine.executor import ExecutorError, LocalExecutor, Step, slice_runner
from mlxcel.models.facts import model_facts
from mlxcel.pipeline.stage import STAGE_STEP_DELAY_ENV, StageService, overlap_depth
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
    wait_until,
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


def _pipeline(model, tiny_llama, overlap: int) -> tuple[object, list[StageService]]:
    facts = model_facts(tiny_llama)
    config = cluster_config(f"{COORDINATOR_IP}:{free_port(COORDINATOR_IP)}",
                            [f"{ip}:{free_port(ip)}" for ip in STAGE_IPS], exchange_s=10.0)
    stages: list[StageService] = []
    try:
        for i, (a, b) in enumerate(LAYERS):
            stages.append(start_stage(config, i, slice_runner(model, a, b, max_rows=MAX_ROWS), facts, overlap=overlap))
        coordinator, _ = start_coordinator(config, facts)
    except BaseException:
        for s in stages:
            s.close()
        raise
    return coordinator, stages


@pytest.fixture(params=[1, 0], ids=["overlap", "no-overlap"])
def pipeline(request, model, tiny_llama, monkeypatch) -> Iterator[tuple[int, object, list[StageService]]]:
    # each step sleeps a little before it is built, so the other micro-batch's step is queued meanwhile
    monkeypatch.setenv(STAGE_STEP_DELAY_ENV, "0.05")
    coordinator, stages = _pipeline(model, tiny_llama, request.param)
    yield request.param, coordinator, stages
    coordinator.close()
    for s in stages:
        s.close()


def _decode_both(coordinator, runs: list[GreedyRun]) -> list[object]:
    """One decode step of every run, all submitted before any is waited for; the outcomes in order."""
    pending = [Pending(coordinator, Step("decode", [r.rid], [[r.tokens[-1]]], slot=r.slot)) for r in runs]
    return [p.result() for p in pending]


def test_overlapped_micro_batches_give_one_devices_tokens(pipeline, expected):
    overlap, coordinator, stages = pipeline
    runs = [GreedyRun(coordinator, f"seq-{i}", p, slot=i) for i, p in enumerate(PROMPTS)]
    for r in runs:
        r.step()  # the prompt, and the first token
    for _ in range(N - 1):
        for r, outcome in zip(runs, _decode_both(coordinator, runs)):
            assert not isinstance(outcome, BaseException), outcome
            r.tokens.append(outcome[0].token)
    assert [r.tokens for r in runs] == expected
    built_ahead = [s.overlapped for s in stages]
    if overlap:
        assert all(n > 0 for n in built_ahead), built_ahead  # every stage built a step while another ran
    else:
        assert built_ahead == [0, 0]
    # the coordinator's /metrics sum the stages' STATE counts once a heartbeat has brought them
    assert wait_until(lambda: coordinator.stats()["stage_overlapped"] == sum(built_ahead))
    for r in runs:
        r.release()


def test_a_step_failing_on_the_worker_beside_one_in_flight_fails_alone(pipeline, expected):
    overlap, coordinator, stages = pipeline
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


def test_overlap_is_off_unless_switched_on(monkeypatch):
    monkeypatch.delenv("MLXCEL_STAGE_OVERLAP", raising=False)
    assert overlap_depth() == 0
    monkeypatch.setenv("MLXCEL_STAGE_OVERLAP", "1")
    assert overlap_depth() == 1
    monkeypatch.setenv("MLXCEL_STAGE_OVERLAP", "0")
    assert overlap_depth() == 0


@pytest.mark.parametrize("switch", ["MLXCEL_STAGE_OVERLAP", "MLXCEL_ASYNC_SCHED"])
def test_serve_refuses_a_bad_switch_before_it_loads_anything(monkeypatch, switch):
    from mlxcel.cli import build_parser
    from mlxcel.commands.serve import check_flags
    from mlxcel.errors import CLIError

    monkeypatch.setenv(switch, "later")
    args = build_parser().parse_args(["serve", "-m", "anything", "--distributed-config", "c.toml", "--node-id", "s"])
    with pytest.raises(CLIError, match=f"{switch} must be 1 or 0, got 'later'"):
        check_flags(args)
