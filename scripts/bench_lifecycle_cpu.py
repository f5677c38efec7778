"""Daemon CPU per task lifecycle, for comparing source trees side by side.

Starts ``rallypoint serve`` from each tree given (its own code, ``PYTHONPATH=TREE``),
runs that tree's ``rallypoint bench --scenario lifecycle --connect ...`` against it and
reads the daemon's utime+stime (``/proc/PID/stat``) before and after. Prints, per tree
and round, the lifecycles/s the harness reported and the daemon's CPU microseconds per
measured lifecycle (the warm-up's CPU is included: an upper bound). Asserts nothing.

    python scripts/bench_lifecycle_cpu.py . /path/to/older/tree --rounds 2
    python scripts/bench_lifecycle_cpu.py . --durability memory --duration 5
    python scripts/bench_lifecycle_cpu.py . --batch 64 --pipeline 2 --worker-concurrency 2 \
        --max-messages 32 --commit-wait     # the compare_baselines shape; + durability waits

A tree may carry daemon options after a ``+`` (the same tree with another setting is a
side of its own): ``. ".+--sync-helper thread"`` compares the sync helper process with
the thread on this tree.

``--commit-wait`` starts each daemon with ``--metrics`` and prints, from its
``/metrics`` after the run, the mean time a record waited from its append until the
event loop learned it was durable (``journal_commit_wait_seconds``: what every reply
that depends on it waited) next to the mean fdatasync (``journal_fsync_duration_seconds``).
(The metrics cost a little daemon CPU: compare trees with the same setting.)

Trees alternate within each round so that a machine's changing load spreads over all.
Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rallypoint.loadtest.runner import SpawnedDaemon  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(tree: str, a: argparse.Namespace) -> tuple[str, int, float, dict | None]:
    """One run against ``tree``: (lifecycles/s as printed, measured lifecycles, daemon CPU
    s, the journal's means with ``--commit-wait`` else None)."""
    tree, _, opts = tree.partition("+")
    tree = os.path.abspath(tree)
    env = dict(os.environ, PYTHONPATH=tree)
    mport = _free_port() if a.commit_wait else None
    daemon = SpawnedDaemon(a.durability, (["--metrics", f"127.0.0.1:{mport}"] if mport else []) + opts.split(),
                           tree=tree)
    try:
        url = daemon.start()
        c0 = _cpu_s(daemon.pid)
        out = subprocess.run(
            [sys.executable, "-m", "rallypoint", "bench", "--scenario", "lifecycle", "--connect", url,
             "--duration", str(a.duration), "--warmup", "1",
             "--producers", str(a.producers), "--workers", str(a.workers), "--batch", str(a.batch),
             "--pipeline", str(a.pipeline), "--worker-concurrency", str(a.worker_concurrency),
             "--max-messages", str(a.max_messages)]
            + (["--rate", str(a.rate), "--coalesce-ms", str(a.coalesce_ms)] if a.rate else []),
            env=env, cwd=tree, capture_output=True, text=True).stdout
        c1 = _cpu_s(daemon.pid)
        waits = _journal_means(mport) if mport is not None else None
    finally:
        daemon.stop()
    rate = re.search(r"throughput: [\d,]+ requests/s, ([\d,]+) lifecycles/s", out)
    counted = [ln for ln in out.splitlines() if ln.startswith("lifecycle ")]
    n = int(counted[0].split()[1]) if counted else 0
    return (rate.group(1) if rate else "?"), n, c1 - c0, waits


def _journal_means(port: int) -> dict[str, float | None]:
    """Mean commit wait and mean fdatasync (ms) from the daemon's /metrics (None: the
    tree has no such metric)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float | None] = {}
    for key, name in (("commit_wait_ms", "rallypoint_journal_commit_wait_seconds"),
                      ("fsync_ms", "rallypoint_journal_fsync_duration_seconds")):
        total = re.search(rf"^{name}_sum (\S+)$", text, re.M)
        count = re.search(rf"^{name}_count (\S+)$", text, re.M)
        out[key] = (1000 * float(total.group(1)) / float(count.group(1))
                    if total and count and float(count.group(1)) else None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="+", help="source trees (a checkout, or `git archive REV | tar -x -C DIR`), "
                                             "each optionally followed by +DAEMON-OPTIONS")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--durability", default="fsync", choices=("fsync", "interval", "memory"))
    ap.add_argument("--duration", type=float, default=8.0, help="measured seconds (after 1 s of warm-up)")
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--pipeline", type=int, default=8)
    ap.add_argument("--worker-concurrency", type=int, default=8)
    ap.add_argument("--max-messages", type=int, default=100)
    ap.add_argument("--rate", type=float, default=0.0,
                    help="open loop at this many lifecycles/s (0: closed loop); the CPU per lifecycle at a "
                         "fixed rate does not depend on how fast a tree is")
    ap.add_argument("--coalesce-ms", type=float, default=2.0, help="open loop: arrivals per submit window")
    ap.add_argument("--commit-wait", action="store_true",
                    help="also report the journal's mean commit wait and fdatasync (daemon --metrics)")
    a = ap.parse_args()
    for r in range(a.rounds):
        for tree in a.trees:
            rate, n, cpu, waits = measure(tree, a)
            per = f"{1e6 * cpu / n:.1f} us" if n else "?"
            extra = ""
            if waits is not None:
                extra = "; " + ", ".join(f"mean {k.removesuffix('_ms').replace('_', ' ')} "
                                         + (f"{v:.3f} ms" if v is not None else "n/a") for k, v in waits.items())
            print(f"round {r + 1} {tree}: {rate} lifecycles/s; daemon CPU {cpu:.1f} s; {per} per measured "
                  f"lifecycle (n={n}){extra}", flush=True)


if __name__ == "__main__":
    main()
