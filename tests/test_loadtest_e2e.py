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


def test_bench_lifecycle_spawned_memory(tmp_path):
    out = tmp_path / "out.json"
    p = _run(["-m", "rallypoint", "bench", "--scenario", "lifecycle", "--spawn", "--durability", "memory",
              "--duration", "3", "--warmup", "1", "--producers", "1", "--workers", "1", "--json", str(out)], 90)
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads(out.read_text())
    assert validate_report(rep) == []
    assert rep["errors"]["total"] == 0, rep["errors"]
    assert rep["throughput"]["lifecycles"] > 0
    assert rep["latency_ms"]["lifecycle"]["count"] > 0
    assert rep["config"]["durability"] == "memory"
    assert "bench --scenario lifecycle" in rep["command"]
    assert "lifecycles/s" in p.stdout and "p99.9" in p.stdout


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
