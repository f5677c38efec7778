#!/usr/bin/env python
"""Soak a spawned daemon with hostile peers, for a bounded time, and report what it cost.

Two phases, each half of ``--seconds``:

1. **connect/reset storm**: ``--storm-procs`` processes loop "connect, (hello,
   (20 requests never read)), close with a TCP RST (SO_LINGER 0)", in three equal
   flavours: before the hello, after it, with unread replies.
2. **never-reading flood**: ``--flooders`` connections handshake, then send
   ``scope.list`` requests (about 15 KB of reply each) as fast as the server reads them
   and never read a reply; at the end they are reset too.

Meanwhile a well-behaved client does ``server.status`` round trips every 10 ms. Before
and after each phase the script prints the daemon's RSS (VmRSS; VmHWM = peak), the size
of its log, the log's ERROR and traceback lines, and the probe's latency. The daemon is
``rallypoint serve --durability memory`` on a free loopback port with its stderr in a
temporary file (deleted at the end; ``--keep-log`` keeps it), stopped with SIGTERM at the
end (its exit code is printed). Exit status: 0 if the daemon logged no ERROR and no
traceback and exited 0, else 1.

Usage::

    python scripts/soak_hostile.py [--seconds 30] [--storm-procs 2] [--flooders 20]
                                   [--log-level INFO] [--keep-log]

Run it with ``PYTHONPATH`` pointing at the checkout to measure (the daemon inherits it).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import msgspec
import trio

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import rallypoint  # noqa: E402
from rallypoint import wire  # noqa: E402
from rallypoint.transport.framing import encode_frame  # noqa: E402

_enc = msgspec.msgpack.encode
HELLO = encode_frame(_enc(wire.Hello(wire.PROTOCOL_VERSION, None, "soak")))
LIST = encode_frame(_enc(wire.Request(1, msgspec.Raw(_enc({"op": "scope.list", "limit": 100})))))
MIB = 1 << 20


# ------------------------------------------------------------------------------ daemon


class Daemon:
    def __init__(self, log_level: str, workdir: str) -> None:
        self.log_path = os.path.join(workdir, "daemon.log")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rallypoint", "serve", "--listen", "127.0.0.1:0", "--durability", "memory",
             "--log-level", log_level],
            stdout=subprocess.PIPE, stderr=self.log, text=True,
        )
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            raise SystemExit(f"the daemon did not start: {open(self.log_path).read()[-2000:]}")
        self.url = line.split()[1]
        self.port = int(self.url.rsplit(":", 1)[1])

    def memory(self) -> tuple[int, int]:
        """(VmRSS, VmHWM) in bytes."""
        got = {}
        with open(f"/proc/{self.proc.pid}/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    got[key] = int(rest.split()[0]) * 1024
        return got["VmRSS"], got["VmHWM"]

    def log_counts(self) -> tuple[int, int, int, int]:
        """(bytes, lines, ERROR lines, traceback lines) of the log so far."""
        self.log.flush()
        size = os.path.getsize(self.log_path)
        lines = errors = tracebacks = 0
        with open(self.log_path, "rb") as fh:
            for line in fh:
                lines += 1
                if b" ERROR " in line:
                    errors += 1
                if b"Traceback (most recent call last)" in line:
                    tracebacks += 1
        return size, lines, errors, tracebacks

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


# ------------------------------------------------------------------------------ attackers


def _storm_worker(port: int, seconds: float, counter) -> None:
    """One process of the connect/reset storm; adds its cycle count to ``counter``."""
    reqs = LIST * 20
    linger = struct.pack("ii", 1, 0)
    deadline = time.monotonic() + seconds
    n = 0
    while time.monotonic() < deadline:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            flavour = n % 3
            if flavour >= 1:
                s.sendall(HELLO)
                s.recv(4096)
            if flavour == 2:
                s.sendall(reqs)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
            s.close()
            n += 1
        except OSError:
            time.sleep(0.001)
    with counter.get_lock():
        counter.value += n


async def _flood(port: int, flooders: int, seconds: float) -> tuple[int, int]:
    """``flooders`` connections that never read; returns (requests sent, connections)."""
    chunk = LIST * 200
    sent = [0] * flooders
    streams: list[trio.SocketStream] = []
    for _ in range(flooders):
        s = await trio.open_tcp_stream("127.0.0.1", port)
        await s.send_all(HELLO)
        await s.receive_some(4096)  # hello_ok; nothing is read after this
        streams.append(s)

    async def push(i: int, s: trio.SocketStream) -> None:
        try:
            while True:
                await s.send_all(chunk)
                sent[i] += 200
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    with trio.move_on_after(seconds):
        async with trio.open_nursery() as n:
            for i, s in enumerate(streams):
                n.start_soon(push, i, s)
    for s in streams:  # reset, as a killed client would
        s.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await trio.aclose_forcefully(s)
    return sum(sent), flooders


class Probe:
    """The well-behaved client: ``server.status`` every 10 ms."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.samples: list[float] = []

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with rallypoint.connect(self.url) as rs:
            task_status.started()
            while True:
                t0 = time.perf_counter()
                await rs.status()
                self.samples.append(time.perf_counter() - t0)
                await trio.sleep(0.01)

    def take(self) -> str:
        xs, self.samples = sorted(self.samples), []
        if not xs:
            return "no round trip"
        p = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3  # noqa: E731
        return f"n={len(xs)} p50={p(0.5):.1f} ms p99={p(0.99):.1f} ms max={xs[-1] * 1e3:.1f} ms"


