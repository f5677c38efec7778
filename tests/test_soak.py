"""The retention soak (issue 16, item 3): under a steady lifecycle load with
``--retain-finished``, the entity count and the daemon's RSS stay flat. CI runs the
short form (about 50 s: 8 s leases, 5 s retention); ``RALLYPOINT_SLOW=1`` runs the issue's: 10 minutes with
``--retain-finished 30s``, compared with minute 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import SLOW

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The short form's bound is 30 %, not the issue's 10 % (which the long form keeps): in 50 s
#: beside three other test processes the entity count swings with each purge sweep and with
#: the backlog a starved worker leaves (-13.9 % and +11.2 % in two CI runs of the same code).
#: It still catches a leak: with nothing purged the count grows by 800 a second, from ~4,000
#: to ~20,000 over the run (+400 %).
SHORT = ["--minutes", "0.85", "--retain", "5s", "--rate", "800", "--retain-events", "20000",
         "--snapshot-every-s", "2", "--lease-seconds", "8", "--reference-s", "28", "--window-s", "8", "--every", "1",
         "--tolerance", "0.30"]
LONG = ["--minutes", "10", "--retain", "30s"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_entities_and_rss_stay_flat_under_load_with_retention(tmp_path):
    args = LONG if SLOW else SHORT
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "soak_retention.py"), *args,
                          "--json", str(tmp_path / "soak.json")], capture_output=True, text=True, timeout=880,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "OK: flat" in out.stdout
    import json

    report = json.load(open(tmp_path / "soak.json"))
    assert report["samples"][-1]["purged"] > 10_000  # retention did the work


def _judge():
    import importlib.util

    spec = importlib.util.spec_from_file_location("soak_retention", os.path.join(ROOT, "scripts", "soak_retention.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.judge


def _samples(entities_at, rss_at):
    return [{"t": float(t), "entities": entities_at(t), "rss": rss_at(t), "rss_anon": 1, "rss_file": 1,
             "snapshot_bytes": 1} for t in range(1, 55)]


@pytest.mark.quick
def test_the_soak_verdict_fails_on_growth_and_passes_a_fall():
    judge = _judge()
    flat = lambda t: 4000  # noqa: E731
    # Entities grow 20 % after the reference: a leak.
    _, ok, lines = judge(_samples(lambda t: 4000 if t < 40 else 4800, flat), 28, 8, 0.10)
    assert not ok and "GREW MORE THAN 10%" in lines[0]
    # RSS grows 15 %: a leak too.
    _, ok, _ = judge(_samples(flat, lambda t: 100 if t < 40 else 115), 28, 8, 0.10)
    assert not ok
    # Entities fall 14 % after a purge sweep (the CI run that failed on this): not a leak.
    verdict, ok, lines = judge(_samples(lambda t: 4736 if t < 35 else 4078, flat), 28, 8, 0.10)
    assert ok and "fell" in lines[0]
    assert verdict["entities"]["change"] < -0.10
    # Within the tolerance either way.
    _, ok, _ = judge(_samples(lambda t: 4000 + (t % 3) * 50, flat), 28, 8, 0.10)
    assert ok
