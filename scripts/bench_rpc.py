#!/usr/bin/env python
"""``run.status()`` round trips over TCP against a ``rallypoint serve`` SUBPROCESS.

Prints figures, asserts nothing. For each durability (``memory``, ``fsync``):

* sequential on one connection;
* 16 connections, each sequential: from this process, and from separate client
  processes (``--procs``, 4 by default, 16/procs connections each) in case one Python
  client process is the bottleneck;
* 64 requests in flight on one connection.

Each scenario runs with two clients: ``sdk`` (``rallypoint.connect`` + ``run.status()``,
decoding the reply into a RunStatus, one task per outstanding call) and ``raw`` (a
hand-pipelined Trio socket client sending pre-encoded ``scope.status`` frames: measures
the server). Server CPU is the daemon's utime+stime over the scenario.

Then, for comparison in the same run, the bare Trio+msgspec echo baseline and the
rallypoint transport echo (``scripts/bench_transport_echo.py --bare`` / without), and
the memory of idle runs: 100k runs created through an embedded coordinator, RSS delta
per run (target <= 2 KiB), with what dominates.

Usage::

    python scripts/bench_rpc.py [--seconds 2] [--durability memory,fsync] [--procs 4]
                                [--skip-echo] [--skip-rss] [--runs 100000]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

import msgspec
import trio

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import rallypoint  # noqa: E402
from bench_transport_echo import raw_conn  # noqa: E402  (same folder: the raw pipelined client)
from rallypoint import protocol as p  # noqa: E402
from rallypoint import wire  # noqa: E402
from rallypoint.transport.framing import FrameParser, encode_frame, pack_uint  # noqa: E402

HDR = struct.Struct(">I")


def _cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return float("nan")


def _pct(lat: list[float], q: float) -> float:
    return lat[min(len(lat) - 1, int(q * len(lat)))] * 1e6 if lat else float("nan")


def _report(name: str, count: int, elapsed: float, lat: list[float], server_cpu: float, client_cpu: float) -> dict:
    lat.sort()
    r = {
        "scenario": name,
        "requests": count,
        "rps": round(count / elapsed),
        "p50_us": round(_pct(lat, 0.5), 1),
        "p99_us": round(_pct(lat, 0.99), 1),
        "server_cpu_pct": round(100 * server_cpu / elapsed),
        "client_cpu_pct": round(100 * client_cpu / elapsed),
        "server_us_per_req": round(1e6 * server_cpu / max(count, 1), 1),
    }
    print(
        f"  {name:<38} {r['rps']:>8,}/s  p50 {r['p50_us']:>7.1f} us  p99 {r['p99_us']:>8.1f} us"
        f"  server CPU {r['server_cpu_pct']:>3}% ({r['server_us_per_req']:.1f} us/req)"
        f"  client CPU {r['client_cpu_pct']:>3}%",
        flush=True,
    )
    return r


# ------------------------------------------------------------------------ clients


def _status_body(scope_id: str) -> bytes:
    return p.encoder.encode(p.ScopeStatus(scope_id=scope_id))


async def sdk_clients(url: str, scope_id: str, conns: int, window: int, seconds: float):
    clock = time.perf_counter
    lat: list[float] = []
    count = 0
    stop_at = 0.0

    async def worker(rs) -> None:
        nonlocal count
        run = rs.scope(scope_id)
        while True:
            t0 = clock()
            if t0 >= stop_at:
                return
            await run.status()
            lat.append(clock() - t0)
            count += 1

    from contextlib import AsyncExitStack

    async with AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(rallypoint.connect(url)) for _ in range(conns)]
        for rs in clients:
            await rs.scope(scope_id).status()  # warm-up
        start = clock()
        stop_at = start + seconds
        async with trio.open_nursery() as n:
            for rs in clients:
                for _ in range(window):
                    n.start_soon(worker, rs)
        elapsed = clock() - start
    return count, elapsed, lat


async def raw_clients(port: int, scope_id: str, conns: int, window: int, seconds: float):
    body = _status_body(scope_id)
    lat: list[float] = []
    counter = [0]
    start = time.perf_counter()
    async with trio.open_nursery() as n:
        for _ in range(conns):
            n.start_soon(raw_conn, port, window, start + seconds, lat, counter, body)
    return counter[0], time.perf_counter() - start, lat


def client_proc_main(args) -> None:
    """A separate client process: runs one scenario share, prints JSON."""
    url = f"tcp://127.0.0.1:{args.port}"
    if args.kind == "sdk":
        count, elapsed, lat = trio.run(sdk_clients, url, args.scope, args.conns, args.window, args.seconds)
    else:
        count, elapsed, lat = trio.run(raw_clients, args.port, args.scope, args.conns, args.window, args.seconds)
    json.dump({"count": count, "elapsed": elapsed, "lat": lat}, sys.stdout)


def multi_proc(kind: str, port: int, scope_id: str, procs: int, conns_each: int, seconds: float):
    cmd = [sys.executable, os.path.abspath(__file__), "--client-proc", "--kind", kind, "--port", str(port),
           "--scope", scope_id, "--conns", str(conns_each), "--window", "1", "--seconds", str(seconds)]
    ps = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    outs = [json.loads(pr.communicate()[0]) for pr in ps]  # their CPU: _children_cpu()
    lat = [x for o in outs for x in o["lat"]]
    return sum(o["count"] for o in outs), max(o["elapsed"] for o in outs), lat


def _children_cpu() -> float:
    t = os.times()
    return t.children_user + t.children_system


# ------------------------------------------------------------------------ daemon


class Daemon:
    def __init__(self, durability: str, data_dir: str | None) -> None:
        args = [sys.executable, "-m", "rallypoint", "serve", "--listen", "127.0.0.1:0", "--durability", durability,
                "--log-level", "WARNING"]
        if data_dir:
            args += ["--data-dir", data_dir]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=os.path.join(HERE, ".."))
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            raise SystemExit(f"daemon did not start: {line!r}")
        self.url = line.split()[1]
        self.port = int(self.url.rsplit(":", 1)[1])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def bench_daemon(durability: str, seconds: float, procs: int, clients: list[str]) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Daemon(durability, os.path.join(tmp, "data") if durability != "memory" else None)
        try:
            async def make_run():
                async with rallypoint.connect(d.url) as rs:
                    return (await rs.scopes.create(name="bench")).id

            scope_id = trio.run(make_run)
            print(f"\n== run.status() over TCP, daemon pid {d.proc.pid}, --durability {durability} ==", flush=True)
            for kind in clients:
                for name, conns, window in [("sequential, 1 conn", 1, 1), ("16 conns, 1 client process", 16, 1),
                                            ("64 in flight, 1 conn", 1, 64)]:
                    cpu0, ccpu0 = _cpu_seconds(d.proc.pid), time.process_time()
                    if kind == "sdk":
                        count, elapsed, lat = trio.run(sdk_clients, d.url, scope_id, conns, window, seconds)
                    else:
                        count, elapsed, lat = trio.run(raw_clients, d.port, scope_id, conns, window, seconds)
                    r = _report(f"{kind}: {name}", count, elapsed, lat, _cpu_seconds(d.proc.pid) - cpu0,
                                time.process_time() - ccpu0)
                    r.update(client=kind, durability=durability)
                    results.append(r)
                    if conns == 16 and procs > 1:
                        cpu0, ch0 = _cpu_seconds(d.proc.pid), _children_cpu()
                        count, elapsed, lat = multi_proc(kind, d.port, scope_id, procs, 16 // procs, seconds)
                        r = _report(f"{kind}: 16 conns, {procs} client processes", count, elapsed, lat,
                                    _cpu_seconds(d.proc.pid) - cpu0, _children_cpu() - ch0)
                        r.update(client=kind, durability=durability)
                        results.append(r)
        finally:
            d.stop()
    return results


# ------------------------------------------------------------------------ echo baseline


def echo_baselines(seconds: float) -> None:
    script = os.path.join(HERE, "bench_transport_echo.py")
    for label, extra in [("bare Trio+msgspec echo server (--bare)", ["--bare"]),
                         ("rallypoint transport Server, echo dispatcher", [])]:
        print(f"\n== baseline: {label}, raw client ==", flush=True)
        out = subprocess.run([sys.executable, script, "--client", "raw", "--seconds", str(seconds), *extra],
                             capture_output=True, text=True)
        for line in out.stdout.splitlines():
            if "req/s" in line:
                print(line, flush=True)
        if out.returncode:
            print(out.stderr[-2000:])


# ------------------------------------------------------------------------ RSS per run


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_main(n: int) -> None:
    """In a fresh process: RSS delta per idle run created through the coordinator."""
    from rallypoint.actors import Coordinator
    from rallypoint.service import Session

    coord = Coordinator()
    session = Session()
    op = p.ScopeCreate(name="idle-run")
    coord.decide(session, op)  # warm-up: tables, caches
    gc.collect()
    base = _rss()
    t0 = time.perf_counter()
    for _ in range(n):
        coord.decide(session, op)
    took = time.perf_counter() - t0
    gc.collect()
    delta = _rss() - base
    s = next(iter(coord.runs.table.values()))
    parts = {
        "ScopeState object": sys.getsizeof(s),
        "id string (scp_...)": sys.getsizeof(s.id),
        "scopes dict entry (amortized)": sys.getsizeof(coord.runs.table) / max(len(coord.runs.table), 1),
        "dirty set entry (amortized)": sum(map(sys.getsizeof, [coord.dirty, *coord._dirty_full])) / max(coord.dirty_count(), 1),
    }
    print(f"\n== memory: {n:,} idle runs via an embedded coordinator (created in {took:.2f} s, "
          f"{n / took:,.0f}/s) ==")
    print(f"  RSS delta {delta / 2**20:.1f} MiB = {delta / n:,.0f} bytes per run "
          f"({delta * 100_000 / n / 2**20:.1f} MiB per 100k runs; target <= 2048 B/run)")
    for k, v in parts.items():
        print(f"    {k:<32} {v:>7.0f} B")
    print(f"    (name strings are shared; dirty set holds {coord.dirty_count():,} ids in memory mode)")


# ------------------------------------------------------------------------ main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--durability", default="memory,fsync")
    ap.add_argument("--client", default="sdk,raw")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--runs", type=int, default=100_000)
    ap.add_argument("--skip-echo", action="store_true")
    ap.add_argument("--skip-rss", action="store_true")
    ap.add_argument("--json")
    # internal
    ap.add_argument("--client-proc", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rss", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kind", default="raw", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--scope", default="", help=argparse.SUPPRESS)
    ap.add_argument("--conns", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--window", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client_proc:
        return client_proc_main(args)
    if args.rss:
        return rss_main(args.runs)
    print(f"{os.cpu_count()} cpus; python {sys.version.split()[0]}; {args.seconds:g} s per scenario")
    results = []
    for durability in args.durability.split(","):
        results += bench_daemon(durability, args.seconds, args.procs, args.client.split(","))
    if not args.skip_echo:
        echo_baselines(args.seconds)
    if not args.skip_rss:
        subprocess.run([sys.executable, os.path.abspath(__file__), "--rss", "--runs", str(args.runs)])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
