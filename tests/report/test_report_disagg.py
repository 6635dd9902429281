"""mlxcel report's disaggregated section (bench/disagg_bench.py rows): the committed CPU rows, and
the per-round pairing of the ratios against the single node."""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path

import pandas as pd
import pytest

from mlxcel.report.build import build_report
from mlxcel.report.disagg import topology_label

ROWS = Path(__file__).resolve().parents[2] / "bench" / "results" / "2026-12-01" / "disagg_bench.jsonl.gz"
ENV = {"host": "box", "git_commit": "a" * 40, "cpu_count": 2, "mlx_device": "Device(cpu, 0)",
       "date": "2026-12-02T06:00:00+00:00"}


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("disagg") / "report"
    result = build_report([ROWS], out)
    assert not result.problems
    return out


def _raw(bench: str) -> list[dict]:
    return [r for r in map(json.loads, gzip.decompress(ROWS.read_bytes()).decode().splitlines()) if r["bench"] == bench]


def test_handoff_summary_pairs_each_repeat_with_the_single_node(report):
    raw = _raw("disagg_handoff")
    summary = pd.read_csv(report / "disagg_handoff_summary.csv")
    for length in {r["target_prompt_tokens"] for r in raw}:
        ttft = {(r["topology"], r["repeat"]): r["ttft_ms"] for r in raw if r["target_prompt_tokens"] == length}
        ratios = [ttft["1p1d", rep] / ttft["hybrid", rep] for rep in {rep for _, rep in ttft}]
        moved = [r for r in raw if r["target_prompt_tokens"] == length and r["topology"] == "1p1d"]
        row = summary[(summary["target_prompt_tokens"] == length) & (summary["topology"] == "1p1d")].iloc[0]
        assert row["ttft_vs_single_median"] == pytest.approx(statistics.median(ratios))
        assert (row["ttft_vs_single_min"], row["ttft_vs_single_max"]) == (pytest.approx(min(ratios)),
                                                                          pytest.approx(max(ratios)))
        assert row["handoff_bytes_median"] == statistics.median(r["handoff_bytes"] for r in moved)
        assert row["handoff_gib_s_max"] == max(r["handoff_gib_s"] for r in moved)
        single = summary[(summary["target_prompt_tokens"] == length) & (summary["topology"] == "hybrid")].iloc[0]
        assert pd.isna(single["ttft_vs_single_median"]) and pd.isna(single["handoff_bytes_median"])


def test_serve_summary_ratios_are_per_round_against_the_single_node(report):
    raw = _raw("disagg_serve")
    summary = pd.read_csv(report / "disagg_serve_summary.csv")
    for topo in ("1p1d", "1p2d"):
        for n in (1, 4):
            tps = {(r["topology"], r["round"]): r["agg_tps"] for r in raw if r["concurrency"] == n}
            ratios = [tps[topo, rnd] / tps["hybrid", rnd] for rnd in (0, 1)]
            row = summary[(summary["topology"] == topo) & (summary["concurrency"] == n)].iloc[0]
            assert row["tps_vs_single_median"] == pytest.approx(statistics.median(ratios))
            assert row["tps_vs_single_min"] == pytest.approx(min(ratios))
            assert row["same_prompts"] == "yes" and row["server"] == topology_label(topo)
    assert summary[summary["topology"] == "hybrid"]["tps_vs_single_median"].isna().all()


def test_page_has_the_section_with_tables_and_plots(report):
    page = (report / "index.html").read_text()
    section = page[page.index('<section id="disagg">'):page.index('<section id="tp">')]
    assert section.count("<h3>") == 3 and section.count("data:image/png;base64,") == 3
    assert "KV handoff per request" in section and "protected and unprotected" in section
    assert "1 prefill + 2 decode" in section and "tok/s vs single node" in section
    assert "41.38 MB" in section  # the 898-token handoff's median bytes, as the handoff table prints them
    frames = pd.read_csv(report / "disagg_frames_summary.csv")
    assert frames["protected"].tolist().count(True) == 3
    metrics = pd.read_csv(report / "metrics.csv")
    assert set(metrics["bench"]) == {"disagg_handoff", "disagg_serve"}


def _serve_row(topology: str, rnd: int, order: int, agg: float, **kw) -> dict:
    return {"bench": "disagg_serve", "run": "r", "topology": topology, "server": topology, "round": rnd,
            "order": order, "concurrency": 8, "requests": 8, "errors": 0, "max_tokens": 16, "output_tokens": 128,
            "wall_s": 10.0, "ttft_p50_ms": 1000.0, "ttft_p95_ms": 2000.0, "itl_p50_ms": 100.0, "itl_p95_ms": 200.0,
            "req_tps_mean": 1.0, "agg_tps": agg, "prompt": "long", "long_tokens": 1000, "prompts_sha256": f"p{rnd}",
            "env": ENV, **kw}


def test_a_round_without_the_single_node_gives_no_ratio_and_load_shows(tmp_path):
    rows = [_serve_row("hybrid", 0, 0, 10.0, load_1m=7.5), _serve_row("1p1d", 0, 1, 8.0, load_1m=8.25),
            _serve_row("1p1d", 1, 0, 2.0, load_1m=9.0)]
    path = tmp_path / "disagg_bench.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = build_report([path], tmp_path / "r").out_dir
    row = pd.read_csv(out / "disagg_serve_summary.csv").set_index("topology").loc["1p1d"]
    assert (row["tps_vs_single_median"], row["tps_vs_single_n"]) == (pytest.approx(0.8), 1)  # round 1 unpaired
    assert (row["agg_tps_median"], row["load_1m_min"], row["load_1m_max"]) == (5.0, 8.25, 9.0)
    page = (out / "index.html").read_text()
    assert "long prompts of about 1000 tokens" in page and "0.80x" in page and "8.2 – 9.0" in page


def test_topology_labels():
    assert [topology_label(t) for t in ("hybrid", "1p1d", "2p3d", "odd")] == [
        "single node (hybrid)", "1 prefill + 1 decode", "2 prefill + 3 decode", "odd"]
