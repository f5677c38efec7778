#!/usr/bin/env python
"""Claims and pools over TCP: acquire+release pairs per second, against a task submit on
the same run (issue 15). Prints figures, asserts nothing.

A ``rallypoint serve`` subprocess (fresh data dir, ``--durability fsync`` by default);
``--connections`` client connections share ``--concurrency`` loops, each loop doing,
for ``--seconds`` at a time:

- ``submit``: ``mailbox.submit(i, scope=run)`` (one request, one commit);
- ``claim``: ``run.claims.acquire(key)`` then ``lease.release()`` on a key of its own
  (two requests, two commits: a *pair*);
- ``pool``: ``pool.acquire(1, scope=run)`` then ``grant.release()`` on a pool with a unit
  per loop (no contention: a pair);
- ``claim-handoff`` / ``pool-handoff`` (contended): every loop wants the *same* key, or
  one unit of a 1-unit pool, with ``wait``; each release hands the lease over to the
  next queued request in the same step (a pair per lease).

The kinds alternate ``--rounds`` times (submit, claim, pool, submit, ...) so that a busy
shared machine hurts them alike; the best round of each is reported. ``per request vs
submit`` compares the cost of one acquire or release request with one submit:
``2 x pairs/s / submits/s`` (1.0: the same; the goal is >= 0.8).

Usage::

    python scripts/bench_primitives.py [--seconds 3] [--concurrency 1,16] [--connections 4]
        [--rounds 2] [--durability fsync|interval|memory] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import trio

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import rallypoint  # noqa: E402

KINDS = ("submit", "claim", "pool", "claim-handoff", "pool-handoff")


def start_daemon(durability: str, data_dir: str | None):
    args = [sys.executable, "-m", "rallypoint", "serve", "--listen", "127.0.0.1:0", "--durability", durability,
            "--log-level", "WARNING"]
    if data_dir:
        args += ["--data-dir", data_dir]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while True:
        line = proc.stdout.readline()
        if line.startswith("READY "):
            return proc, line.split()[1]
        if not line and proc.poll() is not None:
            raise RuntimeError(proc.stderr.read())


async def run_kind(kind: str, clients: list, run_id: str, concurrency: int, seconds: float, tag: str) -> float:
    """Operations (submits, or acquire+release pairs) per second, over ``seconds``."""
    count = 0
    deadline = time.perf_counter() + seconds

    async def loop(i: int) -> None:
        nonlocal count
        rs = clients[i % len(clients)]
        run = rs.scope(run_id)
        mbx = rs.mailbox("bench-prim")
        pool = rs.pool(f"bench-pool-{tag}")
        one = rs.pool(f"bench-one-{tag}")
        key = f"bench-{tag}-{i}"
        while time.perf_counter() < deadline:
            if kind == "submit":
                await mbx.submit(i, scope=run)
            elif kind == "claim":
                lease = await run.claims.acquire(key, lease_seconds=30)
                await lease.release()
            elif kind == "pool":
                grant = await pool.acquire(1, scope=run, lease_seconds=30)
                await grant.release()
            elif kind == "claim-handoff":
                lease = await run.claims.acquire(f"bench-{tag}-shared", lease_seconds=30, wait=60)
                await lease.release()
            else:
                grant = await one.acquire(1, scope=run, lease_seconds=30, wait=60)
                await grant.release()
            count += 1

    start = time.perf_counter()
    async with trio.open_nursery() as n:
        for i in range(concurrency):
            n.start_soon(loop, i)
    return count / (time.perf_counter() - start)


async def main(args) -> dict:
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = os.path.join(tmp, "data") if args.durability != "memory" else None
        proc, url = start_daemon(args.durability, data_dir)
        try:
            for conc in [int(c) for c in args.concurrency.split(",")]:
                async with trio.open_nursery() as cn:
                    clients = []
                    stack = []
                    for _ in range(min(args.connections, conc)):
                        cm = rallypoint.connect(url)
                        clients.append(await cm.__aenter__())
                        stack.append(cm)
                    rs = clients[0]
                    run = await rs.scopes.create(name=f"bench-{conc}")
                    await rs.mailboxes.ensure("bench-prim")
                    tag = f"c{conc}"
                    await rs.pools.ensure(f"bench-pool-{tag}", conc)
                    await rs.pools.ensure(f"bench-one-{tag}", 1)
                    for kind in KINDS:  # warm-up
                        await run_kind(kind, clients, run.id, conc, 0.3, tag)
                    best = {k: 0.0 for k in KINDS}
                    for _ in range(args.rounds):
                        for kind in KINDS:
                            best[kind] = max(best[kind], await run_kind(kind, clients, run.id, conc, args.seconds, tag))
                    results[conc] = best
                    for cm in reversed(stack):
                        await cm.__aexit__(None, None, None)
                    cn.cancel_scope.cancel()
        finally:
            proc.terminate()
            proc.wait()
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--concurrency", default="1,16", help="comma-separated loop counts")
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--durability", default="fsync", choices=["fsync", "interval", "memory"])
    ap.add_argument("--json")
    args = ap.parse_args()
    res = trio.run(main, args)
    print(f"claims and pools over TCP, durability {args.durability}, {args.connections} connection(s) max, "
          f"best of {args.rounds} x {args.seconds:g} s (load average {os.getloadavg()[0]:.1f})")
    for conc, r in res.items():
        sub = r["submit"]
        print(f"  {conc:>3} loop(s): submit {sub:8.0f}/s")
        for kind in KINDS[1:]:
            print(f"             {kind:13s} {r[kind]:8.0f} pairs/s  ({2 * r[kind]:8.0f} requests/s; "
                  f"per request vs submit {2 * r[kind] / sub:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": res}, f, indent=2)
