#!/usr/bin/env python
"""Benchmark durable timers on one coordinator (prints figures, asserts nothing).

    python scripts/bench_timers.py [--n 1000000] [--spread 60] [--durability memory]

Arms N timers through the real path (``op_timer_create``: validation, a ``TimerCreated``
record committed to the journal, apply, the shared TimerHeap) on an embedded
coordinator under the real clock, with due instants spread uniformly over ``--spread``
seconds starting after arming ends. Reports:
  * arming rate (timers/s) and the RSS delta for the armed timers;
  * firing lateness = (the coordinator clock when the heap fired the timer) - fire_at,
    p50/p99/max, for every timer, and the fired count (every fire also commits a
    ``TimerFired`` record);
  * whether any timer fired early (it must not).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from rallypoint import protocol as p  # noqa: E402
from rallypoint.node import open_node  # noqa: E402
from rallypoint.service import Session  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pct(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return float("nan")
    i = min(len(sorted_vals) - 1, max(0, int(round(q * (len(sorted_vals) - 1)))))
    return sorted_vals[i]


async def main(args) -> None:
    data_dir = None
    if args.durability != "memory":
        import tempfile

        data_dir = tempfile.mkdtemp(prefix="rp-bench-timers-", dir=args.dir)
    async with open_node(data_dir, args.durability, snapshot_every_records=10**12, snapshot_every_s=10**9) as node:
        coord = node.coordinator
        session = Session()
        run = coord.decide(session, p.ScopeCreate(name="bench-timers"))
        rng = random.Random(42)

        # Calibrate: arm 20k timers far in the future to learn the arming rate, so the
        # real batch can start its due window right after arming ends.
        calib = min(20_000, args.n)
        t0 = time.perf_counter()
        for _ in range(calib):
            coord.decide(session, p.TimerCreate(scope_id=run.id, after_ms=10 * 86_400_000))
        calib_rate = calib / (time.perf_counter() - t0)
        await trio.sleep(0)

        gc.collect()
        rss0 = rss_bytes()
        est_arm_s = args.n / calib_rate
        base_ms = coord.now_ms() + int((est_arm_s * 1.6 + 3) * 1000)
        spread_ms = int(args.spread * 1000)
        lateness: list[float] = []
        clock = coord.clock
        orig = coord._on_timer

        def on_timer(timer_id, at_ms, due):
            lateness.append(clock.now() * 1000 - at_ms)  # calibration timers never come due
            orig(timer_id, at_ms, due)

        coord._on_timer = on_timer  # _fire_activity looks it up by name on the instance

        print(f"arming {args.n:,} timers (calibrated {calib_rate:,.0f}/s, est. {est_arm_s:.1f} s; "
              f"due window starts in {(base_ms - coord.now_ms()) / 1000:.1f} s, spread {args.spread:.0f} s)")
        t0 = time.perf_counter()
        yield_every = 5_000
        for i in range(args.n):
            due = base_ms + rng.randrange(spread_ms)
            coord.decide(session, p.TimerCreate(scope_id=run.id, after_ms=due - coord.now_ms()))
            if i % yield_every == yield_every - 1:
                await trio.sleep(0)  # let the journal/heap tasks breathe, as a server would
        arm_s = time.perf_counter() - t0
        gc.collect()
        rss1 = rss_bytes()
        late_start = (coord.now_ms() - base_ms) / 1000
        print(f"armed {args.n:,} in {arm_s:.2f} s = {args.n / arm_s:,.0f} timers/s "
              f"(op_timer_create + commit, {args.durability} journal)")
        print(f"RSS delta {(rss1 - rss0) / 2**20:,.1f} MiB = {(rss1 - rss0) / args.n:,.0f} B/timer "
              f"(state, id, heap entry, indexes, journal bookkeeping)")
        if late_start > 0:
            print(f"WARNING: arming overran the due window start by {late_start:.2f} s; early timers fire late")

        if args.gc_freeze:
            gc.freeze()  # what a server can do after recovery: long-lived state out of GC scans
        gc_pauses: list[float] = []
        gc_t0 = [0.0]

        def gc_cb(phase, info):
            if phase == "start":
                gc_t0[0] = time.perf_counter()
            elif info.get("generation") == 2:
                gc_pauses.append((time.perf_counter() - gc_t0[0]) * 1000)

        gc.callbacks.append(gc_cb)
        end_ms = base_ms + spread_ms
        while coord.now_ms() < end_ms + 500:
            await trio.sleep(0.5)
        fired = sum(1 for t in coord.timers_by_id.values() if t.state == "FIRED")
        early = sum(1 for x in lateness if x < 0)
        lat = sorted(lateness)
        print(f"fired {fired:,}/{args.n:,}; firing lateness (coordinator clock - fire_at) over {len(lat):,} fires: "
              f"p50 {pct(lat, 0.5):.2f} ms, p99 {pct(lat, 0.99):.2f} ms, max {lat[-1] if lat else float('nan'):.2f} ms; "
              f"early: {early}")
        gc.callbacks.remove(gc_cb)
        print(f"full (gen 2) GC runs during firing: {len(gc_pauses)}, longest {max(gc_pauses, default=0):.1f} ms"
              f"{' (gc.freeze() after arming)' if args.gc_freeze else ''}")
        st = coord.statistics()
        print(f"commits {st['commits']:,}, heap entries left {st['timers_armed']:,}")
        rate = args.n / arm_s
        if args.n < 1_000_000:
            print(f"extrapolation: 1,000,000 timers would take about {1_000_000 / rate:.1f} s to arm at this rate "
                  f"and about {(rss1 - rss0) / args.n * 1_000_000 / 2**20:,.0f} MiB")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--spread", type=float, default=60.0, help="due instants spread over this many seconds")
    ap.add_argument("--durability", default="memory", choices=["memory", "interval", "fsync"])
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() once armed")
    ap.add_argument("--dir", default=None, help="parent of the temporary data dir (file modes)")
    trio.run(main, ap.parse_args())
