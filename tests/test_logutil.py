"""The rate-limited logger: a flood of similar events becomes ``burst`` lines and one
"N similar events suppressed in the last T s" line per window."""

from __future__ import annotations

import logging

import pytest

from rallypoint.logutil import RateLimitedLogger


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def logger(caplog):
    caplog.set_level(logging.DEBUG, logger="test.ratelimit")
    return logging.getLogger("test.ratelimit")


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "test.ratelimit"]


def test_burst_then_suppressed_then_one_summary_at_the_next_event_after_the_window(logger, caplog):
    clock = FakeClock()
    rl = RateLimitedLogger(logger, window_s=10.0, burst=3, clock=clock)
    written = [rl.log(logging.DEBUG, "reset", "peer %s reset", i) for i in range(100)]
    assert written == [True] * 3 + [False] * 97
    assert messages(caplog) == ["peer 0 reset", "peer 1 reset", "peer 2 reset"]
    clock.now += 9.9
    assert rl.log(logging.DEBUG, "reset", "peer %s reset", 100) is False  # same window
    clock.now += 0.2  # the window is over: the next event reports, then is logged itself
    assert rl.log(logging.DEBUG, "reset", "peer %s reset", 101) is True
    assert messages(caplog)[3:] == [
        "reset: 98 similar events suppressed in the last 10.1 s; the last: peer 100 reset",
        "peer 101 reset",
    ]
    assert caplog.records[3].levelno == logging.DEBUG
    assert rl.statistics() == {"emitted": 4, "suppressed": 98, "open_windows": 1}


def test_keys_are_limited_separately_and_any_event_reports_an_ended_window(logger, caplog):
    clock = FakeClock()
    rl = RateLimitedLogger(logger, window_s=5.0, burst=1, clock=clock)
    for _ in range(4):
        rl.log(logging.INFO, "a", "event a")
        rl.log(logging.WARNING, "b", "event b")
    assert messages(caplog) == ["event a", "event b"]
    clock.now += 6
    rl.log(logging.ERROR, "c", "event c")  # a third key: reports a's and b's counts
    got = messages(caplog)[2:]
    assert got[:2] == [
        "a: 3 similar events suppressed in the last 6.0 s; the last: event a",
        "b: 3 similar events suppressed in the last 6.0 s; the last: event b",
    ]
    assert got[2] == "event c"
    assert [r.levelno for r in caplog.records[2:4]] == [logging.INFO, logging.WARNING]


def test_flush_reports_pending_counts_and_a_quiet_window_reports_nothing(logger, caplog):
    clock = FakeClock()
    rl = RateLimitedLogger(logger, window_s=10.0, burst=2, clock=clock)
    rl.log(logging.INFO, "quiet", "once")
    for i in range(5):
        rl.log(logging.INFO, "busy", "busy %d", i)
    rl.flush()
    assert messages(caplog) == [
        "once", "busy 0", "busy 1",
        "busy: 3 similar events suppressed in the last 0.0 s; the last: busy 4",
    ]
    rl.flush()  # nothing pending: nothing written
    assert len(messages(caplog)) == 4


def test_disabled_level_costs_nothing_and_is_not_counted(caplog):
    lg = logging.getLogger("test.ratelimit.quiet")
    lg.setLevel(logging.INFO)
    rl = RateLimitedLogger(lg, burst=1)
    assert [rl.log(logging.DEBUG, "k", "x") for _ in range(10)] == [False] * 10
    assert rl.statistics()["suppressed"] == 0 and rl.statistics()["open_windows"] == 0


def test_traceback_only_on_written_lines(logger, caplog):
    rl = RateLimitedLogger(logger, burst=1, clock=FakeClock())
    for _ in range(3):
        try:
            raise ValueError("boom")
        except ValueError as e:
            rl.log(logging.ERROR, "crash", "crashed", exc_info=e)
    rl.flush()
    assert [bool(r.exc_info) for r in caplog.records] == [True, False]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        RateLimitedLogger(logging.getLogger("x"), window_s=0)
    with pytest.raises(ValueError):
        RateLimitedLogger(logging.getLogger("x"), burst=0)
