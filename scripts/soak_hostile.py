#!/usr/bin/env python
"""Soak a spawned daemon with hostile peers, for a bounded time, and report what it cost.

Up to four phases (``--phases``, default all), ``--seconds`` split between them:

1. **connect/reset storm**: ``--storm-procs`` processes loop "connect, (hello,
   (20 requests never read)), close with a TCP RST (SO_LINGER 0)", in three equal
   flavours: before the hello, after it, with unread replies.
2. **never-reading flood**: ``--flooders`` connections (from 127.0.5.2-, 100 an address)
   handshake, then send
   ``scope.list`` requests (about 15 KB of reply each) as fast as the server reads them
   and never read a reply; at the end they are reset too.
3. **silent** (issue 41 item 7): ``--holders`` connections a process (``--storm-procs``),
   spread over eight loopback source addresses a process (127.0.P.2-9, as from a
   botnet), that never send their Hello; the daemon's ``--handshake-timeout`` (10 s)
   drops each, and each is reopened at once.
4. **per peer**: one address (127.0.0.9) opens ``--holders`` connections that send their
   Hello and then sit idle (answering pings: as a real idle client would) and holds
   them; past ``--max-connections-per-peer`` (128) it is refused UNAVAILABLE.

Meanwhile well-behaved clients, from 127.0.0.1 (an address of their own), probe: a
``server.status`` round trip every 10 ms on one connection, and every 100 ms a new
connection (connect, Hello, ``server.status``, close): this is the one that waits
behind, or is refused by, whatever the attackers hold. Before and after each phase the
script prints the daemon's RSS (VmRSS; VmHWM = peak), the size of its log, the log's
ERROR and traceback lines, the probes' latency and their p99 as a multiple of the idle
p99 (the probes alone for ``--idle`` seconds first; issue 41 asks within 2x), and any
probe failure. The daemon is
``rallypoint serve --durability memory`` on a free loopback port with its stderr in a
temporary file (deleted at the end; ``--keep-log`` keeps it), stopped with SIGTERM at the
end (its exit code is printed). Exit status: 0 if the daemon logged no ERROR and no
traceback, no probe failed and it exited 0, else 1 (the ratios are reported, not judged).

Usage::

    python scripts/soak_hostile.py [--seconds 60] [--storm-procs 2] [--flooders 20]
                                   [--phases storm,flood,silent,perpeer] [--holders 600]
                                   [--idle 5] [--log-level INFO] [--keep-log]

Run it with ``PYTHONPATH`` pointing at the checkout to measure (the daemon inherits it).
"""

from __future__ import annotations

import argparse
import collections
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
from _soakprobe import ProbeSamples, connect_from, hold, raise_nofile, sources  # noqa: E402
from rallypoint import wire  # noqa: E402
from rallypoint.transport.framing import FrameParser, encode_frame  # noqa: E402

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
    for i in range(flooders):
        # from addresses of their own (100 connections each, under the cap per peer
        # address): the probes' 127.0.0.1 is not theirs
        s = await trio.open_tcp_stream("127.0.0.1", port, local_address=f"127.0.5.{2 + i // 100}")
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


def _holder_worker(kind: str, port: int, seconds: float, holders: int, proc: int, out) -> None:
    """One process holding ``holders`` connections: ``silent`` ones (no Hello) from
    eight addresses, or ``perpeer`` idle ones (Hello sent) from one; each reopened when
    the daemon closes it. Puts a Counter of what happened on ``out``."""
    raise_nofile()
    got: collections.Counter = collections.Counter()
    srcs = sources(kind, proc)

    async def one(i: int) -> None:
        while True:
            stream = await connect_from(srcs[i % len(srcs)], port, got)
            if stream is None:
                continue
            first = b""
            frames = FrameParser()
            try:
                if kind == "perpeer":
                    await stream.send_all(HELLO)
                while True:
                    data = await stream.receive_some(65536)
                    if not data:
                        break
                    if not first:
                        first = data
                    for body in frames.feed(data):  # answer the server's pings, as a live client does
                        msg = msgspec.msgpack.decode(body)
                        if isinstance(msg, dict) and msg.get("t") == "ping":
                            await stream.send_all(encode_frame(_enc(wire.Pong(msg.get("nonce", 0)))))
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
            finally:
                await trio.aclose_forcefully(stream)
            refused = b"UNAVAILABLE" in first
            got["refused UNAVAILABLE (the cap)" if refused else "closed by the daemon"] += 1
            await trio.sleep(0.2 if refused else 0.05)

    hold(one, holders, seconds)
    out.put(dict(got))


