"""Benchmark: N schedules firing every minute on one node (embedded coordinator, real
clock, memory durability): fire lag p50/p99 at the top of the minute, CPU and memory
per schedule.

    python3 scripts/bench_schedules.py            # 100,000 schedules, one minute's fires
    python3 scripts/bench_schedules.py --n 10000 --minutes 2 --jitter 0
    python3 scripts/bench_schedules.py --floor    # and the floor: pre-built fires, commit only

The schedules are made through the kind's own path (``ScheduleCreated`` records
committed in batches of 1,000: the same apply as ``schedules.create``), each
``cron="* * * * *"`` with a root run per fire (no task). Lag is the real instant a
fire's group commit was journaled minus its due instant
(``rallypoint_schedule_fire_lag_seconds``); the schedules due at one instant are one
heap entry, fired in group commits of 1,000.
Memory: resident set size before and after the schedules, and after their first fires
(each fire keeps a run and an action). The collector is set as ``rallypoint serve``
sets it once recovery has loaded the schedules (``tune_gc``: collect, freeze, rarer full
collections; ``--no-tune-gc`` leaves Python's default, as the bench did before).
``--floor`` then builds one action per schedule (its run and ``ScheduleFired``) before
starting the clock and times only their commit: the cost of the effect alone, what any
design that creates the runs at the fire still pays. Prints one figure per line.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import time

import trio


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def main(n: int, minutes: int, jitter_ms: int, floor: bool = False, tune_gc: bool = True) -> None:
    import rallypoint
    from rallypoint.actors.schedule import STEP_FIRES
    from rallypoint.records import ScheduleConfig, ScheduleCreated

    async with rallypoint.open_embedded() as rs:
        coord = rs.node.coordinator
        gc.collect()
        rss0 = rss_bytes()
        t0 = time.process_time()
        cfg = ScheduleConfig(cron=["* * * * *"], jitter_ms=jitter_ms, catchup_window_ms=60_000, overlap="allow_all")
        now = coord.now_ms()
        for i in range(0, n, 1000):
            recs = [ScheduleCreated(id=coord.new_id("sch", space="default"), space="default", name=f"s{j}",
                                    config=cfg, at_ms=now, cursor_ms=now) for j in range(i, min(n, i + 1000))]
            coord.commit(recs)
            await trio.sleep(0)
        create_cpu = time.process_time() - t0
        gc.collect()
        rss1 = rss_bytes()
        if tune_gc:  # as `rallypoint serve` does once recovery has loaded the schedules
            from rallypoint.cli import tune_gc as tune
            tune()
        print(f"schedules                 {n:,}")
        print(f"create CPU per schedule   {create_cpu / n * 1e6:.1f} us")
        print(f"memory per schedule       {(rss1 - rss0) / n:.0f} bytes (RSS, idle schedule)")
        sch = coord.schedules
        lags_all = []
        for m in range(minutes):
            nxt_ms = (coord.now_ms() // 60_000 + 1) * 60_000
            before = sch.fires
            sch.lag_samples.clear()
            await trio.sleep_until(coord.clock.trio_time_at(nxt_ms) - 0.2)
            c0 = time.process_time()
            with trio.fail_after(120):
                while sch.fires - before < n:
                    await trio.sleep(0.01)
            cpu = time.process_time() - c0
            lags = list(sch.lag_samples)
            lags_all += lags
            print(f"minute {m + 1}: {len(lags):,} fires, lag p50 {pct(lags, 0.5) * 1000:.0f} ms, "
                  f"p99 {pct(lags, 0.99) * 1000:.0f} ms, max {max(lags) * 1000:.0f} ms; "
                  f"CPU {cpu:.2f} s ({cpu / n * 1e6:.0f} us per fire)")
        if floor:
            # The effect alone: every schedule's action (its run and ScheduleFired, origin
            # trigger) built BEFORE the clock starts -- as a design that pre-computes the
            # whole fire would -- then only committed, in the same group commits.
            now = coord.now_ms()
            staged = [sch._fire_records(s, now, "trigger", False, now) for s in list(sch.table.values())]
            w0, c0 = time.perf_counter(), time.process_time()
            step = STEP_FIRES
            for i in range(0, len(staged), step):
                part = staged[i:i + step]
                coord.grouped(lambda part=part: [coord.commit(r) for r in part])
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            print(f"floor: commit of {len(staged):,} pre-built fires (apply, events, journal): {wall * 1000:.0f} ms "
                  f"wall, CPU {cpu * 1e6 / len(staged):.1f} us per fire")
        gc.collect()
        rss2 = rss_bytes()
        print(f"memory per schedule+fires {(rss2 - rss0) / n:.0f} bytes (RSS, with {minutes} fire(s) each: "
              "runs and actions kept)")
        print(f"fire lag p50              {pct(lags_all, 0.5) * 1000:.1f} ms")
        print(f"fire lag p99              {pct(lags_all, 0.99) * 1000:.1f} ms")
        print(f"max RSS                   {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--minutes", type=int, default=1)
    ap.add_argument("--jitter", type=float, default=0.0, help="each schedule's jitter, seconds")
    ap.add_argument("--floor", action="store_true",
                    help="then commit one pre-built action per schedule: the cost of the effect alone")
    ap.add_argument("--no-tune-gc", action="store_true",
                    help="leave the collector as Python sets it (default: the daemon's tune_gc after creating)")
    a = ap.parse_args()
    trio.run(main, a.n, a.minutes, int(a.jitter * 1000), a.floor, not a.no_tune_gc)
