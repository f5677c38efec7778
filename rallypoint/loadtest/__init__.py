"""The load-test harness behind ``rallypoint bench`` (SPEC §12).

Producers and workers are separate OS processes (multiprocessing, spawn) that talk to a
daemon over TCP; each records latencies into its own HdrHistogram per operation kind,
encodes it, and the parent decodes and merges them into one report.

Modules: :mod:`.hist` (recording and merging), :mod:`.schedule` (open-loop arrival
times), :mod:`.scenarios` (what producers and workers do), :mod:`.runner` (processes,
progress display, the daemon with ``--spawn``), :mod:`.report` (JSON report and table).
"""

from .hist import Recorder, merge_encoded, summarize
from .schedule import OpenLoopSchedule

__all__ = ["Recorder", "merge_encoded", "summarize", "OpenLoopSchedule"]
