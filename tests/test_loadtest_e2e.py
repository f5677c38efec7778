"""End to end: ``rallypoint bench`` and the examples, each against a daemon they spawn."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rallypoint.loadtest.report import validate_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    # this checkout's package, whatever is installed (an example's own directory is its sys.path[0])
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("settle", ["next", "separate"])
def test_bench_lifecycle_spawned_memory(tmp_path, settle):
    out = tmp_path / "out.json"
    p = _run(["-m", "rallypoint", "bench", "--scenario", "lifecycle", "--spawn", "--durability", "memory",
              "--duration", "3", "--warmup", "1", "--producers", "1", "--workers", "1", "--settle", settle,
              "--json", str(out)], 90)
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads(out.read_text())
    assert validate_report(rep) == []
    assert rep["errors"]["total"] == 0, rep["errors"]
    assert rep["throughput"]["lifecycles"] > 0
    assert rep["latency_ms"]["lifecycle"]["count"] > 0
    assert rep["config"]["durability"] == "memory"
    assert "bench --scenario lifecycle" in rep["command"]
    assert "lifecycles/s" in p.stdout and "p99.9" in p.stdout
    # issue 47: the worker completes a batch and receives the next in one round trip
    # (delivery.complete_next), or, with --settle separate, in two requests
    ops = set(rep["latency_ms"])
    if settle == "next":
        assert "complete_next" in ops and "complete_many" not in ops
    else:
        assert {"complete_many", "receive"} <= ops and "complete_next" not in ops
    assert rep["config"]["settle"] == settle


def test_bench_spawns_its_daemon_with_the_sync_helper_asked_for(tmp_path):
    """``--sync-helper inline`` reaches the spawned daemon (what compare_baselines.py
    --sync-helper uses); its fsync-durable lifecycles complete."""
    out = tmp_path / "out.json"
    p = _run(["-m", "rallypoint", "bench", "--scenario", "lifecycle", "--durability", "fsync", "--sync-helper",
              "inline", "--duration", "2", "--warmup", "0.5", "--producers", "1", "--workers", "1", "--json",
              str(out)], 90)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "(durability fsync, --sync-helper inline," in p.stderr, p.stderr
    rep = json.loads(out.read_text())
    assert rep["errors"]["total"] == 0 and rep["throughput"]["lifecycles"] > 0
    assert rep["config"]["sync_helper"] == "inline"  # (from the daemon's own status)
    p = _run(["-m", "rallypoint", "bench", "--durability", "memory", "--sync-helper", "inline"], 60)
    assert p.returncode == 2 and "no fdatasync to place" in p.stderr, p.stderr


@pytest.mark.parametrize(
    "script, expect",
    [
        ("review_drafts.py", ["decision after", "SUCCESS (threshold_reached)", "cancelled:"]),
        ("crawl_joinset.py", ["first to finish:", "join set CLOSED"]),
        ("first_proof.py", ["SUCCESS (first_accepted)", "winner: range"]),
        ("wordcount.py", ["map: SUCCESS (all_terminal)", "barrier released", "top words"]),
        ("research_swarm.py", ["pages done:", "over budget:", "browser sessions: at most", "search calls:", "spend:"]),
    ],
)
def test_example_runs(script, expect):
    p = _run([os.path.join("examples", script), "--spawn", "--quick"], 120)
    assert p.returncode == 0, p.stdout + p.stderr
    for s in expect:
        assert s in p.stdout, p.stdout


def test_bench_never_writes_into_a_daemon_it_was_not_pointed_at(tmp_path):
    # Issue 31 item 13: `rallypoint bench` without --connect spawns a throwaway daemon,
    # even with $RALLYPOINT_URL naming a running one (which gets nothing); with
    # --connect it says first, on stderr, what it is about to write there.
    import rallypoint.sync
    from conftest import Daemon

    d = Daemon(None, "memory").start()
    try:
        short = ["--duration", "1", "--warmup", "0", "--producers", "1", "--workers", "1"]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), RALLYPOINT_URL=d.url)
        p = subprocess.run([sys.executable, "-m", "rallypoint", "bench", "--durability", "memory", *short], cwd=ROOT,
                           capture_output=True, text=True, timeout=120, env=env)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "spawned daemon" in p.stderr and d.url not in p.stderr, p.stderr
        with rallypoint.sync.connect(d.url) as rs:
            assert "rallypoint-bench" not in {m.name for m in rs.mailboxes.list()}
        p = _run(["-m", "rallypoint", "bench", "--connect", d.url, *short], 120)
        assert p.returncode == 0, p.stdout + p.stderr
        first = p.stderr.splitlines()[0]
        assert f"load-testing the daemon at {d.url}" in first and "rallypoint-bench" in first, p.stderr
    finally:
        assert d.stop() == 0


def test_bench_runs_spreads_the_load_over_that_many_root_runs(tmp_path):
    # --runs N: N unnamed root runs (a sharded cluster's router gives its shards in
    # turn; scripts/bench_shards.py), producer and worker i on run i mod N; the report
    # counts every lifecycle finished (lifecycles_all: what a daemon's whole CPU served)
    import rallypoint.sync
    from conftest import Daemon

    d = Daemon(None, "memory").start()
    try:
        out = tmp_path / "out.json"
        p = _run(["-m", "rallypoint", "bench", "--connect", d.url, "--runs", "2", "--duration", "1", "--warmup", "0",
                  "--producers", "2", "--workers", "2", "--json", str(out)], 120)
        assert p.returncode == 0, p.stdout + p.stderr
        rep = json.loads(out.read_text())
        assert rep["config"]["runs"] == 2
        assert rep["throughput"]["lifecycles_all"] >= rep["throughput"]["lifecycles"] > 0
        with rallypoint.sync.connect(d.url) as rs:
            roots = [s for s in rs.scopes.list() if s.parent_id is None]
            assert len(roots) == 2 and all(s.name is None for s in roots)
            for s in roots:  # both took tasks, and both were cancelled at the end
                st = rs.scope(s.id).status()
                assert sum(st.tasks.values()) > 0 and st.state == "CANCELLED", st
    finally:
        assert d.stop() == 0
