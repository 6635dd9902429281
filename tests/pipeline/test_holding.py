"""Holding a new request whose PREPARE failed (docs/pipeline.md §5.6, "Holding new requests"), end to end.

A real coordinator process (``mlxcel serve --distributed-config``, HTTP on 127.0.0.2) in front of one
real stage of the tiny llama, served in this process on 127.0.0.3 over the authenticated transport with
the cluster's secret. A gate on the stage's PREPARE handler plays the failure: it leaves the first
PREPARE unanswered (the coordinator's command timeout runs out, as with a stage that hangs while its
heartbeats go on), then refuses later ones with a real ERROR (``unavailable``, or ``not_found``) or lets
them through. The ``--resume-timeout`` budget counts from the first hold, after the unanswered PREPARE
timed out: retries happen within it, a stage back in time serves the request, and the 503 comes no
earlier than first hold + budget. A PREPARE refused ``not_found`` is not held: 500 at once, one PREPARE.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import load_secret
from mlxcel.engine.executor import slice_runner
from mlxcel.error_codes import ErrorCode
from mlxcel.models.facts import model_facts
from mlxcel.pipeline.coordinator import COMMAND_TIMEOUT_S
from mlxcel.pipeline.protocol import ProtocolError, StageMessage
from mlxcel.pipeline.stage import StageService
from mlxcel.topology.cluster_config import load_cluster_config
from tests.engine.fakes import held_of
from tests.pipeline.cluster import COORDINATOR_HOST, LocalCluster, Node
from tests.server.util import metrics

pytestmark = [pytest.mark.timeout(180), pytest.mark.proc]
BUDGET_S = 2.0  # --resume-timeout
BODY = {"model": "tiny", "prompt": [1, 50, 51, 52], "max_tokens": 3, "temperature": 0, "ignore_eos": True}


@dataclass
class PrepareGate:
    """Sits in front of a real stage's PREPARE handler: records each arrival, leaves the first ``drop``
    unanswered, refuses the rest with ``refuse`` (an ERROR of that code), or hands them to the stage."""

    stage: StageService
    drop: int = 0
    refuse: ErrorCode | None = None
    arrivals: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.handler = self.stage._cmd_prepare  # noqa: SLF001 - the stage looks its handlers up by name
        self.stage._cmd_prepare = self  # type: ignore[method-assign]  # noqa: SLF001

    def reset(self, *, drop: int = 0, refuse: ErrorCode | None = None) -> None:
        self.drop, self.refuse, self.arrivals = drop, refuse, []

    def __call__(self, peer: PeerId, m: StageMessage) -> None:
        self.arrivals.append(time.monotonic())
        if self.drop:
            self.drop -= 1
            return
        if self.refuse is not None:
            raise ProtocolError(self.refuse, f"gate: PREPARE refused with {self.refuse.wire_name}")
        self.handler(peer, m)


@pytest.fixture(scope="module")
def gated(tmp_path_factory, tiny_llama) -> Iterator[tuple[LocalCluster, PrepareGate]]:
    from mlxcel.models.loading import load_checkpoint

    c = LocalCluster(tmp_path_factory.mktemp("holding"), tiny_llama, stages=1, layers=["0-3"],
                     coordinator_flags=("--resume-timeout", f"{BUDGET_S:g}"))
    config = load_cluster_config(c.toml)
    secret = load_secret(toml_secret_file=config.secret_file, env={})
    runner = slice_runner(load_checkpoint(tiny_llama).model, 0, 4, max_rows=config.max_batch_size)
    stage = StageService(config, "stage-0", runner, secret, model_facts(tiny_llama))
    gate = PrepareGate(stage)
    stage.start()
    try:
        c.coordinator = Node(tiny_llama, c.toml, "coordinator", COORDINATOR_HOST, *c.coordinator_flags)
        c.coordinator.wait_ready()
        yield c, gate
    finally:
        c.stop()
        stage.close()


def test_a_prepare_refused_not_found_is_500_at_once_and_not_retried(gated):
    c, gate = gated
    gate.reset(refuse=ErrorCode.NOT_FOUND)
    start = time.monotonic()
    r = httpx.post(f"{c.url}/v1/completions", json=BODY, timeout=60)
    took = time.monotonic() - start
    assert r.status_code == 500 and "retry-after" not in r.headers, (r.status_code, r.text)
    assert "not_found" in r.json()["error"]["message"], r.text
    assert took < 1.0, took  # not held: no retry every 0.5 s, no wait for --resume-timeout
    time.sleep(1.0)  # two retry periods: none comes
    assert len(gate.arrivals) == 1, gate.arrivals
    assert metrics(c.url).get("mlxcel_requests_held_total", 0) == 0


def test_the_budget_starts_when_first_held_and_retries_happen_within_it(gated):
    c, gate = gated
    gate.reset(drop=1, refuse=ErrorCode.UNAVAILABLE)  # silent once, then refusing (draining) at once
    r = httpx.post(f"{c.url}/v1/completions", json=BODY, timeout=120)
    end = time.monotonic()
    assert r.status_code == 503 and r.headers.get("retry-after") == "1", (r.status_code, r.text)
    first, retries = gate.arrivals[0], gate.arrivals[1:]
    # held once the unanswered PREPARE timed out (its command timeout counts from before it arrived here)
    first_held = first + COMMAND_TIMEOUT_S - 0.05
    assert retries and retries[0] >= first_held, gate.arrivals  # a retry came, after the hold began
    assert len(retries) >= 2, gate.arrivals  # every 0.5 s while held, not one try then 503
    assert end >= first_held + BUDGET_S, (end - first, gate.arrivals)
    message = r.json()["error"]["message"]
    assert "unavailable" in message and BUDGET_S <= held_of(message) < BUDGET_S + 1, message


def test_a_stage_answering_again_within_the_budget_serves_the_held_request(gated):
    c, gate = gated
    gate.reset(drop=1)  # silent once, then a real PREPARE again
    start = time.monotonic()
    r = httpx.post(f"{c.url}/v1/completions", json=BODY, timeout=120)
    assert r.status_code == 200, (r.status_code, r.text)
    assert r.json()["usage"]["completion_tokens"] == 3
    assert len(gate.arrivals) == 2 and time.monotonic() - start >= COMMAND_TIMEOUT_S, gate.arrivals
