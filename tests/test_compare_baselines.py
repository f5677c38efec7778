"""The interleaved-pairs report of scripts/compare_baselines.py (issue 47): its
configurations, each pair's ratio, the median ratio and its range (the runs
themselves need redis-server: not in CI)."""

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "compare_baselines.py")
_spec = importlib.util.spec_from_file_location("compare_baselines", _PATH)
cb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cb)


def _run(tput: float, p50: float, p99: float, load: float = 1.0) -> dict:
    return {"lifecycles_per_s": tput, "latency": {"p50_ms": p50, "p99_ms": p99}, "load_1m": load}


def test_configs_are_parsed_or_refused():
    assert cb.parse_configs("closed:2x2, open:5000") == [
        {"name": "closed:2x2", "mode": "closed", "producers": 2, "workers": 2},
        {"name": "open:5000", "mode": "open", "rate": 5000.0},
    ]
    with pytest.raises(ValueError):
        cb.parse_configs("burst:9")


def test_a_pair_ratio_is_above_one_when_rallypoint_is_ahead():
    closed, opened = {"mode": "closed"}, {"mode": "open"}
    assert cb.pair_ratio(closed, _run(15_000, 1, 9), _run(10_000, 1, 5)) == 1.5  # throughput
    assert cb.pair_ratio(opened, _run(5_000, 1, 4), _run(5_000, 1, 8)) == 2.0  # p99: Redis's over ours


def test_the_summary_keeps_every_pair_and_gives_the_median_and_range():
    cfg = {"name": "closed:1x1", "mode": "closed"}
    pairs = []
    for rp, rd, load in ((12_000, 10_000, 2.0), (9_000, 10_000, 3.5), (16_000, 10_000, 1.0), (15_000, 10_000, 1.2)):
        pair = {"rallypoint": _run(rp, 2, 9, load), "redis": _run(rd, 3, 7, load)}
        pair["ratio"] = cb.pair_ratio(cfg, pair["rallypoint"], pair["redis"])
        pairs.append(pair)
    sm = cb.summarize_pairs(cfg, pairs)
    assert sm["pairs"] is pairs and len(sm["pairs"]) == 4
    assert sm["median_ratio"] == 1.35 and sm["ratio_range"] == [0.9, 1.6]  # (1.2 + 1.5) / 2
    assert sm["rallypoint"]["lifecycles_per_s"] == 13_500 and sm["redis"]["p99_ms"] == 7
    assert sorted(set(sm["load_1m"])) == [1.0, 1.2, 2.0, 3.5]
