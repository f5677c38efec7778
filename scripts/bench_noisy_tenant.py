#!/usr/bin/env python
"""A noisy tenant at its limits beside a quiet one (issue 41 item 4): the quiet tenant's
lifecycle p99, alone and beside, in one run of one daemon.

One ``rallypoint serve`` (fsync durability by default) with two API keys, one per space.
The **quiet** tenant (this process) runs task lifecycles one after another on
``--quiet-loops`` connections -- submit, receive, complete, each timed from the submit
to the complete's answer. The **noisy** tenant (a child process) does what the issue's
tenant did, on ``--noisy-conns`` connections with ``--noisy-loops`` loops each: root
runs without end, timers in one run, 60 KB task inputs, and event subscriptions held
open; it first fills every limit it can reach, then keeps sending at them, taking no
notice of ``retry_after`` (every refusal is re-sent at once).

The rounds alternate: the quiet tenant alone (the noisy one stopped; what it made stays
held), then beside it, ``--rounds`` times; the first round alone runs before the noisy
tenant made anything. Printed: each round's p50/p99 and the noisy tenant's requests and
refusals per second, then the pooled p99 alone and beside and their ratio (the goal:
beside <= 1.5 x alone).

``--memory`` instead measures what each kind of entity costs in memory (RSS of this
process per entity, an in-process coordinator, its event included): the figures the
default limits are sized with (README, Limits).

Usage::

    python scripts/bench_noisy_tenant.py                        # 3 rounds of 8 s, bench limits
    python scripts/bench_noisy_tenant.py --rounds 2 --seconds 10 --limit runs=250000 ...
    python scripts/bench_noisy_tenant.py --memory --n 100000

The machine is shared (2 cores): the daemon, the quiet tenant and the noisy one are
three processes on them; the figures print the load average next to them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: the bench's limits (small enough to reach in seconds): --limit overrides each
BENCH_LIMITS = ["runs=20000", "tasks=20000", "timers=20000", "payload_bytes=256MiB", "watchers=64"]
BIG = "x" * 60_000


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ============================================================================ memory
async def measure_memory(n: int) -> dict[str, float]:
    """Bytes of RSS per entity of each kind (``n`` of each, created through the decide
    path of an in-process coordinator; each with its event in the event log)."""
    from rallypoint import protocol as p
    from rallypoint.actors import Coordinator
    from rallypoint.service import Session

    out: dict[str, float] = {}
    kinds = {
        "root run": lambda c, s, run, i: c.decide(s, p.ScopeCreate()),
        "armed timer": lambda c, s, run, i: c.decide(s, p.TimerCreate(scope_id=run, after_ms=3_600_000)),
        "queued task (input 8 B)": lambda c, s, run, i: c.decide(s, p.TaskSubmit(
            scope_id=run, mailbox="m", input=b"\xa6abcdef")),
        "queued task (input 60 KB)": lambda c, s, run, i: c.decide(s, p.TaskSubmit(
            scope_id=run, mailbox="m", input=_msgpack(BIG))),
    }
    for name, make in kinds.items():
        c = Coordinator(limits={k: None for k in ("runs", "tasks", "timers", "stored", "payload_bytes")})
        s = Session()
        run = c.decide(s, p.ScopeCreate(child_limit=1_000_000)).id
        c.decide(s, p.MailboxEnsure(name="m"))
        m = n if "60 KB" not in name else max(1000, n // 20)
        gc.collect()
        before = _rss()
        for i in range(m):
            make(c, s, run, i)
        gc.collect()
        out[name] = (_rss() - before) / m
        del c
        gc.collect()
    return out


def _msgpack(v) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(v)


# ============================================================================ the noisy tenant
async def _noisy_setup(url: str, key: str) -> str:
    """The noisy tenant's run (made once: its later rounds find the runs limit full)."""
    import rallypoint

    async with rallypoint.connect(url, api_key=key, client_name="noisy-setup") as rs:
        run = await rs.scopes.create(child_limit=1_000_000)
        await rs.mailboxes.ensure("noisy")
        return run.id


