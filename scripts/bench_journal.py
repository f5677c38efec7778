#!/usr/bin/env python
"""Benchmark the rallypoint journal (prints figures, asserts nothing).

    python scripts/bench_journal.py [--seconds 3] [--writers 1,16,64] [--records 1000000]
                                    [--dir /work/.bench] [--mode fsync] [--min-free-mb 64]

Measures, on a temporary directory on a real disk (refuses tmpfs unless --allow-tmpfs):
  * plain write+fdatasync latency (reference);
  * Journal.append cost;
  * durable commits/s and durable-ack latency (p50/p99) with W concurrent writer tasks,
    each looping: append(100-byte payload); await wait_durable(lsn);
  * recovery: scan_journal (validate) and iterating all payloads of a 1M-record journal.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from rallypoint.persistence.journal import Journal, scan_journal  # noqa: E402


def fstype(path: str) -> str:
    try:
        out = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "-T", path],
                             capture_output=True, text=True, check=True).stdout.strip()
        return out or "?"
    except Exception:  # noqa: BLE001
        return "?"


def pct(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return float("nan")
    i = min(len(sorted_values) - 1, int(round(p / 100 * (len(sorted_values) - 1))))
    return sorted_values[i]


def bench_fdatasync(d: Path, n: int = 500) -> tuple[float, float]:
    path = d / "fsync-ref"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    ts = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            os.write(fd, b"x" * 116)
            os.fdatasync(fd)
            ts.append(time.perf_counter() - t)
    finally:
        os.close(fd)
        path.unlink()
    ts.sort()
    return pct(ts, 50), pct(ts, 99)


def bench_append(d: Path, n: int = 200_000) -> float:
    j = Journal(d, mode="fsync", next_lsn=1)
    p = b"p" * 100
    t = time.perf_counter()
    for _ in range(n):
        j.append(p)
    per = (time.perf_counter() - t) / n
    trio.run(j.aclose)
    return per


async def bench_writers(d: Path, writers: int, seconds: float, mode: str, min_free: int = 0) -> dict:
    # min_free > 0: the free-space check after every write (what the daemon does).
    j = Journal(d, mode=mode, next_lsn=1, min_free_bytes=min_free)
    lat: list[float] = []
    payload = b"w" * 100
    stop_at = 0.0

    async def writer() -> None:
        perf = time.perf_counter
        append = j.append
        wait = j.wait_durable
        while perf() < stop_at:
            t = perf()
            lsn = append(payload)
            await wait(lsn)
            lat.append(perf() - t)

    async with trio.open_nursery() as nursery:
        await nursery.start(j.run)
        # warm-up
        await j.wait_durable(j.append(payload))
        f0 = j.stats()["fsyncs"]
        lat.clear()
        t0 = time.perf_counter()
        stop_at = t0 + seconds
        async with trio.open_nursery() as inner:
            for _ in range(writers):
                inner.start_soon(writer)
        elapsed = time.perf_counter() - t0
        fsyncs = j.stats()["fsyncs"] - f0
        await j.aclose()
    lat.sort()
    return {
        "writers": writers,
        "commits_per_s": len(lat) / elapsed,
        "p50_us": pct(lat, 50) * 1e6,
        "p99_us": pct(lat, 99) * 1e6,
        "fsyncs": fsyncs,
        "records_per_fsync": len(lat) / fsyncs if fsyncs else float("nan"),
    }


def bench_recovery(d: Path, records: int) -> dict:
    j = Journal(d, mode="fsync", next_lsn=1)
    payload = b"r" * 100
    t = time.perf_counter()
    for _ in range(records):
        j.append(payload)
    trio.run(j.aclose)
    write_s = time.perf_counter() - t
    size = sum(p.stat().st_size for p in (d / "journal").iterdir())
    t = time.perf_counter()
    res = scan_journal(d, 0)
    scan_s = time.perf_counter() - t
    t = time.perf_counter()
    n = 0
    for _lsn, _p in res.iter_records():
        n += 1
    iter_s = time.perf_counter() - t
    assert n == records
    return {"records": records, "bytes": size, "write_s": write_s, "scan_s": scan_s,
            "iter_s": iter_s, "segments": len(res.segments)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3.0, help="duration of each writer run")
    ap.add_argument("--writers", default="1,16,64", help="comma-separated writer counts")
    ap.add_argument("--records", type=int, default=1_000_000, help="records for the recovery scan")
    ap.add_argument("--dir", default=None, help="parent of the temp dir (default: /work/.bench or cwd)")
    ap.add_argument("--mode", default="fsync", choices=["fsync", "interval"])
    ap.add_argument("--allow-tmpfs", action="store_true")
    ap.add_argument("--min-free-mb", type=float, default=0.0,
                    help="free-space reserve of the journal (the daemon's --min-free-mb; 0: no check)")
    args = ap.parse_args()

    parent = args.dir or ("/work/.bench" if os.path.isdir("/work") else os.getcwd())
    os.makedirs(parent, exist_ok=True)
    fs = fstype(parent)
    if fs == "tmpfs" and not args.allow_tmpfs:
        sys.exit(f"{parent} is on tmpfs: fsync numbers would be meaningless (use --dir)")
    base = Path(tempfile.mkdtemp(prefix="bench-journal-", dir=parent))
    print(f"dir {base} (fs {fs}), python {sys.version.split()[0]}, trio {trio.__version__}, "
          f"cpus {os.cpu_count()}")
    try:
        ref50, ref99 = bench_fdatasync(base)
        print(f"plain write+fdatasync: p50 {ref50 * 1e6:.0f} us, p99 {ref99 * 1e6:.0f} us")
        d = base / "append"
        per = bench_append(d)
        print(f"Journal.append (100 B): {per * 1e6:.2f} us/record")
        shutil.rmtree(d)
        for w in [int(x) for x in args.writers.split(",") if x]:
            d = base / f"w{w}"
            r = trio.run(bench_writers, d, w, args.seconds, args.mode, int(args.min_free_mb * (1 << 20)))
            print(f"{args.mode} mode, {w:3d} writers, reserve {args.min_free_mb:g} MiB: "
                  f"{r['commits_per_s']:9.0f} durable commits/s, "
                  f"ack p50 {r['p50_us']:7.0f} us (fsync p50 + {r['p50_us'] - ref50 * 1e6:.0f} us), "
                  f"p99 {r['p99_us']:7.0f} us, {r['fsyncs']} fsyncs, "
                  f"{r['records_per_fsync']:.1f} records/fsync")
            shutil.rmtree(d)
        d = base / "recovery"
        r = bench_recovery(d, args.records)
        print(f"recovery: {r['records']} records, {r['bytes'] / 1e6:.0f} MB in {r['segments']} "
              f"segment(s): scan/validate {r['scan_s']:.2f} s, iterate payloads {r['iter_s']:.2f} s, "
              f"total {r['scan_s'] + r['iter_s']:.2f} s (writing them took {r['write_s']:.2f} s)")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
