"""mlxcel report's "How cost grows" section (bench/scaling_bench.py rows): per-size summaries, the per-unit
fits with their standard errors over every row, the plot, and a report without scaling rows."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from mlxcel.report.build import build_report
from mlxcel.report.schema import RowError, validate_row

ENV = {"host": "box", "git_commit": "a" * 40, "cpu_count": 2, "mlx_device": "Device(cpu, 0)",
       "date": "2026-12-07T20:00:00+00:00"}


def _pipeline(stages: int, streams: int, rnd: int) -> dict:
    ms = 20.0 + 2.5 * stages + (0.5 if rnd else -0.5)  # rounds differ by +-0.5 ms: the slope stays 2.5
    return {"bench": "scaling_pipeline", "stages": stages, "streams": streams, "round": rnd, "tokens": 8 * streams,
            "errors": 0, "wall_s": 1.0, "tok_s": 1e3 / ms * streams, "ms_per_token": ms if stages > 1 else 24.0,
            "ttft_ms": 50.0, "cpu_s_coordinator": 0.01 * stages, "cpu_s_stages": None if stages == 1 else 0.2,
            "rss_bytes": 2**28, "processes": stages + 1, "model": "tiny", "load_1m": 1.0, "env": ENV}


def _bringup(peers: int, rnd: int) -> dict:
    return {"bench": "scaling_bringup", "peers": peers, "round": rnd, "ready_s": 4.0 + 0.25 * peers + 0.1 * rnd,
            "first_token_s": 5.0 + 0.25 * peers, "push_s": 0.02 * peers, "sent_bytes": 900 * peers + 30 * peers ** 2,
            "received_bytes": 320 * peers, "sent_frames": 4 * peers, "received_frames": 3 * peers,
            "wire_bytes": 1220 * peers + 30 * peers ** 2, "coordinator_rss_bytes": 2**27, "peer_rss_bytes": peers * 2**27,
            "peer_rss_waiting_bytes": peers * 2**26, "model": "tiny", "load_1m": 1.0, "env": ENV}


def _router(p: int, d: int, rnd: int) -> dict:
    return {"bench": "scaling_router", "prefill_nodes": p, "decode_nodes": d, "nodes": p + d, "round": rnd,
            "requests": 20, "max_tokens": 8, "wall_s": 4.0, "router_cpu_s": 0.3, "router_idle_cpu_s_per_s": 0.001 * (p + d),
            "router_cpu_s_per_request": 0.01 + 0.001 * (p + d), "router_cpu_s_per_request_raw": 0.015,
            "ttft_ms_p50": 120.0, "added_ms_p50": 30.0, "added_ms_p95": 40.0 + p + d, "model": "tiny", "load_1m": 1.0,
            "env": ENV}


def _rows() -> list[dict]:
    rows = [_pipeline(s, b, r) for r in (0, 1) for s in (1, 2, 3, 4, 6, 8) for b in (1, 8)]
    rows += [_bringup(n, r) for r in (0, 1) for n in (2, 4, 8, 16, 32)]
    return rows + [_router(p, d, r) for r in (0, 1) for p, d in ((1, 1), (2, 2), (4, 4), (1, 4), (4, 1))]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("scaling") / "scaling_bench.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    out = src.parent / "report"
    result = build_report([src], out)
    assert not result.problems
    return out


def test_the_fits_recover_the_per_unit_costs_with_their_spread(report):
    fits = pd.read_csv(report / "scaling_fits.csv").set_index("fit")
    hop = fits.loc["ms/token per stage (1 stream)"]
    assert hop["slope"] == pytest.approx(2.5) and hop["n"] == 10 and hop["sizes"] == "2, 3, 4, 6, 8"
    assert 0 < hop["slope_se"] < 0.2  # the rounds' +-0.5 ms is spread, not slope
    assert fits.loc["bring-up s per peer (to serving)", "slope"] == pytest.approx(0.25)
    quad = fits.loc["assignment bytes per peer (+ quadratic)"]
    assert (quad["slope"], quad["quadratic"]) == (pytest.approx(1220), pytest.approx(30))
    assert fits.loc["router CPU s per request per node", "slope"] == pytest.approx(0.001)


def test_the_summaries_give_each_size_its_median_and_range(report):
    pipe = pd.read_csv(report / "scaling_pipeline_summary.csv")
    row = pipe[(pipe["stages"] == 4) & (pipe["streams"] == 1)].iloc[0]
    assert (row["ms_per_token_median"], row["ms_per_token_min"], row["ms_per_token_max"]) == (30.0, 29.5, 30.5)
    assert row["coord_cpu_ms_per_token_median"] == pytest.approx(40 / 8)
    bringup = pd.read_csv(report / "scaling_bringup_summary.csv")
    assert list(bringup["peers"]) == [2, 4, 8, 16, 32] and bringup["peer_rss_mib_median"].iloc[-1] == 32 * 128
    router = pd.read_csv(report / "scaling_router_summary.csv")
    assert router[(router["prefill_nodes"] == 4) & (router["decode_nodes"] == 4)]["router_cpu_ms_median"].iloc[0] == \
        pytest.approx(18)


def test_the_section_has_its_plot_and_tables(report):
    page = (report / "index.html").read_text()
    section = page[page.index('<section id="scaling">'):]
    section = section[:section.index("</section>")]
    assert section.count("data:image/png;base64,") == 1
    for heading in ("Per-unit costs (fits)", "Pipeline depth", "Bring-up fan-out", "Router width"):
        assert heading in section
    assert "2.500 ± 0." in section and "No scaling rows" not in section


def test_a_report_without_scaling_rows_says_so(tmp_path):
    src = tmp_path / "only.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in _rows() if r["bench"] == "scaling_router"))
    build_report([src], tmp_path / "r")
    page = (tmp_path / "r" / "index.html").read_text()
    assert "Router width" in page and "Pipeline depth" not in page
    assert not (tmp_path / "r" / "scaling_pipeline_summary.csv").exists()


def test_a_scaling_row_missing_a_measurement_is_rejected():
    row = _router(1, 1, 0)
    del row["router_cpu_s"]
    with pytest.raises(RowError, match="router_cpu_s"):
        validate_row(row)
