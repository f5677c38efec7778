#!/usr/bin/env python
"""``rallypoint.consume()`` throughput: tasks handled per second by one consuming process.

    python scripts/bench_consume.py [--tasks 20000] [--concurrency 32] [--durability fsync]
                                    [--rounds 3] [TREE ...]

For each source tree given (default: this checkout; ``PYTHONPATH=TREE``), each round
starts that tree's ``rallypoint serve`` with a fresh data dir, submits ``--tasks`` no-op
tasks (``submit_many``, batches of 1,000, before the clock starts), then one client
process runs ``consume(..., concurrency=C)`` with a handler that returns at once; the
clock stops when every task is SUCCEEDED (``rs.results``). Prints tasks/s, the daemon's
CPU microseconds per task and the consuming process's (utime+stime from ``/proc``).
Trees alternate within each round. Asserts nothing. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rallypoint.loadtest.runner import SpawnedDaemon  # noqa: E402

CLIENT = r"""
import json, os, sys, time, trio, rallypoint

url, n, conc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def cpu():
    t = os.times()
    return t.user + t.system

async def main():
    async with rallypoint.connect(url) as rs:
        run = await rs.scopes.create(name="consume-bench")
        mbx = await rs.mailboxes.ensure("consume-bench")
        tickets = []
        for k in range(0, n, 1000):
            tickets += await mbx.submit_many([{"i": i} for i in range(k, min(n, k + 1000))], scope=run, details=False)

        async def handler(d):
            return None

        c0, t0 = cpu(), time.perf_counter()
        async with trio.open_nursery() as nursery:
            async def consumer():
                nonlocal stats
                stats = await rallypoint.consume(rs, "consume-bench", run, handler, concurrency=conc)
            stats = None
            nursery.start_soon(consumer)
            infos = await rs.results(tickets, details=False)
            t1, c1 = time.perf_counter(), cpu()
            await run.cancel()
        ok = sum(1 for i in infos if i.state == "SUCCEEDED")
        print(json.dumps({"seconds": t1 - t0, "client_cpu": c1 - c0, "succeeded": ok,
                          "completed": stats.completed if stats else None}))

trio.run(main)
"""


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one(tree: str, a) -> dict:
    tree = os.path.abspath(tree)
    daemon = SpawnedDaemon(a.durability, ["--log-level", "WARNING"], tree=tree)
    try:
        url = daemon.start()
        client = subprocess.Popen([sys.executable, "-c", CLIENT, url, str(a.tasks), str(a.concurrency)],
                                  env=dict(os.environ, PYTHONPATH=tree), cwd=tree, stdout=subprocess.PIPE, text=True)
        # the daemon's CPU over the client's whole life (submission included: an upper bound)
        d0 = _cpu_s(daemon.pid)
        out, _ = client.communicate(timeout=600)
        d1 = _cpu_s(daemon.pid)
        r = json.loads(out.strip().splitlines()[-1])
        r["daemon_cpu"] = d1 - d0
        return r
    finally:
        daemon.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="*", default=["."])
    ap.add_argument("--tasks", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--durability", default="fsync", choices=("fsync", "interval", "memory"))
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    for r in range(a.rounds):
        for tree in a.trees:
            res = one(tree, a)
            n = res["succeeded"]
            print(f"round {r + 1} {tree}: {n / res['seconds']:,.0f} tasks/s ({n:,} SUCCEEDED in {res['seconds']:.2f} s); "
                  f"daemon CPU {1e6 * res['daemon_cpu'] / max(n, 1):.1f} us/task (submission included), "
                  f"consumer CPU {1e6 * res['client_cpu'] / max(n, 1):.1f} us/task", flush=True)


if __name__ == "__main__":
    main()
