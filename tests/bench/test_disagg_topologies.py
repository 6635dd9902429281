"""disagg_bench's topology names: each option gives the prefill or the decode nodes one documented switch."""

from __future__ import annotations

import pytest

from bench.disagg_bench import topology_options


def test_a_plain_topology_changes_no_environment():
    assert topology_options("1p2d") == ("1p2d", {}, {})
    assert topology_options("hybrid") == ("hybrid", {}, {})


def test_options_combine_and_go_to_the_nodes_they_concern():
    assert topology_options("1p1d-copy-lanes1") == ("1p1d", {"MLXCEL_HANDOFF_LANES": "1"},
                                                    {"MLXCEL_HANDOFF_COPY": "1"})
    both = {"MLXCEL_SWITCH_INTERVAL_MS": "0.2"}
    assert topology_options("1p1d-switch0.2") == ("1p1d", both, both)
    off = {"MLXCEL_HANDOFF_STAGING": "0"}
    assert topology_options("1p1d-unstaged") == ("1p1d", off, off)
    assert topology_options("1p1d-staged")[2] == {"MLXCEL_HANDOFF_STAGING": "1"}
    every = {"MLXCEL_CRYPTO_PIPELINE_MIN_LEN": "0"}
    assert topology_options("1p1d-p0") == ("1p1d", every, every)


@pytest.mark.parametrize("name", ["1p1d-bogus", "2p1d-stable", "1p1d-lanes", "1p1d-lanesx", "1p1d-switch", "1p1d-switchfast"])
def test_an_unknown_option_stops_the_run_with_its_name(name):
    with pytest.raises(SystemExit, match="unknown topology option"):
        topology_options(name)
