"""bench/scaling_fit.py: the least-squares fits with their spread, the rows-to-costs step and the 16/64-host
prediction; bench/scaling_bench.py's parsing of the coordinator's push line. Pure: no processes."""

from __future__ import annotations

import json
import random

import pytest

from bench import scaling_bench as sb
from bench import scaling_fit as sf


def test_a_noiseless_line_is_recovered_exactly_with_zero_spread():
    f = sf.fit([2, 3, 4, 6, 8], [10 + 1.5 * s for s in (2, 3, 4, 6, 8)])
    assert f.intercept == pytest.approx(10) and f.slope == pytest.approx(1.5)
    assert f.slope_se == pytest.approx(0, abs=1e-9) and f.r2 == pytest.approx(1) and f.n == 5


def test_the_slope_spread_matches_the_textbook_formula():
    rng = random.Random(7)
    xs = [2, 3, 4, 6, 8] * 4
    ys = [5 + 0.8 * x + rng.gauss(0, 0.3) for x in xs]
    f = sf.fit(xs, ys)
    mean = sum(xs) / len(xs)
    resid = [y - (f.intercept + f.slope * x) for x, y in zip(xs, ys)]
    sigma2 = sum(r * r for r in resid) / (len(xs) - 2)
    assert f.slope_se == pytest.approx((sigma2 / sum((x - mean) ** 2 for x in xs)) ** 0.5)
    assert abs(f.slope - 0.8) < 3 * f.slope_se  # the true slope is inside the spread


def test_a_quadratic_fit_and_its_value():
    f = sf.fit([2, 4, 8, 16], [100 + 3 * n + 2 * n * n for n in (2, 4, 8, 16)], degree=2)
    assert f.coef == pytest.approx((100, 3, 2)) and f.at(64) == pytest.approx(100 + 192 + 8192)


def test_no_degrees_of_freedom_leave_the_spread_unknown():
    assert sf.fit([2, 3], [1, 2]).se == (None, None)


def test_too_few_distinct_sizes_are_refused():
    with pytest.raises(ValueError, match="at least 2 distinct x values, got 1"):
        sf.fit([4, 4, 4], [1, 2, 3])
    with pytest.raises(ValueError, match="as many ys as xs"):
        sf.fit([1, 2], [1])


def _costs(**kw) -> sf.Costs:
    base = dict(single_ms=7.2, hop_ms=0.5, hop_bytes=sf.activation_bytes(3584), bringup_s0=10, bringup_s_per_peer=0.2,
                bringup_bytes=sf.fit([2, 4, 8], [1000 * n + 50 * n * n for n in (2, 4, 8)], 2), push_s0=0.05,
                push_s_per_peer=0.02, router_cpu_s_per_request=0.01, router_cpu_s_per_node_s=0.001,
                router_added_ms_p95=20)
    return sf.Costs(**{**base, **kw})


def test_a_hop_on_10gbe_costs_the_loopback_hop_plus_wire_time():
    p = sf.predict_hosts(_costs(), 16)
    wire = 0.05 + (3584 * 2 + 64) * 8 / 10e9 * 1e3
    assert p["hop_ms"] == pytest.approx(0.5 - 0.01 + wire)
    assert p["ms_per_token_1"] == pytest.approx(7.2 + 16 * p["hop_ms"])
    assert p["tok_s_8"] == pytest.approx(8 * p["tok_s_1"])  # 8 streams fill 8 of the 16 stages
    assert sf.predict_hosts(_costs(), 64)["ms_per_token_1"] > p["ms_per_token_1"]
    assert p["bringup_bytes"] == pytest.approx(1000 * 16 + 50 * 256)


def test_the_first_limit_is_the_cost_that_runs_out_first():
    assert sf.predict_hosts(_costs(router_cpu_s_per_request=0.5), 64)["first_limit"] == "router CPU"
    assert sf.predict_hosts(_costs(push_s_per_peer=2.0), 64)["first_limit"] == "bring-up fan-out"
    coord = sf.predict_hosts(_costs(coord_cpu_s_per_token_per_stage=0.01), 64)
    assert coord["first_limit"] == "coordinator CPU" and coord["coordinator_cores"] > 1
    assert sf.predict_hosts(_costs(), 16)["limit_ratios"]["bring-up fan-out"] == pytest.approx((0.05 + 0.02 * 16) / 50)