async def _noisy(url: str, key: str, run_id: str, conns: int, loops: int, seconds: float, status_path: str) -> None:
    import trio

    import rallypoint
    from rallypoint.errors import LimitError

    counts = {"requests": 0, "refused": 0, "errors": 0}
    first_refusal: dict[str, float] = {}  # loop (runs, timers, tasks) -> seconds to its first refusal
    limits_hit: set[str] = set()  # the limits the refusals named
    t_start = time.monotonic()

    async def hammer(rs, what: str, make) -> None:
        while True:
            counts["requests"] += 1
            try:
                await make()
            except LimitError as e:
                counts["refused"] += 1
                first_refusal.setdefault(what, time.monotonic() - t_start)
                limits_hit.add((e.details or {}).get("limit", "?"))
            except Exception:  # noqa: BLE001 - a bench counts, it does not stop
                counts["errors"] += 1
                await trio.sleep(0.01)

    async def watchers(rs) -> None:
        streams = []
        try:
            while True:
                s = rs.events.watch(start="now")
                counts["requests"] += 1
                try:
                    await s.__aenter__()
                except LimitError as e:
                    counts["refused"] += 1
                    limits_hit.add((e.details or {}).get("limit", "?"))
                    await trio.sleep(0.05)
                    continue
                streams.append(s)
        finally:
            for s in streams:
                with trio.CancelScope(shield=True):
                    await s.__aexit__(None, None, None)

    async def connection(i: int) -> None:
        async with rallypoint.connect(url, api_key=key, client_name=f"noisy-{i}") as rs:
            run = rs.scope(run_id)
            m = rs.mailbox("noisy")
            async with trio.open_nursery() as n:
                for j in range(loops):
                    which = (i * loops + j) % 3
                    if which == 0:
                        n.start_soon(hammer, rs, "runs", lambda: rs.scopes.create())
                    elif which == 1:
                        n.start_soon(hammer, rs, "timers", lambda: run.timers.create(after_seconds=3600))
                    else:
                        n.start_soon(hammer, rs, "tasks", lambda: m.submit(BIG, scope=run))
                if i == 0:
                    n.start_soon(watchers, rs)

    async def report() -> None:
        while True:
            await trio.sleep(0.25)
            with open(status_path, "w") as f:
                json.dump({"counts": counts, "first_refusal": first_refusal, "limits_hit": sorted(limits_hit),
                           "t": time.monotonic() - t_start}, f)

    with trio.move_on_after(seconds):
        async with trio.open_nursery() as n:
            n.start_soon(report)
            for i in range(conns):
                n.start_soon(connection, i)


# ============================================================================ the quiet tenant
async def _quiet(url: str, key: str, loops: int, seconds: float) -> list[float]:
    import trio

    import rallypoint

    lat: list[float] = []

    async def loop(rs, i: int) -> None:
        run = await rs.scopes.create(child_limit=1_000_000)
        m = await rs.mailboxes.ensure(f"quiet-{i}")
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            await m.submit({"n": 1}, scope=run)
            d = await m.receive(run, wait=5)
            await d.complete("ok")
            lat.append((time.perf_counter() - t0) * 1000)
        await run.cancel()

    async with trio.open_nursery() as n:
        for i in range(loops):
            async def one(i=i):
                async with rallypoint.connect(url, api_key=key, client_name=f"quiet-{i}") as rs:
                    await loop(rs, i)
            n.start_soon(one)
    return lat


