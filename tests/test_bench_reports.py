"""The tail goals of scripts/bench_snapshot.py (issue 47) judged from one report: the
figures themselves are the script's to measure, not a unit test's."""

import importlib.util
import os

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench_snapshot.py")
_spec = importlib.util.spec_from_file_location("bench_snapshot", _PATH)
bs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bs)


def _report(step_cpu, sleeper, empty, replay_cpu):
    return {"snapshot_steps": {"max_step_cpu_ms": step_cpu}, "snapshot_stall": {"max_ms": sleeper},
            "baseline_stall": {"max_ms": empty}, "recovery_journal": {"recover_cpu_s": replay_cpu, "recover_s": 2.0}}


def test_both_goals_met():
    g = bs.tail_goals(_report(1.5, 3.0, 2.2, 1.1), floor_cpu_s=1.0)
    assert g["stall"]["ok"] and g["recovery"]["ok"] and g["recovery"]["ratio"] == 1.1


def test_each_bound_can_miss():
    assert not bs.tail_goals(_report(2.5, 1.0, 1.0, 1.0), 1.0)["stall"]["ok"]  # a step over 2 ms CPU
    assert not bs.tail_goals(_report(1.0, 3.3, 2.2, 1.0), 1.0)["stall"]["ok"]  # sleeper > empty loop + 1 ms
    rec = bs.tail_goals(_report(1.0, 1.0, 1.0, 1.3), 1.0)["recovery"]
    assert not rec["ok"] and rec["ratio"] == 1.3
