#!/usr/bin/env python
"""Benchmark join-set consumes (prints figures, asserts nothing).

    python scripts/bench_joinsets.py [--children 100] [--sets 30] [--modes embedded,tcp,tcp-fsync]

For each mode, ``--sets`` times: a join set of ``--children`` task children is filled,
every child is received and completed (in reverse order, so completion order differs
from submission order), then the set is drained with ``join_next()``; only the drain is
timed. Each consume is one request (journaled with its index). Also timed: the same
drain re-read by position (``join_next(index=k)``, no journal write).

Modes: ``embedded`` (in-process coordinator, memory durability), ``tcp`` (a
``rallypoint serve`` subprocess, memory durability), ``tcp-fsync`` (the daemon with
``--durability fsync`` on a temporary data dir: every consume waits for its fsync).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import rallypoint  # noqa: E402


def start_daemon(durability: str, data_dir: str | None) -> tuple[subprocess.Popen, str]:
    args = [sys.executable, "-m", "rallypoint", "serve", "--listen", "127.0.0.1:0", "--durability", durability]
    if data_dir:
        args += ["--data-dir", data_dir]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("READY "):
            return proc, line.split()[1]
        if not line and proc.poll() is not None:
            raise RuntimeError(f"daemon exited {proc.returncode}")
    raise RuntimeError("daemon did not become ready")


async def bench(rs, children: int, sets: int) -> dict:
    run = await rs.scopes.create(name="bench-js")
    mbx = await rs.mailboxes.ensure("bench-js")
    drain: list[float] = []
    reread: list[float] = []
    for _ in range(sets):
        js = await run.join_sets.create()
        for i in range(children):
            await js.submit(mbx, i)
        ds = await mbx.receive(run, wait=5, max_messages=children)
        for d in reversed(ds):
            await d.complete(d.input)
        t0 = time.perf_counter()
        for _ in range(children):
            await js.join_next()
        drain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for k in range(children):
            await js.join_next(index=k)
        reread.append(time.perf_counter() - t0)
        await js.close()
    await run.cancel()
    drain.sort()
    reread.sort()
    return {
        "consumes_per_s_median": children / drain[len(drain) // 2],
        "consumes_per_s_best": children / drain[0],
        "rereads_per_s_median": children / reread[len(reread) // 2],
        "latency_ms_median": drain[len(drain) // 2] / children * 1000,
    }


def show(mode: str, r: dict, children: int, sets: int) -> None:
    print(f"{mode:10s} set of {children} children x {sets}: consumes/s median {r['consumes_per_s_median']:,.0f} "
          f"(best {r['consumes_per_s_best']:,.0f}, {r['latency_ms_median']:.3f} ms each); "
          f"positional re-reads/s median {r['rereads_per_s_median']:,.0f}")


async def main(args) -> None:
    for mode in args.modes.split(","):
        if mode == "embedded":
            async with rallypoint.open_embedded() as rs:
                show(mode, await bench(rs, args.children, args.sets), args.children, args.sets)
            continue
        durability = "fsync" if mode == "tcp-fsync" else "memory"
        data_dir = tempfile.mkdtemp(prefix="rp-bench-js-", dir=args.dir) if durability == "fsync" else None
        proc, url = start_daemon(durability, data_dir)
        try:
            async with rallypoint.connect(url) as rs:
                show(mode, await bench(rs, args.children, args.sets), args.children, args.sets)
        finally:
            proc.terminate()
            proc.wait(30)
            if data_dir:
                shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--children", type=int, default=100)
    ap.add_argument("--sets", type=int, default=30)
    ap.add_argument("--modes", default="embedded,tcp,tcp-fsync")
    ap.add_argument("--dir", default=None, help="parent of the fsync data dir (default: system temp)")
    trio.run(main, ap.parse_args())
