"""Latency recording with HdrHistogram, one histogram per operation kind.

Values are recorded in microseconds (1 µs .. 1 h, 3 significant digits). A process
records into its own :class:`Recorder`, ships ``encode()`` (a dict of base64 strings,
picklable and JSON-able) to the parent, which merges them with :func:`merge_encoded`.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from hdrh.histogram import HdrHistogram

LOWEST_US = 1
HIGHEST_US = 3_600_000_000  # one hour
SIG_FIGS = 3

PERCENTILES = (50.0, 90.0, 99.0, 99.9)


def new_histogram() -> HdrHistogram:
    return HdrHistogram(LOWEST_US, HIGHEST_US, SIG_FIGS)


class Recorder:
    """Per-process latency histograms keyed by operation kind."""

    def __init__(self) -> None:
        self.hists: dict[str, HdrHistogram] = {}

    def record(self, op: str, seconds: float) -> None:
        h = self.hists.get(op)
        if h is None:
            h = self.hists[op] = new_histogram()
        us = int(seconds * 1e6)
        h.record_value(min(max(us, LOWEST_US), HIGHEST_US))

    def encode(self) -> dict[str, str]:
        """``{op: base64 HdrHistogram}``; empty histograms are left out."""
        out = {}
        for op, h in self.hists.items():
            if h.get_total_count():
                enc = h.encode()
                out[op] = enc.decode("ascii") if isinstance(enc, bytes) else enc
        return out


def merge_encoded(parts: Iterable[Mapping[str, str]]) -> dict[str, HdrHistogram]:
    """Decode the ``Recorder.encode()`` results of several processes and add them up."""
    merged: dict[str, HdrHistogram] = {}
    for part in parts:
        for op, enc in part.items():
            h = merged.get(op)
            if h is None:
                h = merged[op] = new_histogram()
            h.decode_and_add(enc)
    return merged


def summarize(h: HdrHistogram) -> dict[str, float]:
    """count, mean and p50/p90/p99/p99.9/max in milliseconds."""
    ms = 1000.0
    out: dict[str, float] = {"count": h.get_total_count(), "mean_ms": round(h.get_mean_value() / ms, 3)}
    for p in PERCENTILES:
        key = "p" + (f"{p:g}".replace(".", "_"))
        out[key + "_ms"] = round(h.get_value_at_percentile(p) / ms, 3)
    out["max_ms"] = round(h.get_max_value() / ms, 3)
    return out
