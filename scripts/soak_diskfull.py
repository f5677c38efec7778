"""Soak: a daemon whose disk fills up and empties again, over and over (bounded time).

Runs ``rallypoint serve`` on a small tmpfs (scripts/smallfs.py: a user namespace, no
root needed where those are allowed), drives writers, readers and a worker against it,
and every ``--cycle-s`` seconds fills the filesystem completely (another process takes
every byte) for half a cycle, then frees it. Prints, every few seconds and at the end:
the daemon's RSS, the size of its log, and counts of

* writes acknowledged / refused with UNAVAILABLE (disk full) / failed otherwise,
* reads answered / failed,
* daemon log lines at ERROR and WARNING, and tracebacks (should be 0),
* how long writes took to resume after each free (from ``free`` to the first accepted
  write).

At the end the daemon is stopped (SIGTERM, exit code checked), restarted on the same
filesystem, and every acknowledged write is looked up: none may be missing.

    python3 scripts/soak_diskfull.py --seconds 60
    python3 scripts/soak_diskfull.py --seconds 300 --json soak.json

Exit status 0 when nothing failed (no INTERNAL or other errors, no traceback, no
acknowledged write lost, clean exits), 1 otherwise, 2 when the machine cannot run it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import rallypoint  # noqa: E402
import smallfs  # noqa: E402
from rallypoint.errors import NotFoundError, RallypointError, UnavailableError  # noqa: E402


class Stats:
    def __init__(self) -> None:
        self.writes_ok = 0
        self.writes_unavailable = 0
        self.writes_failed: dict[str, int] = {}
        self.reads_ok = 0
        self.reads_failed: dict[str, int] = {}
        self.acked: list[str] = []  # task ids of acknowledged submits
        self.resume_s: list[float] = []
        self.freed_at: float | None = None
        self.samples: list[dict] = []


async def writer(rs, run, mbx, stats: Stats, stop: trio.Event, rate: float, big_every: int) -> None:
    i = 0
    period = 1.0 / rate
    next_at = trio.current_time()
    while not stop.is_set():
        i += 1
        body = {"i": i, "blob": "x" * 6000} if big_every and i % big_every == 0 else {"i": i}
        try:
            ticket = await mbx.submit(body, scope=run)
            stats.writes_ok += 1
            stats.acked.append(ticket.id)
            if stats.freed_at is not None:
                stats.resume_s.append(time.monotonic() - stats.freed_at)
                stats.freed_at = None
        except UnavailableError:
            stats.writes_unavailable += 1
            await trio.sleep(0.01)  # an impatient client: hammer the refusals
            continue
        except RallypointError as exc:
            stats.writes_failed[exc.code] = stats.writes_failed.get(exc.code, 0) + 1
        next_at += period
        await trio.sleep_until(max(next_at, trio.current_time()))


async def reader(rs, run, stats: Stats, stop: trio.Event) -> None:
    while not stop.is_set():
        try:
            await run.status()
            if stats.acked:
                await rs.task(stats.acked[-1]).status()
            stats.reads_ok += 1
        except RallypointError as exc:
            stats.reads_failed[exc.code] = stats.reads_failed.get(exc.code, 0) + 1
        await trio.sleep(0.005)


async def worker(rs, run, mbx, stats: Stats, stop: trio.Event) -> None:
    while not stop.is_set():
        try:
            d = await mbx.receive(run, wait=0.2, lease_seconds=30)
            if d is not None:
                await d.complete({"ok": True})
                stats.writes_ok += 1
        except UnavailableError:
            stats.writes_unavailable += 1
            await trio.sleep(0.05)
        except RallypointError as exc:
            stats.writes_failed[exc.code] = stats.writes_failed.get(exc.code, 0) + 1


def log_counts(path: Path) -> dict:
    text = path.read_text(errors="replace") if path.exists() else ""
    return {
        "log_bytes": len(text.encode()),
        "log_errors": len(re.findall(r" ERROR ", text)),
        "log_warnings": len(re.findall(r" WARNING ", text)),
        "tracebacks": text.count("Traceback"),
        "refusals_logged": text.count("writes are refused"),
        "resumes_logged": text.count("writes are accepted again"),
        "ballast_released": text.count("released the"),
        "snapshot_failures": text.count("snapshot to "),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="length of the soak (default %(default)s)")
    ap.add_argument("--cycle-s", type=float, default=6.0, help="fill/free period (default %(default)s)")
    ap.add_argument("--size", default="64m", help="tmpfs size (default %(default)s)")
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--rate", type=float, default=100.0, help="submits per second per writer (default %(default)s)")
    ap.add_argument("--big-every", type=int, default=10, help="every Nth submit carries 6 KB (default %(default)s)")
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args()
    if not smallfs.available():
        print("soak_diskfull: needs unshare and tmpfs in a user namespace", file=sys.stderr)
        return 2

    work = Path(tempfile.mkdtemp(prefix="rp-soak-"))
    mnt, log = work / "mnt", work / "daemon.log"
    cmd = [sys.executable, "-m", "rallypoint", "serve", "--listen", "127.0.0.1:0", "--data-dir", str(mnt / "data"),
           "--min-free-mb", "1", "--ballast-mb", "1", "--snapshot-every-s", "2", "--snapshot-retry-s", "2"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    fs = smallfs.SmallFs(mnt, log, cmd, size=args.size, env=env)
    stats = Stats()
    ok = True
    try:
        url = fs.ready()
        print(f"soak: daemon at {url}, tmpfs {args.size} on {mnt}, log {log}", flush=True)

        async def drive() -> None:
            async with rallypoint.connect(url) as rs:
                run = await rs.scopes.create(name="soak")
                mbx = await rs.mailboxes.ensure("soak")
                stop = trio.Event()
                t0 = time.monotonic()
                async with trio.open_nursery() as nursery:
                    for _ in range(args.writers):
                        nursery.start_soon(writer, rs, run, mbx, stats, stop, args.rate, args.big_every)
                    nursery.start_soon(reader, rs, run, stats, stop)
                    nursery.start_soon(worker, rs, run, mbx, stats, stop)
                    cycle = 0
                    while time.monotonic() - t0 < args.seconds:
                        cycle += 1
                        await trio.sleep(args.cycle_s / 2)
                        free_after = await trio.to_thread.run_sync(fs.fill, 0)
                        await trio.sleep(args.cycle_s / 2)
                        await trio.to_thread.run_sync(fs.free)
                        stats.freed_at = time.monotonic()
                        rss = await trio.to_thread.run_sync(fs.rss)
                        entities = (await rs.status()).entities
                        sample = {"t_s": round(time.monotonic() - t0, 1), "cycle": cycle, "rss_bytes": rss,
                                  "entities": entities,
                                  "free_after_fill": free_after, "writes_ok": stats.writes_ok,
                                  "writes_unavailable": stats.writes_unavailable, "reads_ok": stats.reads_ok,
                                  **log_counts(log)}
                        stats.samples.append(sample)
                        print("soak: " + " ".join(f"{k}={v}" for k, v in sample.items()), flush=True)
                    await trio.sleep(2.0)  # let the last resume happen
                    stop.set()

        trio.run(drive)
        code = fs.stop(close=False)
        print(f"soak: daemon exited {code}", flush=True)
        ok &= code == 0
        # Restart on the same filesystem; every acknowledged write must be there.
        url = fs.restart()

        async def verify() -> int:
            missing = 0
            async with rallypoint.connect(url) as rs:
                for tid in stats.acked:
                    try:
                        await rs.task(tid).status()
                    except NotFoundError:
                        missing += 1
            return missing

        missing = trio.run(verify)
        code2 = fs.stop(close=False)
        ok &= code2 == 0 and missing == 0
    finally:
        fs.close()
    counts = log_counts(log)
    report = {
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        "seconds": args.seconds, "cycle_s": args.cycle_s, "tmpfs": args.size, "writers": args.writers,
        "rate_per_writer": args.rate,
        "cycles": len(stats.samples),
        "writes_ok": stats.writes_ok, "writes_unavailable": stats.writes_unavailable,
        "writes_failed_other": stats.writes_failed, "reads_ok": stats.reads_ok, "reads_failed": stats.reads_failed,
        "acked_submits": len(stats.acked), "acked_missing_after_restart": missing,
        "resume_after_free_s": {"n": len(stats.resume_s),
                                "max": round(max(stats.resume_s), 3) if stats.resume_s else None,
                                "mean": round(sum(stats.resume_s) / len(stats.resume_s), 3) if stats.resume_s else None},
        "rss_bytes": {"first": stats.samples[0]["rss_bytes"] if stats.samples else None,
                      "last": stats.samples[-1]["rss_bytes"] if stats.samples else None,
                      "max": max((s["rss_bytes"] for s in stats.samples), default=None)},
        "entities": {"first": stats.samples[0]["entities"] if stats.samples else None,
                     "last": stats.samples[-1]["entities"] if stats.samples else None},
        "exit_codes": [code, code2],
        **counts,
    }
    ok &= not stats.writes_failed and not stats.reads_failed and counts["tracebacks"] == 0
    report["ok"] = bool(ok)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps({"report": report, "samples": stats.samples}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