def _rows() -> list[dict]:
    rows = [{"bench": "scaling_pipeline", "stages": s, "streams": 1, "ms_per_token": 20 + 2 * s} for s in (2, 4, 8)]
    rows.append({"bench": "scaling_pipeline", "stages": 1, "streams": 1, "ms_per_token": 21.0})
    rows += [{"bench": "scaling_pipeline", "stages": s, "streams": 8, "ms_per_token": 99.0, "tokens": 100,
              "cpu_s_coordinator": 0.5 + 0.1 * s} for s in (2, 4, 8)]  # not 1-stream rows
    rows += [{"bench": "scaling_bringup", "peers": n, "ready_s": 5 + 0.5 * n, "push_s": 0.1 * n,
              "wire_bytes": 1400 * n + 20 * n * n} for n in (2, 4, 8)]
    rows += [{"bench": "scaling_router", "nodes": n, "router_cpu_s_per_request": 0.01 + 0.001 * n,
              "router_idle_cpu_s_per_s": 0.002 * n, "added_ms_p95": 30.0} for n in (2, 5, 8)]
    return rows


def test_costs_come_from_the_fits_and_the_single_node_row(tmp_path):
    fits = sf.fits_of(_rows())
    assert fits["pipeline_ms_per_token"].slope == pytest.approx(2)  # the 8-stream row and S=1 stay out
    assert fits["bringup_wire_bytes"].coef == pytest.approx((0, 1400, 20), abs=1e-6)
    costs = sf.costs_of(_rows(), fits, 100)
    assert costs.single_ms == 21 and costs.hop_ms == pytest.approx(2)
    assert (costs.coord_cpu_s_per_token0, costs.coord_cpu_s_per_token_per_stage) == pytest.approx((0.005, 0.001))
    assert costs.router_cpu_s_per_request == pytest.approx(0.018) and costs.router_cpu_s_per_node_s == pytest.approx(0.002)
    path = tmp_path / "scaling_bench.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    out = sf.fit_file(path)
    assert [p["hosts"] for p in out["predictions"]] == [16, 64]
    assert json.loads((tmp_path / "scaling_fit.json").read_text())["fits"]["pipeline_ms_per_token"]["c1"] == pytest.approx(2)


def test_without_every_mode_there_is_no_prediction(tmp_path):
    path = tmp_path / "scaling_bench.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows() if r["bench"] != "scaling_router"))
    out = sf.fit_file(path)
    assert out["predictions"] is None and "router" in out["missing"] and "pipeline_ms_per_token" in out["fits"]


def test_the_push_line_is_parsed_as_the_coordinator_prints_it():
    line = ("mlxcel: pp-auto: push over 4 peers took 0.213s; assignment channel: sent 16 frames 5012 bytes, "
            "received 12 frames 1290 bytes\n")
    assert sb.parse_push_line("noise\n" + line) == {"peers": 4, "push_s": 0.213, "sent_frames": 16, "sent_bytes": 5012,
                                                   "received_frames": 12, "received_bytes": 1290}
    assert sb.parse_push_line("mlxcel: pp-auto: assigning 4 stages") is None


@pytest.mark.parametrize("argv, message", [
    (["router", "--topologies", "5x1"], "1..4 prefill and 1..4 decode"),
    (["pipeline", "--stages", "2,0"], "positive integers"),
    (["pipeline", "--stages", "2,17"], "at most 16"),
    (["fit"], "fit needs the rows file"),
])
def test_bad_arguments_are_refused_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        sb.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_overrides_replace_measured_costs_and_gzipped_rows_are_read(tmp_path):
    import gzip

    path = tmp_path / "scaling_bench.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in _rows()).encode()))
    measured = sf.fit_file(path)["predictions"][0]
    gpu = sf.fit_file(path, single_ms=7.2, hop_ms=6.3)
    assert gpu["overrides"] == {"single_ms": 7.2, "hop_ms": 6.3} and gpu["costs"]["hop_ms"] == 6.3
    assert gpu["predictions"][0]["ms_per_token_1"] == pytest.approx(7.2 + 16 * gpu["predictions"][0]["hop_ms"])
    assert gpu["predictions"][0]["ms_per_token_1"] != measured["ms_per_token_1"]
