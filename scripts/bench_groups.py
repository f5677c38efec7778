#!/usr/bin/env python
"""Task-group round benchmark (SPEC §4). Prints figures, asserts nothing.

One *round*: create an N_ACCEPTED group (threshold 5) and submit 12 members; a worker
leases all 12 and completes them one by one; a reviewer accepts each completed member;
the 5th accept finalizes the group (SUCCESS threshold_reached) and the 7 members still
leased are CANCELLED. A waiter parked in ``group.wait()`` since before the first accept
measures the *decision notification latency*: from just before the 5th accept is sent
to the moment its ``wait()`` returns.

Modes: ``embedded`` (the coordinator in this process) and ``tcp`` (a ``rallypoint
serve`` subprocess; the waiter uses its own connection). ``--pipelined`` sends the 12
submits and the completes concurrently instead of one after another.

Usage::

    python scripts/bench_groups.py [--seconds 3] [--mode embedded,tcp] [--pipelined]
        [--durability memory|fsync] [--json out.json]

Targets: <= 2 ms per round, <= 1 ms p99 decision notification.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import trio

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import rallypoint  # noqa: E402

MEMBERS = 12
THRESHOLD = 5
RUNS_PER_ROOT = 900  # each group's gate is a child run; stay under child_limit 1000


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def one_round(rs, waiter_rs, mbx, run, pipelined: bool, lat: list[float]) -> None:
    g = await run.groups.create(mbx, "N_ACCEPTED", threshold=THRESHOLD)
    if pipelined:
        tickets: list = [None] * MEMBERS

        async def sub(i):
            tickets[i] = await g.submit(i)

        async with trio.open_nursery() as n:
            for i in range(MEMBERS):
                n.start_soon(sub, i)
    else:
        tickets = [await g.submit(i) for i in range(MEMBERS)]
    deliveries = await mbx.receive(g.scope_id, wait=0, max_messages=MEMBERS)  # the worker
    woke: list[float] = []
    waiter_group = waiter_rs.group(g.id)

    async def waiter(task_status=trio.TASK_STATUS_IGNORED):
        task_status.started()
        st = await waiter_group.wait(timeout=30)
        woke.append(time.perf_counter())
        assert st.outcome == "SUCCESS"

    async with trio.open_nursery() as n:
        await n.start(waiter)
        await trio.sleep(0)  # let the waiter's request reach the server
        if pipelined:
            async def complete(d):
                await d.complete({"score": 1})

            async with trio.open_nursery() as n2:
                for d in deliveries[:THRESHOLD]:
                    n2.start_soon(complete, d)
            async with trio.open_nursery() as n2:
                for d in deliveries[: THRESHOLD - 1]:
                    n2.start_soon(g.accept, d.task_id)
        else:
            for d in deliveries[: THRESHOLD - 1]:
                await d.complete({"score": 1})
                await g.accept(d.task_id)
            await deliveries[THRESHOLD - 1].complete({"score": 1})
        t0 = time.perf_counter()
        v = await g.accept(deliveries[THRESHOLD - 1].task_id)
        assert v.group_state == "FINALIZED", v
    lat.append(woke[0] - t0)


async def bench(rs, waiter_rs, seconds: float, pipelined: bool) -> dict:
    mbx = await rs.mailboxes.ensure("bench-groups")
    run = await rs.scopes.create()
    made = 0
    lat: list[float] = []
    round_s: list[float] = []
    # warm-up
    for _ in range(20):
        await one_round(rs, waiter_rs, mbx, run, pipelined, [])
        made += 1
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        if made >= RUNS_PER_ROOT:
            run, made = await rs.scopes.create(), 0
        t = time.perf_counter()
        await one_round(rs, waiter_rs, mbx, run, pipelined, lat)
        round_s.append(time.perf_counter() - t)
        made += 1
    elapsed = time.perf_counter() - start
    return {
        "rounds": len(round_s),
        "rounds_per_s": len(round_s) / elapsed,
        "round_ms_mean": statistics.fmean(round_s) * 1e3,
        "round_ms_p50": pct(round_s, 50) * 1e3,
        "round_ms_p99": pct(round_s, 99) * 1e3,
        "notify_ms_p50": pct(lat, 50) * 1e3,
        "notify_ms_p99": pct(lat, 99) * 1e3,
        "notify_ms_max": max(lat) * 1e3,
    }


def start_daemon(durability: str, data_dir: str | None):
    args = [sys.executable, "-m", "rallypoint", "serve", "--listen", "127.0.0.1:0", "--durability", durability]
    if data_dir:
        args += ["--data-dir", data_dir]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while True:
        line = proc.stdout.readline()
        if line.startswith("READY "):
            return proc, line.split()[1]
        if not line and proc.poll() is not None:
            raise RuntimeError(proc.stderr.read())


async def main(args) -> dict:
    out: dict = {}
    modes = args.mode.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = tmp if args.durability != "memory" else None
        if "embedded" in modes:
            async with rallypoint.open_embedded(data_dir and os.path.join(tmp, "emb"), durability=args.durability) as rs:
                out["embedded"] = await bench(rs, rs, args.seconds, args.pipelined)
        if "tcp" in modes:
            proc, url = start_daemon(args.durability, data_dir and os.path.join(tmp, "tcp"))
            try:
                async with rallypoint.connect(url) as rs, rallypoint.connect(url) as waiter_rs:
                    out["tcp"] = await bench(rs, waiter_rs, args.seconds, args.pipelined)
            finally:
                proc.terminate()
                proc.wait()
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--mode", default="embedded,tcp")
    ap.add_argument("--pipelined", action="store_true")
    ap.add_argument("--durability", default="memory", choices=["memory", "fsync", "interval"])
    ap.add_argument("--json")
    args = ap.parse_args()
    res = trio.run(main, args)
    print(f"task-group rounds: {MEMBERS} members, N_ACCEPTED threshold {THRESHOLD}, "
          f"durability {args.durability}, {'pipelined' if args.pipelined else 'sequential'} requests")
    for mode, r in res.items():
        print(
            f"  {mode:9s} {r['rounds_per_s']:8.0f} rounds/s  round p50 {r['round_ms_p50']:.3f} ms "
            f"p99 {r['round_ms_p99']:.3f} ms  |  5th accept -> waiter woken p50 {r['notify_ms_p50']:.3f} ms "
            f"p99 {r['notify_ms_p99']:.3f} ms (max {r['notify_ms_max']:.3f}, n={r['rounds']})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
