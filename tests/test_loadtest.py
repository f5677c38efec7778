"""Unit tests of the load-test harness: histogram merge across processes, the report
schema, and the open-loop scheduler."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest

from rallypoint.loadtest.hist import Recorder, merge_encoded, summarize
from rallypoint.loadtest.report import build_report, format_table, validate_report
from rallypoint.loadtest.schedule import OpenLoopSchedule


def _record_range(lo_ms: int, hi_ms: int) -> dict:
    """In a child process: record lo..hi ms (one value each) as op 'x', and 7 ms as 'y'."""
    r = Recorder()
    for v in range(lo_ms, hi_ms + 1):
        r.record("x", v / 1000)
    r.record("y", 0.007)
    return r.encode()


def test_histogram_merge_across_processes():
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        parts = pool.starmap(_record_range, [(1, 1000), (1001, 2000)])
    assert all(isinstance(v, str) for p in parts for v in p.values())
    json.dumps(parts)  # what crosses processes is plain text
    merged = merge_encoded(parts)
    x, y = merged["x"], merged["y"]
    assert x.get_total_count() == 2000
    assert y.get_total_count() == 2
    s = summarize(x)
    # 3 significant digits: within 0.1% of the exact order statistics
    assert s["p50_ms"] == pytest.approx(1000, rel=2e-3)
    assert s["p90_ms"] == pytest.approx(1800, rel=2e-3)
    assert s["p99_ms"] == pytest.approx(1980, rel=2e-3)
    assert s["p99_9_ms"] == pytest.approx(1998, rel=2e-3)
    assert s["max_ms"] == pytest.approx(2000, rel=2e-3)
    assert summarize(y)["p50_ms"] == pytest.approx(7, rel=2e-3)
    # merging is order-independent and equals recording everything in one place
    one = Recorder()
    for v in range(1, 2001):
        one.record("x", v / 1000)
    ref = summarize(merge_encoded([one.encode()])["x"])
    assert summarize(merge_encoded(reversed(parts))["x"]) == ref == s


def test_recorder_clamps_and_skips_empty():
    r = Recorder()
    r.record("tiny", 0.0)  # below 1 µs is recorded as 1 µs
    r.record("huge", 10_000.0)  # above an hour is clamped
    enc = r.encode()
    assert set(enc) == {"tiny", "huge"}
    assert merge_encoded([]) == {}


def _final(**over):
    r = Recorder()
    r.record("lifecycle", 0.002)
    r.record("submit_many", 0.001)
    base = {"hist": r.encode(), "ops": 10, "lifecycles": 5, "rounds": {"group": 2}, "errors": {},
            "error_samples": [], "lost": 0, "unfinished": 0}
    base.update(over)
    return base


CONFIG = {"scenario": "lifecycle", "mode": "closed", "rate": 0.0, "producers": 1, "workers": 1,
          "durability": "memory", "warmup_s": 2.0, "url": "tcp://127.0.0.1:1", "spawned": True}


def test_report_schema_and_table():
    rep = build_report(command="rallypoint bench", config=CONFIG, finals=[_final(), _final()], duration=2.0,
                       crashed=[])
    assert validate_report(rep) == []
    assert rep["ok"] is True
    assert rep["throughput"]["lifecycles"] == 10 and rep["throughput"]["lifecycles_per_s"] == 5.0
    assert rep["throughput"]["rounds"] == {"group": 4}
    assert rep["latency_ms"]["lifecycle"]["count"] == 2
    for k in ("cpu_count", "cpu_model", "python", "trio", "msgspec", "rallypoint"):
        assert rep["machine"][k]
    json.loads(json.dumps(rep))
    table = format_table(rep)
    assert "lifecycle" in table and "p99.9" in table and "errors: none" in table
    # a missing key is reported
    bad = dict(rep)
    del bad["latency_ms"]
    assert "missing latency_ms" in validate_report(bad)


def test_report_errors_make_it_not_ok():
    rep = build_report(command="x", config=CONFIG, finals=[_final(errors={"STALE_CLAIM": 2}), _final()],
                       duration=1.0, crashed=["worker0: boom"])
    assert rep["ok"] is False
    assert rep["errors"]["by_code"] == {"STALE_CLAIM": 2, "PROCESS_CRASHED": 1}
    assert rep["errors"]["total"] == 3
    assert "ERRORS: 3" in format_table(rep)


def test_open_loop_intended_times_are_k_over_rate():
    s = OpenLoopSchedule(rate=100, t0=10.0)
    assert s.next_time() == 10.0
    # very late: everything due is handed out at once, at its own intended time
    due = s.due(now=10.5)
    assert due == pytest.approx([10.0 + k / 100 for k in range(51)])
    # lateness does not shift the later arrivals
    assert s.next_time() == pytest.approx(10.51)
    assert s.due(now=10.505) == []
    assert s.due(now=10.53) == pytest.approx([10.51, 10.52, 10.53])
    # the limit takes only part of what is due, without skipping any
    s2 = OpenLoopSchedule(rate=1000, t0=0.0)
    a = s2.due(now=1.0, limit=300)
    b = s2.due(now=1.0)
    assert len(a) == 300 and len(b) == 701
    assert a + b == pytest.approx([k / 1000 for k in range(1001)])


def test_open_loop_producers_share_the_rate():
    n, rate = 3, 50.0
    scheds = [OpenLoopSchedule(rate, 0.0, i, n) for i in range(n)]
    got = sorted(t for s in scheds for t in s.due(now=2.0))
    assert got == pytest.approx([k / rate for k in range(101)])
    assert [s.taken for s in scheds] == [34, 34, 33]
    with pytest.raises(ValueError):
        OpenLoopSchedule(0, 0.0)
    with pytest.raises(ValueError):
        OpenLoopSchedule(1, 0.0, 3, 3)
