#!/usr/bin/env python
"""The floor under ``scripts/bench_snapshot.py``'s stall figure: how late a Trio task
sleeping 1 ms wakes on this machine with nothing else on the loop, and with a thread
writing to LMDB beside it (what a snapshot's writer thread does: ``putmulti`` releases
the GIL around every put and takes it back after, so the loop's thread must win the
GIL back to run).

Prints, per run, the wake-ups' lateness (max, p99.9, p99, p50, ms). Asserts nothing.

    python scripts/bench_loop_lateness.py [--seconds 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time

import lmdb
import trio


async def measure(seconds: float, with_writer: bool) -> str:
    late: list[float] = []
    stop = threading.Event()
    d = tempfile.mkdtemp(prefix="rallypoint-lateness-")
    th = None
    if with_writer:
        env = lmdb.open(d, map_size=1 << 32, sync=False)

        def writer() -> None:
            i = 0
            while not stop.is_set():
                with env.begin(write=True) as txn:
                    txn.cursor().putmulti(((b"k%09d" % (i + j), b"v" * 200) for j in range(500)),
                                          dupdata=False, overwrite=True)
                i += 500

        th = threading.Thread(target=writer, daemon=True)
        th.start()
    try:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            await trio.sleep(0.001)
            late.append(time.perf_counter() - t - 0.001)
    finally:
        stop.set()
        if th is not None:
            th.join()
            env.close()
        shutil.rmtree(d, ignore_errors=True)
    late.sort()
    n = len(late)
    return (f"writer thread {'on ' if with_writer else 'off'}: {n} wake-ups, late max {late[-1] * 1000:.2f} ms, "
            f"p99.9 {late[int(n * 0.999)] * 1000:.2f}, p99 {late[int(n * 0.99)] * 1000:.2f}, "
            f"p50 {late[n // 2] * 1000:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    print("load average %.2f %.2f %.2f" % os.getloadavg())
    for _ in range(a.rounds):
        for w in (False, True):
            print(trio.run(measure, a.seconds, w), flush=True)


if __name__ == "__main__":
    main()
