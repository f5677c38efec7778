#!/usr/bin/env python
"""Echo round-trip benchmark of the rallypoint TCP transport.

The server (``rallypoint.transport.Server`` with a trivial echo dispatcher) runs in a
separate process, the client in this one, so the two cores are used as in production.

Scenarios: sequential on one connection; 16 connections, each sequential; 64 requests
in flight on one connection. Each is measured with two clients:

* ``sdk``: the real client, :class:`rallypoint.transport.Connection` (anyio on Trio),
  one task per outstanding call;
* ``raw``: a minimal hand-pipelined Trio socket client (measures the server alone).

Usage::

    python scripts/bench_transport_echo.py [--seconds 3] [--client sdk,raw] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import struct
import subprocess
import sys
import time

import msgspec
import trio

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rallypoint import wire  # noqa: E402
from rallypoint.transport import Server, connect_transport  # noqa: E402
from rallypoint.transport.framing import FrameParser, encode_frame, pack_uint  # noqa: E402
from rallypoint.transport.testing import EchoDispatcher  # noqa: E402

BODY = msgspec.msgpack.encode({"op": "echo", "n": 12345})
HDR = struct.Struct(">I")


# ---------------------------------------------------------------- server process

async def _serve_bare(port: int) -> None:
    """Baseline: a bare Trio + msgspec echo server (no rallypoint Server), same frames."""
    dec = msgspec.msgpack.Decoder(wire.ClientFrame)
    enc = msgspec.msgpack.Encoder()

    async def handler(stream: trio.SocketStream) -> None:
        parser = FrameParser()
        hello = True
        while True:
            data = await stream.receive_some(65536)
            if not data:
                return
            out = bytearray()
            for f in parser.feed(data):
                msg = dec.decode(f)
                if hello:
                    reply = enc.encode(wire.HelloOk(wire.PROTOCOL_VERSION, "bare"))
                    hello = False
                else:
                    reply = enc.encode(wire.Ok(msg.id, msgspec.Raw(bytes(msg.body))))
                out += HDR.pack(len(reply))
                out += reply
            await stream.send_all(out)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, port, host="127.0.0.1"))
        print(f"PORT {listeners[0].socket.getsockname()[1]}", flush=True)
        await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)
        nursery.cancel_scope.cancel()


async def _serve(port: int) -> None:
    server = Server(EchoDispatcher(), idle_ping_interval=None)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve, None, "127.0.0.1", port)
        print(f"PORT {server.port}", flush=True)
        # Stop when stdin closes (parent exits).
        await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)
        print(json.dumps(server.statistics()), file=sys.stderr, flush=True)
        nursery.cancel_scope.cancel()


# ----------------------------------------------------------------- measurements

def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc), seconds; NaN elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return float("nan")


def _summary(name: str, count: int, elapsed: float, lat: list[float], server_cpu: float = float("nan")) -> dict:
    lat.sort()
    p = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1e6 if lat else float("nan")  # noqa: E731
    r = {"scenario": name, "requests": count, "seconds": round(elapsed, 3), "rps": round(count / elapsed),
         "p50_us": round(p(0.50), 1), "p99_us": round(p(0.99), 1),
         "server_cpu_pct": round(100 * server_cpu / elapsed), "server_cpu_us_per_req": round(1e6 * server_cpu / count, 1)}
    print(f"  {name:<28} {r['rps']:>9,} req/s   p50 {r['p50_us']:>8.1f} us   p99 {r['p99_us']:>8.1f} us"
          f"   server CPU {r['server_cpu_pct']:>3}% ({r['server_cpu_us_per_req']:.1f} us/req)", flush=True)
    return r


async def sdk_workers(url: str, conns: int, per_conn: int, seconds: float) -> tuple[int, float, list[float]]:
    lat: list[float] = []
    count = 0
    clock = time.perf_counter
    stop_at = 0.0

    async def worker(conn) -> None:
        nonlocal count
        call = conn.call
        while True:
            t0 = clock()
            if t0 >= stop_at:
                return
            await call(BODY)
            lat.append(clock() - t0)
            count += 1

    opened = []
    async with trio.open_nursery() as n:
        from contextlib import AsyncExitStack
        async with AsyncExitStack() as stack:
            for _ in range(conns):
                opened.append(await stack.enter_async_context(connect_transport(url)))
            for c in opened:  # warm-up
                await c.call(BODY)
            start = clock()
            stop_at = start + seconds
            async with trio.open_nursery() as wn:
                for c in opened:
                    for _ in range(per_conn):
                        wn.start_soon(worker, c)
            elapsed = clock() - start
        n.cancel_scope.cancel()
    return count, elapsed, lat


async def raw_conn(
    port: int, window: int, stop_at: float, lat: list[float], counter: list[int], body: bytes | None = None
) -> None:
    """Keep ``window`` requests outstanding on one raw connection until stop_at.

    ``body`` is the encoded request body (default: the echo op). An error reply stops
    the run (a benchmark must not count failures as throughput)."""
    req_body = BODY if body is None else body
    clock = time.perf_counter
    s = await trio.open_tcp_stream("127.0.0.1", port)
    await s.send_all(encode_frame(msgspec.msgpack.encode(wire.Hello(wire.PROTOCOL_VERSION))))
    parser = FrameParser()
    dec = msgspec.msgpack.Decoder(wire.ServerFrame)
    got: list = []
    while not got:
        got = parser.feed(await s.receive_some(65536))
    sent_at: dict[int, float] = {}
    next_id = 1

    def frame(rid: int) -> bytes:
        env = b"\x83\xa1t\xa3req\xa2id" + pack_uint(rid) + b"\xa4body" + req_body
        return HDR.pack(len(env)) + env

    out = bytearray()
    now = clock()
    for _ in range(window):
        out += frame(next_id)
        sent_at[next_id] = now
        next_id += 1
    await s.send_all(out)
    outstanding = window
    while outstanding:
        data = await s.receive_some(65536)
        if not data:
            break
        now = clock()
        out = bytearray()
        for f in parser.feed(data):
            msg = dec.decode(f)
            if type(msg) is wire.Err:
                raise SystemExit(f"server error: {msg.code} {msg.message}")
            lat.append(now - sent_at.pop(msg.id))
            counter[0] += 1
            outstanding -= 1
            if now < stop_at:
                out += frame(next_id)
                sent_at[next_id] = now
                next_id += 1
                outstanding += 1
        if out:
            await s.send_all(out)
    await s.aclose()


async def raw_workers(port: int, conns: int, window: int, seconds: float) -> tuple[int, float, list[float]]:
    lat: list[float] = []
    counter = [0]
    start = time.perf_counter()
    async with trio.open_nursery() as n:
        for _ in range(conns):
            n.start_soon(raw_conn, port, window, start + seconds, lat, counter)
    return counter[0], time.perf_counter() - start, lat


SCENARIOS = [("sequential, 1 conn", 1, 1), ("16 conns, sequential each", 16, 1), ("64 in flight, 1 conn", 1, 64)]


async def run_client(port: int, seconds: float, clients: list[str], server_pid: int) -> list[dict]:
    url = f"tcp://127.0.0.1:{port}"
    results = []
    for client in clients:
        print(f"client={client}", flush=True)
        for name, conns, window in SCENARIOS:
            cpu0 = _cpu_seconds(server_pid)
            if client == "sdk":
                count, elapsed, lat = await sdk_workers(url, conns, window, seconds)
            else:
                count, elapsed, lat = await raw_workers(port, conns, window, seconds)
            r = _summary(name, count, elapsed, lat, _cpu_seconds(server_pid) - cpu0)
            r["client"] = client
            results.append(r)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--client", default="sdk,raw", help="comma list of sdk,raw")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--bare", action="store_true", help="baseline: bare Trio+msgspec echo server instead of Server")
    args = ap.parse_args()
    if args.serve:
        prof = os.environ.get("RALLYPOINT_BENCH_PROFILE")  # dump a cProfile of the server here
        if prof:
            import cProfile

            cProfile.runctx("trio.run(_serve_bare if args.bare else _serve, args.port)", globals(), locals(), prof)
        else:
            trio.run(_serve_bare if args.bare else _serve, args.port)
        return
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve", "--port", str(args.port)]
        + (["--bare"] if args.bare else []),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        if not line.startswith("PORT "):
            raise SystemExit(f"server did not start: {line!r}")
        port = int(line.split()[1])
        print(f"server pid {proc.pid} on 127.0.0.1:{port}; {os.cpu_count()} cpus; {args.seconds:g}s per scenario")
        results = trio.run(run_client, port, args.seconds, args.client.split(","), proc.pid)
    finally:
        proc.stdin.close()
        proc.wait(10)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
