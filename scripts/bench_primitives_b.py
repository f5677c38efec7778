#!/usr/bin/env python
"""Benchmark quota takes, budget reserve+settle pairs and message sends against task
submits, over TCP, on one run (prints figures, asserts nothing).

    python scripts/bench_primitives_b.py [--durability fsync] [--seconds 10] [--slot 1]
                                         [--clients 2] [--loops 16] [--json out.json]

A ``rallypoint serve`` daemon (fresh temp data dir, ``--durability``) and ``--clients``
client PROCESSES, each with one TCP connection and ``--loops`` concurrent request loops
(``clients * loops`` requests in flight: group commit puts many in one fsync).

The kinds take turns in slots of ``--slot`` seconds (every client switches at the same
wall instants; each cycle of four slots in a new order), for ``--seconds`` per kind in
all, after one warm-up cycle. So a shared machine whose load swings by a factor of
three within a minute (it does) slows every kind alike, and the figures compare. A
request counts for the slot it started in. The kinds:

* ``submit``: ``mailbox.submit(payload, scope=run)`` -- one task per request (the
  reference: the goal is each primitive within 20 % of it);
* ``take``: ``quota.take(1, scope=run)`` (no wait) on a quota with room for all;
* ``reserve+settle``: ``budget.reserve(1, scope=run)`` then ``reservation.settle(1)``
  -- a pair is two requests, one after the other; reported as pairs/s and requests/s;
* ``send``: ``inbox.send(payload, scope=run)`` (a message into an INBOX mailbox).

Latency p50/p99 per request (per pair for reserve+settle) is measured by the clients.

``--decide N``: instead, the server-side CPU cost of each op, decided in this process N
times each (``coord.decide``, memory journal, reply encoded; no transport, no SDK).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
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


def schedule(n_cycles: int) -> list[str]:
    """The kind of each slot: cycles of the four kinds, each cycle in a new order."""
    rng = random.Random(7)
    out: list[str] = []
    for _ in range(n_cycles):
        cycle = list(KINDS)
        rng.shuffle(cycle)
        out += cycle
    return out


def client_main(url: str, run_id: str, loops: int, t0_wall: float, slot_s: float, slots: list[str], out) -> None:
    async def main():
        async with rallypoint.connect(url, reconnect=False) as rs:
            run = rs.scope(run_id)
            mbx, inbox = rs.mailbox("bench-tasks"), rs.mailbox("bench-inbox")
            quota, budget = rs.quota("bench-quota"), rs.budget("bench-budget")
            counts = {k: 0 for k in KINDS}
            lat: dict[str, list[float]] = {k: [] for k in KINDS}
            warm = len(KINDS)  # the first cycle is a warm-up

            async def one(kind: str):
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
                while True:
                    now = time.time()
                    slot = int((now - t0_wall) // slot_s)
                    if slot >= len(slots):
                        return
                    if slot < 0:
                        await trio.sleep(t0_wall - now)
                        continue
                    kind = slots[slot]
                    t = time.perf_counter()
                    await one(kind)
                    if slot >= warm:
                        counts[kind] += 1
                        lat[kind].append((time.perf_counter() - t) * 1000)

            async with trio.open_nursery() as n:
                for _ in range(loops):
                    n.start_soon(loop)
            out.put({"counts": counts, "lat": lat})

    trio.run(main)


async def setup(url: str) -> str:
    async with rallypoint.connect(url) as rs:
        run = await rs.scopes.create(name="bench-primitives-b")
        await rs.mailboxes.ensure("bench-tasks")
        await rs.mailboxes.ensure("bench-inbox", mode="INBOX")
        await rs.quotas.ensure("bench-quota", units_limit=10**12, window_seconds=86_400)
        await rs.budgets.ensure("bench-budget", limit=10**18, currency="USD", scale=2)
        return run.id


def decide_costs(n: int) -> None:
    from rallypoint import protocol as p
    from rallypoint.client.api import encode_payload
    from rallypoint.node import open_node
    from rallypoint.service import Session

    async def run_it():
        async with open_node(None, "memory") as node:
            c, s, enc = node.coordinator, Session(), p.encoder.encode
            run = c.decide(s, p.ScopeCreate())
            c.decide(s, p.MailboxEnsure(name="m"))
            c.decide(s, p.MailboxEnsure(name="in", mode="INBOX"))
            c.decide(s, p.QuotaEnsure(name="q", units_limit=10**12, window_ms=86_400_000))
            c.decide(s, p.BudgetEnsure(name="b", limit_minor=10**18))
            pay = encode_payload(PAYLOAD)
            held: list = []
            ops = {
                "submit": lambda i: p.TaskSubmit(mailbox="m", scope_id=run.id, input=pay),
                "take": lambda i: p.QuotaTake(quota="q", scope_id=run.id),
                "reserve": lambda i: p.BudgetReserve(budget="b", scope_id=run.id, amount_minor=1),
                "settle": lambda i: p.BudgetSettle(reservation_id=held[i].id, amount_minor=1,
                                                   usage_key=f"settle:{held[i].id}"),
                "send": lambda i: p.MessageSend(mailbox="in", scope_id=run.id, payload=pay),
            }
            for name, make in ops.items():
                t0 = time.perf_counter()
                for i in range(n):
                    reply = c.decide(s, make(i))
                    enc(reply)
                    if name == "reserve":
                        held.append(reply)
                print(f"  {name:8} {(time.perf_counter() - t0) / n * 1e6:6.1f} us/op")
                await trio.sleep(0)

    print(f"server-side cost per op, decided in process {n:,} times each (memory journal):")
    trio.run(run_it)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--durability", default="fsync", choices=["fsync", "interval", "memory"])
    ap.add_argument("--seconds", type=float, default=10.0, help="measured seconds per kind, in all")
    ap.add_argument("--slot", type=float, default=1.0, help="seconds of one slot")
    ap.add_argument("--clients", type=int, default=2, help="client processes (one connection each)")
    ap.add_argument("--loops", type=int, default=16, help="concurrent request loops per client")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--decide", type=int, default=0, metavar="N",
                    help="only measure the in-process decide cost of each op, N times each")
    args = ap.parse_args()
    if args.decide:
        decide_costs(args.decide)
        return

    cycles = 1 + max(1, round(args.seconds / args.slot))
    slots = schedule(cycles)
    d = SpawnedDaemon(args.durability)
    url = d.start()
    load = os.getloadavg()
    print(f"daemon {url} ({args.durability}), {args.clients} clients x {args.loops} loops, "
          f"{cycles - 1} slots of {args.slot:g} s per kind (+1 warm-up cycle); load average {load[0]:.1f}",
          flush=True)
    try:
        run_id = trio.run(setup, url)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        t0 = time.time() + 2.0 + 0.5 * args.clients  # every client started and connected by then
        procs = [ctx.Process(target=client_main, args=(url, run_id, args.loops, t0, args.slot, slots, q))
                 for _ in range(args.clients)]
        for p in procs:
            p.start()
        results = [q.get(timeout=len(slots) * args.slot + 120) for _ in procs]
        for p in procs:
            p.join(30)
    finally:
        d.stop()
    load_after = os.getloadavg()
    measured_s = (cycles - 1) * args.slot
    rows = {}
    for kind in KINDS:
        count = sum(r["counts"][kind] for r in results)
        lat = [x for r in results for x in r["lat"][kind]]
        rows[kind] = {"per_s": count / measured_s, "p50_ms": pct(lat, 0.5), "p99_ms": pct(lat, 0.99),
                      "count": count}
    rows["reserve+settle"]["requests_per_s"] = 2 * rows["reserve+settle"]["per_s"]
    base = rows["submit"]["per_s"]
    print(f"\n{measured_s:g} s per kind ({args.durability}, TCP), load average {load[0]:.1f} before, "
          f"{load_after[0]:.1f} after:")
    print(f"  {'kind':15} {'per s':>9}  {'vs submit':>9}  {'p50 ms':>7}  {'p99 ms':>7}")
    for kind in KINDS:
        m = rows[kind]
        print(f"  {kind:15} {m['per_s']:9,.0f}  {m['per_s'] / base:9.0%}  {m['p50_ms']:7.2f}  {m['p99_ms']:7.2f}")
    rs_ = rows["reserve+settle"]
    print(f"  (reserve+settle: {rs_['requests_per_s']:,.0f} requests/s = "
          f"{rs_['requests_per_s'] / base:.0%} of the submit rate, per request)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "machine": {"nproc": os.cpu_count(),
                       "python": platform.python_version(), "load_before": load, "load_after": load_after},
                       "config": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