class Probe(ProbeSamples):
    """The well-behaved clients: ``server.status`` every 10 ms on one connection, and a
    new connection (Hello, ``server.status``, close) every 100 ms."""

    def __init__(self, url: str, ramp_s: float = 0.0) -> None:
        super().__init__("tcp", "new tcp", ramp_s=ramp_s)
        self.url = url

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as n:
            await n.start(self._fresh)
            async with rallypoint.connect(self.url) as rs:
                task_status.started()
                while True:
                    t0 = time.perf_counter()
                    await rs.status()
                    self.sample("tcp", t0)
                    await trio.sleep(0.01)

    async def _fresh(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            t0 = time.perf_counter()
            try:
                with trio.fail_after(30):
                    async with rallypoint.connect(self.url, reconnect=False) as rs:
                        await rs.status()
            except Exception as e:  # a refusal, a timeout: each is a failure of the probe
                self.failures[f"new tcp {type(e).__name__}: {str(e)[:80]}"] += 1
            self.sample("new tcp", t0)
            await trio.sleep(0.1)



# ------------------------------------------------------------------------------ report


def snapshot(d: Daemon) -> dict:
    rss, hwm = d.memory()
    size, lines, errors, tracebacks = d.log_counts()
    return {"rss": rss, "hwm": hwm, "log": size, "lines": lines, "errors": errors, "tracebacks": tracebacks}


def row(label: str, s: dict, work: str = "", probe: str = "") -> None:
    print(f"{label:<22} RSS {s['rss'] / MIB:7.1f} MiB (peak {s['hwm'] / MIB:7.1f})  log {s['log']:>11,} B "
          f"{s['lines']:>8,} lines  ERROR {s['errors']:>7,}  tracebacks {s['tracebacks']:>7,}  {work}  {probe}".rstrip())


async def soak(args, d: Daemon) -> dict:
    phase_s = args.seconds / len(args.phases)
    probe = Probe(d.url, args.ramp)
    result: dict = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(probe.run)
        await trio.sleep(0.5)
        probe.take()
        probe.mark()
        await trio.sleep(args.idle)
        row("idle", snapshot(d), f"probes alone for {args.idle:g} s", probe.take(idle=True))
        for kind in args.phases:
            failed = sum(probe.failures.values())
            t0 = time.monotonic()
            probe.mark()
            if kind == "storm":
                counter = multiprocessing.Value("q", 0)
                procs = [multiprocessing.Process(target=_storm_worker, args=(d.port, phase_s, counter))
                         for _ in range(args.storm_procs)]
                for p in procs:
                    p.start()
                await trio.to_thread.run_sync(lambda: [p.join() for p in procs])
                took = time.monotonic() - t0
                work = f"{counter.value:,} connect/reset cycles in {took:.1f} s ({counter.value / took:,.0f}/s)"
            elif kind == "flood":
                before = snapshot(d)
                sent, conns = await _flood(d.port, args.flooders, phase_s)
                during = snapshot(d)  # (the peak, VmHWM, is the flood's if it is above the start's)
                await trio.sleep(0.5)  # let the daemon tear the flood connections down
                per = (during["hwm"] - before["rss"]) / conns / MIB
                work = (f"{conns} never-reading connections sent {sent:,} requests ({sent * len(LIST) / MIB:.1f} MiB); "
                        f"peak RSS over the start {per:.2f} MiB a connection")
                result["flood_peak_mib_per_conn"] = per
            else:
                ctx = multiprocessing.get_context("spawn")  # (a child forked inside trio.run cannot trio.run)
                out = ctx.Queue()
                n = 1 if kind == "perpeer" else args.storm_procs
                procs = [ctx.Process(target=_holder_worker,
                                                 args=(kind, d.port, phase_s, args.holders, i, out))
                         for i in range(n)]
                for p in procs:
                    p.start()
                got: collections.Counter = collections.Counter()
                for _ in procs:
                    got.update(await trio.to_thread.run_sync(out.get))
                await trio.to_thread.run_sync(lambda: [p.join() for p in procs])
                took = time.monotonic() - t0
                work = ", ".join(f"{k} {v:,}" for k, v in sorted(got.items())) + f" in {took:.1f} s"
            row(f"after {kind}", snapshot(d), work, probe.take(phase=kind))
            if sum(probe.failures.values()) > failed:
                print(f"{'':<22} probe failures so far: {dict(probe.failures)}")
        nursery.cancel_scope.cancel()
    result["ratios"] = probe.ratios
    result["ramp_max_s"] = probe.ramps
    result["probe_failures"] = dict(probe.failures)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    phases = ("storm", "flood", "silent", "perpeer")
    ap.add_argument("--seconds", type=float, default=60.0, help="total attack time, split between the phases")
    ap.add_argument("--phases", type=lambda v: tuple(x for x in v.split(",") if x), default=phases,
                    help=f"comma-separated, in order (default all: {','.join(phases)})")
    ap.add_argument("--holders", type=int, default=600,
                    help="connections each process holds in the silent and perpeer phases (default %(default)s)")
    ap.add_argument("--idle", type=float, default=5.0, help="seconds the probes run alone first (the baseline)")
    ap.add_argument("--ramp", type=float, default=2.0,
                    help="a phase's first seconds (the attackers starting and opening their connections), "
                         "summarized apart: the ratios judge the attack held")
    ap.add_argument("--storm-procs", type=int, default=2, help="processes running the connect/reset storm")
    ap.add_argument("--flooders", type=int, default=20, help="never-reading connections in the flood")
    ap.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                    help="the daemon's --log-level (default %(default)s, the daemon's default)")
    ap.add_argument("--keep-log", action="store_true", help="keep the daemon's log and print its path")
    args = ap.parse_args()
    unknown = [x for x in args.phases if x not in phases]
    if unknown or not args.phases:
        ap.error(f"--phases: unknown {unknown} (known: {','.join(phases)})")
    workdir = tempfile.mkdtemp(prefix="rallypoint-soak-")
    d = Daemon(args.log_level, workdir)
    print(f"daemon {d.url} pid {d.proc.pid}, rallypoint {rallypoint.__version__} from "
          f"{os.path.dirname(rallypoint.__file__)}, log level {args.log_level}, {args.seconds:g} s")
    result: dict = {}
    try:
        result = trio.run(soak, args, d)
    finally:
        rc = d.stop()
    final = snapshot_after_stop(d)
    print(f"{'after SIGTERM':<22} log {final['log']:>11,} B {final['lines']:>8,} lines  ERROR {final['errors']:>7,}  "
          f"tracebacks {final['tracebacks']:>7,}  daemon exit code {rc}")
    for phase, ratios in result.get("ratios", {}).items():
        print(f"{'p99 / idle':<22} {phase:<8} " + "  ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
              + "   ramp max " + "  ".join(f"{k} {v * 1e3:.0f} ms" for k, v in result.get("ramp_max_s", {}).get(phase, {}).items()))
    if result.get("probe_failures"):
        print(f"{'probe failures':<22} {result['probe_failures']}")
    if args.keep_log:
        print(f"log: {d.log_path}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    ok = rc == 0 and final["errors"] == 0 and final["tracebacks"] == 0 and not result.get("probe_failures")
    return 0 if ok else 1


def snapshot_after_stop(d: Daemon) -> dict:
    size, lines, errors, tracebacks = d.log_counts()
    return {"log": size, "lines": lines, "errors": errors, "tracebacks": tracebacks}


if __name__ == "__main__":
    sys.exit(main())
