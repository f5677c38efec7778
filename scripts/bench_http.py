"""Task lifecycle throughput over HTTP with the unchanged runstate SDK 0.3 (``queue`` +
``serve``) against the native TCP client, side by side on one daemon in one run.

A lifecycle is: submit one task, a worker receives it (admit / receive), completes it,
and the producer gets its result. Both sides run ``--concurrency`` producers (each:
submit, then wait for the result, one task at a time) and one worker process serving
``--concurrency`` tasks at once; the producers and the worker are separate processes
from the daemon (the SDK in its own virtual environment, tests/sdk_compat.py). Rounds
alternate HTTP and TCP so the shared machine's load swings hit both alike.

    python3 scripts/bench_http.py --tasks 400 --concurrency 8 --rounds 3

Prints one line per round and the medians (tasks/s, and p50 lifecycle latency in ms).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from sdk_compat import HttpDaemon, sdk_python  # noqa: E402

HTTP_SIDE = r'''
import asyncio, json, os, threading, time
import runstate
n, conc, tag = int(os.environ["N"]), int(os.environ["C"]), os.environ["TAG"]
worker = runstate.Runstate(run=tag, worker="bench-worker")
@worker.queue("bench-" + tag, concurrency=conc)
def handle(x):
    return x + 1
stop = threading.Event()
th = threading.Thread(target=worker.serve, kwargs={"signal": stop})
th.start()
producer = runstate.Runstate(run=tag, worker="bench-producer")
q = producer.queue("bench-" + tag)
async def main():
    lat = []
    it = iter(range(n))
    async def one_producer():
        for i in it:
            t0 = time.perf_counter()
            assert await q.acall(i) == i + 1
            lat.append(time.perf_counter() - t0)
    await q.acall(-1)  # warm up: the run, the queue, the worker's first admit
    t0 = time.perf_counter()
    await asyncio.gather(*(one_producer() for _ in range(conc)))
    return time.perf_counter() - t0, lat
wall, lat = asyncio.run(main())
stop.set(); th.join(60)
lat.sort()
print(json.dumps({"wall": wall, "p50": lat[len(lat) // 2] * 1000, "p99": lat[int(len(lat) * 0.99)] * 1000}))
'''

TCP_SIDE = r'''
import json, os, sys, time
import trio, rallypoint
n, conc, tag = int(os.environ["N"]), int(os.environ["C"]), os.environ["TAG"]
async def main():
    async with rallypoint.connect(os.environ["URL"], api_key=os.environ["KEY"]) as rs:
        run = await rs.scopes.create(name=tag)
        mbx = await rs.mailboxes.ensure("bench-" + tag)
        async def handle(d):
            return d.input + 1
        lat = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: rallypoint.consume(rs, mbx, run, handle, concurrency=conc))
            async def call(i):
                t = await mbx.submit(i, scope=run)
                info = await t.result()
                assert info.outcome == i + 1
            await call(-1)
            it = iter(range(n))
            async def one_producer():
                for i in it:
                    t1 = time.perf_counter()
                    await call(i)
                    lat.append(time.perf_counter() - t1)
            t0 = time.perf_counter()
            async with trio.open_nursery() as p:
                for _ in range(conc):
                    p.start_soon(one_producer)
            wall = time.perf_counter() - t0
            await run.cancel()
        lat.sort()
        print(json.dumps({"wall": wall, "p50": lat[len(lat) // 2] * 1000, "p99": lat[int(len(lat) * 0.99)] * 1000}))
trio.run(main)
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--durability", default="fsync", choices=["fsync", "interval", "memory"])
    args = ap.parse_args()
    py03 = sdk_python("0.3.0")
    with tempfile.TemporaryDirectory() as tmp:
        d = HttpDaemon(os.path.join(tmp, "data"), durability=args.durability).start()
        try:
            res: dict[str, list[dict]] = {"http": [], "tcp": []}
            for r in range(args.rounds):
                for side in ("http", "tcp"):
                    env = {"N": str(args.tasks), "C": str(args.concurrency), "TAG": f"{side}-{r}"}
                    if side == "http":
                        e = d.sdk_env() | env
                        cmd = [py03, "-c", HTTP_SIDE]
                    else:
                        e = dict(os.environ) | env | {"URL": d.tcp_url, "KEY": d.secret,
                                                      "PYTHONPATH": str(REPO)}
                        cmd = [sys.executable, "-c", TCP_SIDE]
                    out = subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=900)
                    if out.returncode != 0:
                        raise SystemExit(f"{side} round failed:\n{out.stdout}\n{out.stderr[-4000:]}")
                    m = json.loads(out.stdout.strip().splitlines()[-1])
                    m["rate"] = args.tasks / m["wall"]
                    res[side].append(m)
                    print(f"round {r} {side:4}: {m['rate']:8.1f} tasks/s  p50 {m['p50']:6.1f} ms  "
                          f"p99 {m['p99']:6.1f} ms", flush=True)
            for side in ("http", "tcp"):
                rates = [m["rate"] for m in res[side]]
                p50 = statistics.median(m["p50"] for m in res[side])
                print(f"median {side:4}: {statistics.median(rates):8.1f} tasks/s  p50 {p50:6.1f} ms  "
                      f"(rounds: {', '.join(f'{x:.0f}' for x in rates)})")
        finally:
            d.stop()


if __name__ == "__main__":
    main()
