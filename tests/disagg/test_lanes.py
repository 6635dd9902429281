"""The prefill node's lane choice (mlxcel/disagg/lanes.py): the least busy lane, held while a handoff is in flight."""

from __future__ import annotations

import threading

import pytest

from mlxcel.disagg.lanes import LanePicker, default_lanes

LANES_ENV = "MLXCEL_HANDOFF_LANES"


def test_concurrent_handoffs_take_the_least_busy_lanes_and_give_them_back():
    picker = LanePicker(3)
    with picker.take() as a, picker.take() as b, picker.take() as c, picker.take() as d:
        assert (a, b, c, d) == (0, 1, 2, 0)
        assert picker.busy() == (2, 1, 1)
    assert picker.busy() == (0, 0, 0) and picker.taken() == (2, 1, 1)
    with picker.take() as lane:  # every lane idle again: the lowest
        assert lane == 0


def test_a_failed_handoff_releases_its_lane():
    picker = LanePicker(2)
    with pytest.raises(RuntimeError):
        with picker.take():
            raise RuntimeError("the stream broke")
    assert picker.busy() == (0, 0)


def test_threads_never_share_a_lane_while_one_is_free():
    picker, inside, seen, gate = LanePicker(4), threading.Barrier(4), [], threading.Event()

    def hand_off() -> None:
        with picker.take() as lane:
            seen.append(lane)
            inside.wait(10)
            gate.wait(10)

    threads = [threading.Thread(target=hand_off) for _ in range(4)]
    for t in threads:
        t.start()
    inside_ok = [picker.busy()]
    gate.set()
    for t in threads:
        t.join(10)
    assert sorted(seen) == [0, 1, 2, 3] and picker.busy() == (0, 0, 0, 0), inside_ok


def test_one_lane_is_the_whole_story_below_four_cores(monkeypatch):
    monkeypatch.delenv(LANES_ENV, raising=False)
    assert [default_lanes(n) for n in (1, 2, 3, 4, 8, 16, 64)] == [1, 1, 1, 1, 2, 4, 4]


@pytest.mark.parametrize("value, lanes", [("2", 2), (" 16 ", 16)])
def test_the_environment_sets_the_lanes(monkeypatch, value, lanes):
    monkeypatch.setenv(LANES_ENV, value)
    assert default_lanes(2) == lanes


@pytest.mark.parametrize("value, why", [("0", "from 1 to 16"), ("17", "from 1 to 16"), ("two", "whole number")])
def test_a_bad_lane_count_is_refused_with_its_name(monkeypatch, value, why):
    monkeypatch.setenv(LANES_ENV, value)
    with pytest.raises(ValueError, match=f"{LANES_ENV}.*{why}"):
        default_lanes()


def test_a_picker_needs_a_lane():
    with pytest.raises(ValueError, match="at least one lane"):
        LanePicker(0)
