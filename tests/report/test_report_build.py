"""mlxcel report on the committed fixtures: numbers in the CSVs, sections and charts in the HTML."""

from __future__ import annotations

import base64
import json
import shutil
import statistics
import struct
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest

from tests.report.conftest import FIXTURES


def _jsonl(name: str, where: str = "results") -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / where / name).read_text().splitlines() if line.strip()]


def test_decode_numbers_match_the_rows(fixture_report: Path):
    rows = [r for r in _jsonl("decode_bench.jsonl") if r["impl"] != "summary"]
    cmp = pd.read_csv(fixture_report / "decode_comparison.csv")
    assert len(cmp) == 1
    ours = [r["decode_tps"] for r in rows if r["impl"] == "mlxcel"]
    theirs = [r["decode_tps"] for r in rows if r["impl"] == "mlx-lm"]
    row = cmp.iloc[0]
    assert row["mlxcel_decode_tps_median"] == pytest.approx(statistics.median(ours))
    assert row["mlxcel_decode_tps_min"] == pytest.approx(min(ours))
    assert row["mlx_lm_decode_tps_max"] == pytest.approx(max(theirs))
    assert row["decode_ratio"] == pytest.approx(statistics.median(ours) / statistics.median(theirs))
    recorded = next(r for r in _jsonl("decode_bench.jsonl") if r["impl"] == "summary")
    assert row["decode_ratio"] == pytest.approx(recorded["decode_ratio"])  # the benchmark's own summary agrees


def test_frame_rows_overhead_and_csv_twin(fixture_report: Path):
    rows = _jsonl("frame_bench.jsonl")
    frame = pd.read_csv(fixture_report / "frame_summary.csv")
    assert len(frame) == len(rows) == 20  # frame_bench.csv repeats the JSONL rows: folded, not doubled
    p50 = {(r["suite"], r["payload_bytes"]): r["p50_us"] for r in rows}
    aes = frame[(frame["suite"] == "aes_256_gcm") & (frame["payload_bytes"] == 2**20)].iloc[0]
    assert aes["p50_us"] == pytest.approx(p50[("aes_256_gcm", 2**20)])
    assert aes["overhead_vs_unprotected"] == pytest.approx(p50[("aes_256_gcm", 2**20)] / p50[("unprotected", 2**20)])
    assert aes["reference_p50_us"] == pytest.approx(422.0)
    raw = pd.read_csv(fixture_report / "rows_frame.csv")
    assert set(raw["source_file"].map(lambda p: Path(p).name)) == {"frame_bench.jsonl"}
    assert raw["env_git_commit"].str.fullmatch(r"[0-9a-f]{40}").all()


def test_pipeline_summary_per_topology(fixture_report: Path):
    rows = _jsonl("pipeline_bench.jsonl")
    summary = pd.read_csv(fixture_report / "pipeline_summary.csv")
    assert len(summary) == 6  # 3 topologies x 2 stream counts
    for (mode, streams), g in summary.groupby(["mode", "streams"]):
        vals = [r["tok_s"] for r in rows if r["mode"] == mode and r["streams"] == streams]
        row = g.iloc[0]
        assert (row["tok_s_median"], row["tok_s_min"], row["tok_s_max"], row["tok_s_n"]) == \
            (pytest.approx(statistics.median(vals)), min(vals), max(vals), len(vals))
    remote = summary[summary["mode"] == "remote_pp"]
    assert (remote["bytes_per_token_median"] == 2688).all() and (remote["frames_per_token_median"] == 3).all()
    assert summary["all_identical"].all()


def test_serve_summary_over_rounds(fixture_report: Path):
    rows = _jsonl("serve_bench.jsonl")
    summary = pd.read_csv(fixture_report / "serve_summary.csv")
    servers = {r["server"] for r in rows}
    levels = {r["concurrency"] for r in rows}
    assert len(summary) == len(servers) * len(levels)
    for _, s in summary.iterrows():
        vals = [r["ttft_p50_ms"] for r in rows if r["server"] == s["server"] and r["concurrency"] == s["concurrency"]]
        assert s["ttft_p50_ms_median"] == pytest.approx(statistics.median(vals))
        assert s["rounds"] == len(vals) == 2
        assert s["went_first"] == 1  # ABBA: each server first once per level
        assert s["same_prompts"] == "yes"


