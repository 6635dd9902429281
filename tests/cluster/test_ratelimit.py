"""Rate-limited warning classes with an injected clock."""

from __future__ import annotations

import logging

import pytest

from mlxcel.cluster.ratelimit import RateLimitedLog, WarnClass


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def limiter() -> tuple[RateLimitedLog, Clock]:
    clock = Clock()
    return RateLimitedLog(logging.getLogger("mlxcel.cluster.test"), clock=clock), clock


def _levels(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records]


def test_five_warnings_per_minute_then_debug(limiter, caplog):
    log, clock = limiter
    with caplog.at_level(logging.DEBUG, "mlxcel.cluster.test"):
        results = [log.warning(WarnClass.NOISE, "junk %d", i) for i in range(8)]
    assert results == [True] * 5 + [False] * 3
    assert [lvl for lvl, _ in _levels(caplog)] == [logging.WARNING] * 5 + [logging.DEBUG] * 3


def test_classes_have_separate_budgets(limiter, caplog):
    log, clock = limiter
    with caplog.at_level(logging.DEBUG, "mlxcel.cluster.test"):
        for i in range(20):
            log.warning(WarnClass.NOISE, "junk")
        assert log.warning(WarnClass.DIAGNOSTIC, "probable secret mismatch")
        assert log.warning(WarnClass.ROUTER_DROP, "router: dropping result frame from x")
        assert log.warning(WarnClass.AT_CAPACITY, "retrying")


def test_summary_on_the_next_event_after_a_suppressing_window(limiter, caplog):
    log, clock = limiter
    with caplog.at_level(logging.DEBUG, "mlxcel.cluster.test"):
        for i in range(9):
            log.warning(WarnClass.DIAGNOSTIC, "refusal %d", i)
        clock.t += 135.4  # quiet period: the window ended 75 s before the next event
        caplog.clear()
        assert log.warning(WarnClass.DIAGNOSTIC, "next refusal")
    assert _levels(caplog) == [
        (logging.WARNING, "4 cluster warnings (diagnostic) were logged at debug during the 60s window that ended 75s ago"),
        (logging.WARNING, "next refusal"),
    ]


def test_no_summary_when_nothing_was_suppressed(limiter, caplog):
    log, clock = limiter
    with caplog.at_level(logging.DEBUG, "mlxcel.cluster.test"):
        for _ in range(5):
            log.warning(WarnClass.NOISE, "x")
        clock.t += 61
        caplog.clear()
        log.warning(WarnClass.NOISE, "y")
    assert _levels(caplog) == [(logging.WARNING, "y")]


def test_window_resets_budget(limiter, caplog):
    log, clock = limiter
    for _ in range(7):
        log.warning(WarnClass.AT_CAPACITY, "x")
    clock.t += 59.9
    assert not log.warning(WarnClass.AT_CAPACITY, "still suppressed")
    clock.t += 0.2
    assert log.warning(WarnClass.AT_CAPACITY, "new window")


def test_class_names():
    assert [c.value for c in WarnClass] == ["noise", "diagnostic", "router-drop", "at-capacity"]
