#!/usr/bin/env python
"""Wake-ups per lifecycle on the server: ``rallypoint bench`` (lifecycle, closed loop,
fsync) with the worker's settle and next receive in one round trip (``--settle next``)
and as two requests (``--settle separate``), in interleaved pairs (issue 47).

For each run it counts, from the daemon's start to its end, the context switches and
the CPU time of the daemon and its sync helper (``perf stat -e
context-switches,task-clock -p`` on the daemon and its children; with no ``perf``, the
context switches of ``/proc/PID/task/*/status``), and divides by every lifecycle the
bench made (warm-up included: ``lifecycles_all``). A context
switch of the daemon is, here, a wake-up: the event loop leaving ``epoll_wait`` for a
request, a durability answer of the sync helper, a write that finished. Prints one
line per run and the medians; ``--json`` writes them.

    python scripts/bench_wakeups.py [--pairs 3] [--duration 5] [--producers 1] [--workers 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def _proc_switches(pids: list[int]) -> int:
    n = 0
    for pid in pids:
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/status") as f:
                    for line in f:
                        if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                            n += int(line.split()[1])
        except OSError:
            pass
    return n


def one_run(a, settle: str) -> dict:
    """One bench run; the daemon's (and its helper's) switches and CPU over the window."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        cmd = [sys.executable, "-m", "rallypoint", "bench", "--scenario", "lifecycle", "--spawn", "--durability",
               "fsync", "--duration", str(a.duration), "--warmup", str(a.warmup), "--producers", str(a.producers),
               "--workers", str(a.workers), "--settle", settle, "--json", out]
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": ROOT})
        pid = None
        for line in p.stderr:
            m = re.search(r"spawned daemon pid (\d+)", line)
            if m:
                pid = int(m.group(1))
                break
        if pid is None:
            p.wait()
            raise RuntimeError("rallypoint bench did not spawn a daemon")
        pids = [pid] + _children(pid)  # the daemon and its sync helper
        perf = shutil.which("perf")
        load = os.getloadavg()[0]
        if perf:  # counts until the bench ends (its daemon exits), then SIGINT'd
            pr = subprocess.Popen([perf, "stat", "-x,", "-e", "context-switches,task-clock", "-p",
                                   ",".join(map(str, pids))], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True)
        else:
            s0 = _proc_switches(pids)
        last = 0
        while p.poll() is None:  # (/proc counters read while the daemon lives)
            last = _proc_switches(pids) if not perf else 0
            time.sleep(0.1)
        rest = p.stderr.read()
        if perf:
            pr.send_signal(2)
            err = pr.communicate(timeout=10)[1]
            vals = {}
            for row in err.splitlines():
                f = row.split(",")
                if len(f) > 2 and f[0].replace(".", "", 1).isdigit():
                    vals[f[2]] = float(f[0])
            switches, cpu_ms = vals.get("context-switches", float("nan")), vals.get("task-clock", float("nan"))
            how = "perf stat"
        else:
            switches, cpu_ms, how = last - s0, float("nan"), "/proc status"
        if not os.path.exists(out):
            raise RuntimeError(f"rallypoint bench failed: {rest[-2000:]}")
        r = json.load(open(out))
    rate = r["throughput"]["lifecycles_per_s"]
    lifecycles = r["throughput"].get("lifecycles_all") or rate * a.duration  # the whole run, as the counts
    return {"settle": settle, "lifecycles_per_s": rate, "lifecycles_all": lifecycles, "switches": switches,
            "cpu_ms": cpu_ms,
            "switches_per_lifecycle": round(switches / lifecycles, 4) if lifecycles else None,
            "cpu_us_per_lifecycle": round(1000 * cpu_ms / lifecycles, 2) if lifecycles else None,
            "requests_per_s": r["throughput"].get("ops_per_s"), "how": how, "load_1m": round(load, 2),
            "daemon_pids": pids}


def _median(xs):
    ys = sorted(x for x in xs if x is not None)
    return ys[len(ys) // 2] if ys else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--producers", type=int, default=1)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args()
    runs = []
    for k in range(a.pairs):
        for settle in ("next", "separate"):
            r = one_run(a, settle)
            runs.append(r)
            print(f"pair {k + 1}/{a.pairs} settle={settle:<9} {r['lifecycles_per_s']:>8,.0f} lifecycles/s  "
                  f"{r['requests_per_s'] or 0:>6,.0f} req/s  daemon: {r['switches_per_lifecycle']:.3f} switches and "
                  f"{r['cpu_us_per_lifecycle']:.1f} us CPU per lifecycle ({r['how']}; load {r['load_1m']:.2f})",
                  flush=True)
    print()
    summary = {}
    for settle in ("next", "separate"):
        rs = [r for r in runs if r["settle"] == settle]
        summary[settle] = {k: _median([r[k] for r in rs]) for k in
                           ("lifecycles_per_s", "switches_per_lifecycle", "cpu_us_per_lifecycle", "requests_per_s")}
        s = summary[settle]
        print(f"median settle={settle:<9} {s['lifecycles_per_s']:>8,.0f} lifecycles/s, {s['requests_per_s'] or 0:,.0f} "
              f"req/s, {s['switches_per_lifecycle']:.3f} daemon switches and {s['cpu_us_per_lifecycle']:.1f} us "
              "daemon CPU per lifecycle")
    print(f"({a.producers} producers, {a.workers} workers, batches of 64, nproc {os.cpu_count()})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "runs": runs, "median": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
