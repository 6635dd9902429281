"""Chaos on a pipeline with a spare (``--pp-auto 2 --pp-spare 1`` over three ``--pp-peer`` processes,
``tests/chaos/spare_cluster.py``) on loopback addresses: 4 streams of bounded load while a loop kills, freezes and restarts a random stage,
one round of those three actions 2.5 s (+-50%) apart (``tests/chaos/scenario.py``; MLXCEL_CHAOS_SECONDS
for a timed benchmark run). A round always holds a kill, so the spare's takeover is always proved. A killed or restarted node
is started again at once by the test with the same command line (a supervisor's job; issue 25 item 1),
except the first stage killed, which the spare takes over. At least 99% complete, 0 hung, 0 truncated
(issue 25 item 6).
"""

from __future__ import annotations

import pytest

from tests.chaos.scenario import run_chaos
from tests.chaos.spare_cluster import SpareCluster

pytestmark = [pytest.mark.proc, pytest.mark.timeout(900), pytest.mark.usefixtures("patient_starts")]


def test_chaos_pipeline_two_stages_and_a_spare(tmp_path, tiny_llama):
    """--pp-auto 2 --pp-spare 1: the first killed stage is left dead and the spare takes it over; later
    ones are started again from their TOML (the supervisor's job). Requests in flight at a failure are
    resumed, and new ones that arrive while a stage is down are held until it is back (docs/pipeline.md
    §5.6): at least 99% complete, 0 hung, 0 truncated, and the spare took the killed stage over."""
    c = SpareCluster(tmp_path, tiny_llama).start()
    try:
        counts = run_chaos("pipeline-spare", c.url, c.targets(), c.healthy, tmp_path, one_round=True)
        assert counts.completed >= 0.99 * counts.started, counts.summary()
        assert any(e["action"] == "kill" for e in counts.events), counts.events  # every round holds a kill
        assert c.spare is None, "the spare took no stage over"
        assert any(s["state"].startswith("stage-") for s in c.health()["spares"])
    finally:
        c.stop()
