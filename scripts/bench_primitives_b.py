#!/usr/bin/env python
"""Benchmark quota takes, budget reserve+settle pairs and message sends against task
submits, over TCP, on one run (prints figures, asserts nothing).

    python scripts/bench_primitives_b.py [--durability fsync] [--seconds 5] [--rounds 3]
                                         [--clients 2] [--loops 16] [--json out.json]

A ``rallypoint serve`` daemon (fresh temp data dir, ``--durability``) and ``--clients``
client PROCESSES, each with one TCP connection and ``--loops`` concurrent request loops
(so ``clients * loops`` requests in flight: group commit puts many in one fsync). Every
kind runs for ``--seconds`` after a 1 s warm-up, on the same run, in rounds
(submit, take, reserve+settle, send, submit, ...) each round led by the next kind, so that a change in the machine's load hits every kind
alike; the median round is reported. The clients start together (at a wall instant
the parent gives), warm up for 1 s, then count. The kinds:

* ``submit``: ``mailbox.submit(payload, scope=run)`` -- one task per request (the
  reference: the goal is each primitive within 20 % of it);
* ``take``: ``quota.take(1, scope=run)`` (no wait) on a quota with room for all;
* ``reserve+settle``: ``budget.reserve(1, scope=run)`` then ``reservation.settle(1)``
  -- a pair is two requests, one after the other; reported as pairs/s and as
  requests/s;
* ``send``: ``inbox.send(payload, scope=run)`` (a message into an INBOX mailbox).

Latency p50/p99 per request (per pair for reserve+settle) comes from the client side.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")  # the daemon runs this tree

import rallypoint  # noqa: E402
from rallypoint.loadtest.runner import SpawnedDaemon  # noqa: E402

PAYLOAD = {"data": "x" * 88}  # ~100 bytes encoded
KINDS = ("submit", "take", "reserve+settle", "send")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def client_main(url: str, run_id: str, kind: str, loops: int, seconds: float, warmup: float, start_wall: float,
                out) -> None:
    async def main():
        async with rallypoint.connect(url, reconnect=False) as rs:
            await trio.sleep(max(0.0, start_wall - time.time()))  # every client measures the same window
            run = rs.scope(run_id)
            mbx, inbox = rs.mailbox("bench-tasks"), rs.mailbox("bench-inbox")
            quota, budget = rs.quota("bench-quota"), rs.budget("bench-budget")
            lat: list[float] = []
            count = 0
            t_start = trio.current_time() + warmup
            t_end = t_start + seconds

            async def one():
                if kind == "submit":
                    await mbx.submit(PAYLOAD, scope=run)
                elif kind == "take":
                    await quota.take(1, scope=run)
                elif kind == "reserve+settle":
                    r = await budget.reserve(1, scope=run)
                    await r.settle(1)
                else:
                    await inbox.send(PAYLOAD, scope=run)

            async def loop():
                nonlocal count
                while True:
                    t0 = trio.current_time()
                    if t0 >= t_end:
                        return
                    await one()
                    t1 = trio.current_time()
                    if t0 >= t_start:
                        count += 1
                        lat.append((t1 - t0) * 1000)

            async with trio.open_nursery() as n:
                for _ in range(loops):
                    n.start_soon(loop)
            out.put({"count": count, "lat": lat})

    trio.run(main)


async def setup(url: str) -> str:
    async with rallypoint.connect(url) as rs:
        run = await rs.scopes.create(name="bench-primitives-b")
        await rs.mailboxes.ensure("bench-tasks")
        await rs.mailboxes.ensure("bench-inbox", mode="INBOX")
        await rs.quotas.ensure("bench-quota", units_limit=10**12, window_seconds=86_400)
        await rs.budgets.ensure("bench-budget", limit=10**18, currency="USD", scale=2)
        return run.id


def measure(url: str, run_id: str, kind: str, args) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    start_wall = time.time() + 2.0 + 0.5 * args.clients  # after every client started and connected
    procs = [ctx.Process(target=client_main, args=(url, run_id, kind, args.loops, args.seconds, 1.0, start_wall, q))
             for _ in range(args.clients)]
    for p in procs:
        p.start()
    results = [q.get(timeout=args.seconds + 120) for _ in procs]
    for p in procs:
        p.join(30)
    count = sum(r["count"] for r in results)
    lat = [x for r in results for x in r["lat"]]
    per_s = count / args.seconds
    row = {"kind": kind, "per_s": per_s, "p50_ms": pct(lat, 0.5), "p99_ms": pct(lat, 0.99)}
    if kind == "reserve+settle":
        row["requests_per_s"] = 2 * per_s
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--durability", default="fsync", choices=["fsync", "interval", "memory"])
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per kind and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=2, help="client processes (one connection each)")
    ap.add_argument("--loops", type=int, default=16, help="concurrent request loops per client")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()

    d = SpawnedDaemon(args.durability)
    url = d.start()
    load = os.getloadavg()
    print(f"daemon {url} ({args.durability}), {args.clients} clients x {args.loops} loops, "
          f"{args.seconds:g} s per kind, {args.rounds} rounds; load average {load[0]:.1f}", flush=True)
    rows: dict[str, list[dict]] = {k: [] for k in KINDS}
    try:
        run_id = trio.run(setup, url)
        for r in range(args.rounds):
            for kind in KINDS[r % len(KINDS):] + KINDS[:r % len(KINDS)]:  # each kind leads a round in turn
                row = measure(url, run_id, kind, args)
                rows[kind].append(row)
                extra = f" ({row['requests_per_s']:,.0f} requests/s)" if "requests_per_s" in row else ""
                print(f"  round {r + 1} {kind:15} {row['per_s']:9,.0f}/s{extra}  p50 {row['p50_ms']:.2f} ms  "
                      f"p99 {row['p99_ms']:.2f} ms", flush=True)
    finally:
        d.stop()
    med = {k: sorted(v, key=lambda x: x["per_s"])[len(v) // 2] for k, v in rows.items()}
    base = med["submit"]["per_s"]
    print(f"\nmedian of {args.rounds} rounds ({args.durability}, TCP):")
    print(f"  {'kind':15} {'per s':>9}  {'vs submit':>9}  {'p50 ms':>7}  {'p99 ms':>7}")
    for kind in KINDS:
        m = med[kind]
        print(f"  {kind:15} {m['per_s']:9,.0f}  {m['per_s'] / base:9.0%}  {m['p50_ms']:7.2f}  {m['p99_ms']:7.2f}")
    rs_ = med["reserve+settle"]
    print(f"  (reserve+settle: {rs_['requests_per_s']:,.0f} requests/s = "
          f"{rs_['requests_per_s'] / base:.0%} of the submit rate per request)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "machine": {"nproc": os.cpu_count(),
                       "python": platform.python_version(), "load_before": load},
                       "config": vars(args), "median": med, "rounds": rows,
                       "statistics": {k: statistics.median(x["per_s"] for x in v) for k, v in rows.items()}},
                      f, indent=2)


if __name__ == "__main__":
    main()
