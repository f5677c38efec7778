"""What ``ops.run`` (a run's lease holders and waiters: the console's run page, runstate's
``status()``, ``GET /ops/runs/{id}``) costs on the coordinator since it also lists the
subtree's leased tasks by their delivery's holder (issue 32 item 2).

An embedded coordinator (in memory) gets a run with ``--queued`` tasks waiting and
``--leased`` of them leased, and another run with ``--elsewhere`` leased tasks (the
node's leased set, which the op scans when the subtree's counts say it holds some);
``--children`` empty child runs are made under the measured run (``ops.run`` walks the
subtree: one look-up per run for its leased tasks). ``ops.run`` of the first run is then
called ``--samples`` times in process (``Service.call``: decode, route, the actor's turn,
encode).

    python3 scripts/bench_ops_run.py --queued 100000 --leased 100 --elsewhere 10000
    python3 scripts/bench_ops_run.py --queued 0 --leased 0 --elsewhere 0 --children 10000

Prints the median and p95 of one call, ms.
"""

from __future__ import annotations

import argparse
import time

import trio

import rallypoint
from rallypoint import protocol as p
from rallypoint.service import Session


async def _fill(q, run, n: int) -> None:
    for i in range(0, n, 1000):
        await q.submit_many(list(range(i, min(n, i + 1000))), scope=run)


async def _lease(q, run, n: int) -> None:
    while n > 0:
        got = await q.receive(run, wait=0, max_messages=min(100, n), lease_seconds=600, holder="bench-worker")
        n -= len(got)


async def main(args) -> None:
    async with rallypoint.open_embedded() as rs:
        q = await rs.mailboxes.ensure("bench-ops-run")
        run, other = await rs.scopes.create(name="measured", child_limit=max(1000, args.children)), \
            await rs.scopes.create(name="elsewhere")
        for i in range(args.children):
            await run.child(name=f"c{i}")
        await _fill(q, other, args.elsewhere)
        await _lease(q, other, args.elsewhere)
        await _fill(q, run, args.queued)
        await _lease(q, run, args.leased)
        svc, op = rs.node.service, p.OpsRun(scope_id=run.id)
        ms = []
        for _ in range(args.samples):
            t0 = time.perf_counter()
            await svc.call(Session(), op)
            ms.append((time.perf_counter() - t0) * 1000)
        ms.sort()
        print(f"ops.run: {args.queued} queued in the run, {args.leased} leased there, {args.elsewhere} leased "
              f"elsewhere, {args.children} child runs: median {ms[len(ms) // 2]:.3f} ms, p95 {ms[int(len(ms) * 0.95)]:.3f} ms "
              f"({args.samples} calls)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queued", type=int, default=100_000, help="tasks waiting in the measured run (default 100000)")
    ap.add_argument("--leased", type=int, default=100, help="of them leased (default 100)")
    ap.add_argument("--elsewhere", type=int, default=10_000, help="tasks leased in another run (default 10000)")
    ap.add_argument("--children", type=int, default=0, help="empty child runs under the measured run (default 0)")
    ap.add_argument("--samples", type=int, default=200, help="calls measured (default 200)")
    trio.run(main, ap.parse_args())
