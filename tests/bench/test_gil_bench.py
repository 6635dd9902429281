"""bench/gil_bench.py: every configuration measured each repeat, in alternating order, rows the report accepts."""

from __future__ import annotations

import json

import pytest

from bench import gil_bench
from mlxcel.report.schema import validate_row

pytestmark = pytest.mark.proc  # the rows' environment runs git (tests/proc_marker.py)


def test_configurations_alternate_their_order_and_the_rows_validate(tmp_path, monkeypatch):
    calls = []
    real = gil_bench.measure

    def recorded(config, data, secret):
        calls.append(config)
        return real(config, data, secret)

    monkeypatch.setattr(gil_bench, "measure", recorded)
    assert gil_bench.main(["--mib", "2", "--repeats", "2", "--busy", "0,1", "--intervals", "0.5", "--frames", "256",
                           "--out", str(tmp_path)]) == 0
    assert calls == [(0, 0.5, 256), (1, 0.5, 256), (1, 0.5, 256), (0, 0.5, 256)]  # A B B A
    rows = [json.loads(line) for line in (tmp_path / "gil_bench.jsonl").read_text().splitlines()]
    assert [validate_row(r)[0] for r in rows] == ["gil_stream", "gil_stream"]
    assert {(r["busy_threads"], r["repeats"], r["mib"]) for r in rows} == {(0, 2, 2), (1, 2, 2)}
    assert all(r["min_ms"] <= r["p50_ms"] <= r["max_ms"] and r["env"]["host"] for r in rows)


def test_a_measurement_leaves_the_switch_interval_and_no_spinning_thread(monkeypatch):
    import sys
    import threading

    before, threads = sys.getswitchinterval(), threading.active_count()
    gil_bench.measure((2, 0.2, 256), gil_bench.np.zeros(1 << 20, dtype=gil_bench.np.uint8),
                      gil_bench.ClusterSecret(b"k" * 32))
    assert sys.getswitchinterval() == before and threading.active_count() == threads