def test_environment_per_host(fixture_report: Path):
    env = pd.read_csv(fixture_report / "environment.csv")
    assert env["rows"].sum() == sum(len(_jsonl(f)) for f in ("decode_bench.jsonl", "frame_bench.jsonl",
                                                              "pipeline_bench.jsonl", "serve_bench.jsonl"))
    assert env["rows_without_commit"].sum() == 0
    assert (env["cpu"].str.len() > 0).all()


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.imgs: list[dict] = []
        self.ids: set[str] = set()
        self.tags: set[str] = set()
        self.refs: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.add(tag)
        if tag == "img":
            self.imgs.append(a)
        if "id" in a:
            self.ids.add(a["id"])
        self.refs += [a[k] for k in ("src", "href") if k in a]

    def handle_data(self, data):
        self.text.append(data)


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_html_is_self_contained_with_every_section(fixture_report: Path):
    page = _Page()
    page.feed((fixture_report / "index.html").read_text())
    assert {"inputs", "environment", "decode", "frame", "pipeline", "serving", "reference", "baseline"} <= page.ids
    # decode, frame (one session), pipeline, serving, and the reference's pipeline and frame charts
    assert len(page.imgs) == 6
    for img in page.imgs:
        assert img["src"].startswith("data:image/png;base64,") and img.get("alt")
        w, h = _png_size(base64.b64decode(img["src"].split(",", 1)[1]))
        assert w > 400 and h > 150
    assert not [r for r in page.refs if not (r.startswith("#") or r.startswith("data:"))]  # nothing to fetch
    assert not {"script", "link", "iframe"} & page.tags
    text = " ".join(" ".join(page.text).split())
    for needle in ("133.2", "138.8", "other hardware", "14.03", "278.8 us", "12.9", "regression"):
        assert needle in text, needle


def test_baseline_flags_the_regression_only(fixture_report: Path):
    cmp = pd.read_csv(fixture_report / "baseline_comparison.csv")
    bad = cmp[cmp["status"] == "regression"]
    assert list(bad["bench"]) == ["pipeline"]
    assert "mode=remote_pp" in bad.iloc[0]["key"] and "streams=1" in bad.iloc[0]["key"]
    assert bad.iloc[0]["basis"] == "ranges"
    decode = cmp[cmp["bench"] == "decode"]
    assert set(decode["status"]) == {"within spread"}  # same rows: no change
    assert "regression" in (fixture_report / "index.html").read_text()
    assert json.loads((fixture_report / "report.json").read_text())["regressions"] == 1


def test_baseline_may_be_a_previous_report(fixture_report: Path, fixture_results: Path):
    from mlxcel.report.baseline import compare
    from mlxcel.report.build import _baseline_metrics, summarize
    from mlxcel.report.load import load
    from mlxcel.report.tables import metrics

    current = metrics(summarize(load([fixture_results])))
    cmp = compare(current, _baseline_metrics(fixture_report))  # reads the report's metrics.csv
    assert len(cmp) == len(current) > 0 and set(cmp["status"]) == {"within spread"}


def test_a_report_inside_its_inputs_is_not_read_back(fixture_report: Path, fixture_results: Path, tmp_path: Path):
    from mlxcel.report.load import load

    inputs = tmp_path / "results"
    shutil.copytree(fixture_results, inputs)
    shutil.copytree(fixture_report, inputs / "reports" / "demo")  # its CSVs would double every row
    assert {k: len(v) for k, v in load([inputs]).tables.items()} == \
        {k: len(v) for k, v in load([fixture_results]).tables.items()}


def test_recorded_results_in_the_repository_all_validate():
    from mlxcel.report.load import load

    loaded = load([Path(__file__).resolve().parents[2] / "bench" / "results"])
    assert loaded.problems == []
    assert {"decode", "frame", "serve"} <= set(loaded.tables)