# ------------------------------------------------------------------------------ report


def snapshot(d: Daemon) -> dict:
    rss, hwm = d.memory()
    size, lines, errors, tracebacks = d.log_counts()
    return {"rss": rss, "hwm": hwm, "log": size, "lines": lines, "errors": errors, "tracebacks": tracebacks}


def row(label: str, s: dict, work: str = "", probe: str = "") -> None:
    print(f"{label:<22} RSS {s['rss'] / MIB:7.1f} MiB (peak {s['hwm'] / MIB:7.1f})  log {s['log']:>11,} B "
          f"{s['lines']:>8,} lines  ERROR {s['errors']:>7,}  tracebacks {s['tracebacks']:>7,}  {work}  {probe}".rstrip())


async def soak(args, d: Daemon) -> bool:
    half = args.seconds / 2
    probe = Probe(d.url)
    async with trio.open_nursery() as nursery:
        await nursery.start(probe.run)
        await trio.sleep(0.5)
        probe.take()
        row("start", snapshot(d))

        counter = multiprocessing.Value("q", 0)
        procs = [multiprocessing.Process(target=_storm_worker, args=(d.port, half, counter))
                 for _ in range(args.storm_procs)]
        t0 = time.monotonic()
        for p in procs:
            p.start()
        await trio.to_thread.run_sync(lambda: [p.join() for p in procs])
        took = time.monotonic() - t0
        row("after reset storm", snapshot(d),
            f"{counter.value:,} connect/reset cycles in {took:.1f} s ({counter.value / took:,.0f}/s)", probe.take())

        sent, conns = await _flood(d.port, args.flooders, half)
        await trio.sleep(0.5)  # let the daemon tear the flood connections down
        row("after flood", snapshot(d),
            f"{conns} never-reading connections sent {sent:,} requests ({sent * len(LIST) / MIB:.1f} MiB)",
            probe.take())
        nursery.cancel_scope.cancel()
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="total attack time, split between the phases")
    ap.add_argument("--storm-procs", type=int, default=2, help="processes running the connect/reset storm")
    ap.add_argument("--flooders", type=int, default=20, help="never-reading connections in the flood")
    ap.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                    help="the daemon's --log-level (default %(default)s, the daemon's default)")
    ap.add_argument("--keep-log", action="store_true", help="keep the daemon's log and print its path")
    args = ap.parse_args()
    workdir = tempfile.mkdtemp(prefix="rallypoint-soak-")
    d = Daemon(args.log_level, workdir)
    print(f"daemon {d.url} pid {d.proc.pid}, rallypoint {rallypoint.__version__} from "
          f"{os.path.dirname(rallypoint.__file__)}, log level {args.log_level}, {args.seconds:g} s")
    try:
        trio.run(soak, args, d)
    finally:
        rc = d.stop()
    final = snapshot_after_stop(d)
    print(f"{'after SIGTERM':<22} log {final['log']:>11,} B {final['lines']:>8,} lines  ERROR {final['errors']:>7,}  "
          f"tracebacks {final['tracebacks']:>7,}  daemon exit code {rc}")
    if args.keep_log:
        print(f"log: {d.log_path}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if rc == 0 and final["errors"] == 0 and final["tracebacks"] == 0 else 1


def snapshot_after_stop(d: Daemon) -> dict:
    size, lines, errors, tracebacks = d.log_counts()
    return {"log": size, "lines": lines, "errors": errors, "tracebacks": tracebacks}


if __name__ == "__main__":
    sys.exit(main())