def _keys(data_dir: str) -> dict[str, str]:
    out = {}
    for space in ("quiet", "noisy"):
        r = subprocess.run([sys.executable, "-m", "rallypoint", "keys", "create", "--data-dir", data_dir,
                            "--space", space, "--permission", "coordination_write", "--permission",
                            "coordination_read", "--permission", "resource_config"],
                           capture_output=True, text=True, check=True, cwd=ROOT)
        out[space] = next(w for w in r.stdout.split() if w.startswith("rpk_"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="alone/beside pairs (default %(default)s)")
    ap.add_argument("--seconds", type=float, default=8.0, help="each phase's measured time (default %(default)s)")
    ap.add_argument("--durability", default="fsync", choices=("fsync", "interval", "memory"),
                    help="the daemon's (default %(default)s)")
    ap.add_argument("--limit", action="append", default=None, metavar="NAME=VALUE",
                    help=f"the daemon's limits (default the bench's: {' '.join(BENCH_LIMITS)}); 'default' for "
                         "the daemon's own defaults")
    ap.add_argument("--quiet-loops", type=int, default=2, help="quiet lifecycles in flight (default %(default)s)")
    ap.add_argument("--noisy-conns", type=int, default=4, help="noisy connections (default %(default)s)")
    ap.add_argument("--noisy-loops", type=int, default=3, help="noisy loops per connection (default %(default)s)")
    ap.add_argument("--noisy-nice", type=int, default=19,
                    help="the noisy client's nice value: it stands for a tenant on other machines, so its own CPU "
                         "is not taken from the quiet client's or the daemon's on this 2-core box; 0: equal "
                         "(default %(default)s)")
    ap.add_argument("--memory", action="store_true", help="measure memory per entity instead")
    ap.add_argument("--n", type=int, default=50_000, help="entities per kind for --memory (default %(default)s)")
    ap.add_argument("--json", help="write the figures here too")
    ap.add_argument("--noisy-child", nargs=6, metavar=("URL", "KEY", "RUN", "CONNS", "LOOPS", "SECONDS"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--status-path", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    import trio

    if args.noisy_child:
        url, key, run_id, conns, loops, secs = args.noisy_child
        trio.run(_noisy, url, key, run_id, int(conns), int(loops), float(secs), args.status_path)
        return 0
    if args.memory:
        per = trio.run(measure_memory, args.n)
        for name, b in per.items():
            print(f"{name:<28} {b:8.0f} B of RSS each (n={args.n if '60 KB' not in name else max(1000, args.n // 20)})")
        if args.json:
            json.dump(per, open(args.json, "w"), indent=2)
        return 0

    from rallypoint.loadtest.runner import SpawnedDaemon

    limits = [] if args.limit == ["default"] else (args.limit or BENCH_LIMITS)
    d = SpawnedDaemon(args.durability, [x for lim in limits for x in ("--limit", lim)])
    os.makedirs(d.data_dir, exist_ok=True)
    keys = _keys(d.data_dir)
    url = d.start()
    status_path = os.path.join(d.dir, "noisy.json")
    noisy_run = trio.run(_noisy_setup, url, keys["noisy"])
    rows = []
    alone_all: list[float] = []
    beside_all: list[float] = []
    try:
        print(f"daemon {url} (--durability {args.durability}; limits {' '.join(limits) or 'the defaults'}); "
              f"quiet: {args.quiet_loops} lifecycles in flight; noisy: {args.noisy_conns} connections x "
              f"{args.noisy_loops} loops; {args.rounds} rounds of {args.seconds:g} s", flush=True)
        for rnd in range(args.rounds):
            for phase in ("alone", "beside"):
                child = None
                if phase == "beside":
                    if os.path.exists(status_path):
                        os.unlink(status_path)
                    child = subprocess.Popen(
                        [sys.executable, os.path.abspath(__file__), "--noisy-child", url, keys["noisy"], noisy_run,
                         str(args.noisy_conns), str(args.noisy_loops), str(args.seconds + 600),
                         "--status-path", status_path], cwd=ROOT,
                        preexec_fn=(lambda: os.nice(args.noisy_nice)) if args.noisy_nice else None)
                    # measured once the noisy tenant is at its limits: refused for every kind
                    deadline = time.monotonic() + 300
                    while time.monotonic() < deadline:
                        time.sleep(0.25)
                        if child.poll() is not None:
                            raise SystemExit(f"the noisy tenant exited ({child.returncode}) before it reached its "
                                             "limits")
                        try:
                            st = json.load(open(status_path))
                        except (OSError, ValueError):
                            continue
                        if all(k in st["first_refusal"] for k in ("runs", "timers", "tasks")):
                            break
                    before = json.load(open(status_path))
                t0 = time.monotonic()
                lat = trio.run(_quiet, url, keys["quiet"], args.quiet_loops, args.seconds)
                dt = time.monotonic() - t0
                row = {"round": rnd + 1, "phase": phase, "lifecycles": len(lat), "p50_ms": _pct(lat, 0.5),
                       "p99_ms": _pct(lat, 0.99), "load": os.getloadavg()[0]}
                if child is not None:
                    after = json.load(open(status_path))
                    child.terminate()
                    child.wait(30)
                    span = after["t"] - before["t"]
                    row["noisy_req_s"] = (after["counts"]["requests"] - before["counts"]["requests"]) / span
                    row["noisy_refused_s"] = (after["counts"]["refused"] - before["counts"]["refused"]) / span
                    row["noisy_limits_hit"] = after["limits_hit"]
                    beside_all += lat
                else:
                    alone_all += lat
                rows.append(row)
                extra = (f"; noisy {row['noisy_req_s']:,.0f} req/s, {row['noisy_refused_s']:,.0f} refused/s"
                         if child is not None else "")
                print(f"round {rnd + 1} {phase:<6} {len(lat):6d} lifecycles in {dt:4.1f} s  p50 {row['p50_ms']:6.2f} "
                      f"ms  p99 {row['p99_ms']:6.2f} ms  (load {row['load']:.2f}){extra}", flush=True)
        a, b = _pct(alone_all, 0.99), _pct(beside_all, 0.99)
        print(f"quiet tenant's lifecycle p99: alone {a:.2f} ms, beside the noisy tenant at its limits {b:.2f} ms "
              f"= {b / a:.2f}x (goal <= 1.5x)")
        with open(status_path) as f:
            st = json.load(f)
        print("the noisy tenant's refusals named the limits: " + ", ".join(st["limits_hit"]))
        if args.json:
            json.dump({"rows": rows, "p99_alone_ms": a, "p99_beside_ms": b, "ratio": b / a}, open(args.json, "w"),
                      indent=2)
    finally:
        d.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
