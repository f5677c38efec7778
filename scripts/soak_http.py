#!/usr/bin/env python
"""Soak a spawned daemon's HTTP listener with hostile clients, for a bounded time, and
report what it cost (the HTTP counterpart of scripts/soak_hostile.py; issue 34).

Up to eight phases (``--phases``, default all), ``--seconds`` split between them, each
run by ``--procs`` processes. Four send hostile requests:

1. **empty**: connect and close without a request (half with FIN, half with a TCP RST).
2. **aborted**: send a request head announcing a 10,000-byte body, 14 bytes of it, close
   (FIN or RST): the client gone mid-body.
3. **deep / oversize ints** (keep-alive): bodies nested 1,000 and 100,000 levels (in a
   field the endpoint ignores), ``limitMinor`` 10^26 (a number and a string), a 30-digit
   integer in a payload: each must be 400 VALIDATION_FAILED.
4. **huge**: a head announcing 100 MiB, then 1 MiB chunks until the answer comes (at most
   8 MiB); and a chunked body past 1 MiB: each must be 400 before it is all sent.

Four hold connections without using them (issue 41 item 7), ``--holders`` connections a
process, spread over eight loopback source addresses a process (127.0.P.2-9: so the cap
per peer address is met by each address and the listener's ``--max-connections`` by all
of them, as from a botnet), each reopened as soon as the daemon closes it:

5. **slowloris**: a request head trickled, one header line every second: the daemon's
   ``--header-timeout`` (10 s) cuts each.
6. **keep-alive**: one request, then the connection held idle: ``--http-keep-alive``
   (30 s) closes it, sooner when the slots are all taken (the idlest is evicted).
7. **slow body**: a head announcing 100,000 bytes, then 10 bytes a second: 408 after
   ``--body-timeout`` (30 s).
8. **per peer**: one address opens ``--holders`` x ``--procs`` silent connections and
   holds them; past ``--max-connections-per-peer`` (128) it is answered 503.

Meanwhile well-behaved clients probe (from 127.0.0.1, an address of their own): an HTTP ``GET`` of a scope on a keep-alive
connection and a TCP ``server.status``, every 10 ms, and an HTTP ``GET`` on a new
connection every 100 ms (it waits behind whatever the listener has not accepted yet).
After each phase the script prints the daemon's descriptors (``/proc/PID/fd``), the HTTP
listener's accept queue (``ss``: connections the kernel completed, not accepted yet),
RSS (VmRSS; peak VmHWM), its log lines by level and tracebacks, the phase's answers by
status and its failures (timeouts, connections refused or cut, any 5xx), and the
probes' latency with its p99 as a multiple of the idle p99 (the probes alone, measured
for ``--idle`` seconds before the first phase; issue 41 asks within 2x); then it waits for the accept queue to empty (at most 60 s) and says how
long that took. At the end it waits (at most 30 s) for the descriptors to come back to
where they were before the first phase, and prints how long that took. The daemon is ``rallypoint serve --durability memory --http 127.0.0.1:0`` with
its stderr in a temporary file (deleted at the end; ``--keep-log`` keeps it), optionally
under an RLIMIT_NOFILE of ``--nofile`` descriptors, stopped with SIGTERM (exit code
printed). Exit status 0 if the daemon logged no ERROR and no traceback, answered no 5xx,
gave its descriptors back, the probes never failed and it exited 0; else 1 (the p99
ratios are reported, not judged: they depend on the machine).

Usage::

    python scripts/soak_http.py [--seconds 80] [--procs 2] [--phases empty,...,perpeer]
                                [--holders 600] [--idle 5] [--nofile N] [--max-connections N]
                                [--log-level INFO] [--keep-log]

Run it with ``PYTHONPATH`` pointing at the checkout to measure (the daemon inherits it).
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

import httpx
import trio

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import rallypoint  # noqa: E402
from _soakprobe import ProbeSamples, connect_from, hold, raise_nofile, sources  # noqa: E402

MIB = 1 << 20
RST = struct.pack("ii", 1, 0)
SCOPES = "/v1/spaces/default/scopes"


# ------------------------------------------------------------------------------ daemon


class Daemon:
    def __init__(self, args, workdir: str) -> None:
        self.log_path = os.path.join(workdir, "daemon.log")
        self.log = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", "rallypoint", "serve", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
               "--durability", "memory", "--log-level", args.log_level]
        if args.max_connections:
            cmd += ["--max-connections", str(args.max_connections)]
        nofile = args.nofile

        def limit() -> None:
            if nofile:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, preexec_fn=limit)
        self.url = self.http = ""
        for line in self.proc.stdout:
            if line.startswith("READY "):
                self.url = line.split()[1]
            elif line.startswith("HTTP "):
                self.http = line.split()[1]
                break
        if not self.http:
            raise SystemExit(f"the daemon did not start: {open(self.log_path).read()[-2000:]}")
        self.port = int(self.http.rsplit(":", 1)[1])

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def accept_queue(self) -> int:
        """Connections the kernel completed that the HTTP listener has not accepted yet
        (the LISTEN socket's Recv-Q, from ``ss``)."""
        out = subprocess.run(["ss", "-ltnH", f"sport = :{self.port}"], capture_output=True, text=True).stdout
        return sum(int(line.split()[1]) for line in out.splitlines() if line.strip())

    def memory(self) -> tuple[int, int]:
        """(VmRSS, VmHWM) in bytes."""
        got = {}
        with open(f"/proc/{self.proc.pid}/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    got[key] = int(rest.split()[0]) * 1024
        return got["VmRSS"], got["VmHWM"]

    def log_counts(self) -> dict:
        """Lines of the log so far by level, tracebacks, bytes."""
        self.log.flush()
        out = collections.Counter()
        with open(self.log_path, "rb") as fh:
            for line in fh:
                out["lines"] += 1
                for level in (b"DEBUG", b"INFO", b"WARNING", b"ERROR", b"CRITICAL"):
                    if b" %s " % level in line:
                        out[level.decode()] += 1
                if b"Traceback (most recent call last)" in line:
                    out["tracebacks"] += 1
        out["bytes"] = os.path.getsize(self.log_path)
        return out

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


# ------------------------------------------------------------------------------ attackers


def _read_answer(s: socket.socket) -> int:
    """The status of one HTTP/1.1 answer (its body read, by content-length)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("closed before an answer")
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    n = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            n = int(v)
    while len(body) < n:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("closed mid-answer")
        body += chunk
    return int(head.split()[1])


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _post(path: str, body: bytes, method: str = "POST") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nhost: HOSTPORT\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


HOSTILE_BODIES = [
    _post(SCOPES, b'{"name": "deep", "ignored": ' + _nested(1_000) + b"}"),
    _post(SCOPES, b'{"name": "deeper", "ignored": ' + _nested(100_000) + b"}"),
    _post("/v1/spaces/default/budgets/by-name/soak", b'{"limitMinor": 100000000000000000000000000}', "PUT"),
    _post("/v1/spaces/default/budgets/by-name/soak", b'{"limitMinor": "100000000000000000000000000"}', "PUT"),
    _post(SCOPES, b'{"name": "int", "ignored": {"input": 123456789012345678901234567890}}'),
]


def _host(data: bytes, port: int) -> bytes:
    """``data`` with its Host header naming the daemon's listen address (the daemon
    answers 421 to a Host it was not named by: the attack would test that instead)."""
    return data.replace(b"HOSTPORT", f"127.0.0.1:{port}".encode())


def _worker(kind: str, port: int, seconds: float, out) -> None:
    """One attacking process; puts a Counter of what happened on ``out``."""
    got: collections.Counter = collections.Counter()
    deadline = time.monotonic() + seconds
    n = 0
    keep: socket.socket | None = None
    while time.monotonic() < deadline:
        n += 1
        try:
            if kind == "empty":
                s = socket.create_connection(("127.0.0.1", port), timeout=30)
                if n % 2:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RST)
                s.close()
                got["connections"] += 1
            elif kind == "aborted":
                s = socket.create_connection(("127.0.0.1", port), timeout=30)
                s.sendall(_host(b"POST " + SCOPES.encode() + b" HTTP/1.1\r\nhost: HOSTPORT\r\ncontent-length: 10000"
                                b'\r\n\r\n{"name": "cut', port))
                if n % 2:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RST)
                s.close()
                got["requests cut mid-body"] += 1
            elif kind == "deep":
                if keep is None:
                    keep = socket.create_connection(("127.0.0.1", port), timeout=30)
                keep.sendall(_host(HOSTILE_BODIES[n % len(HOSTILE_BODIES)], port))
                got[f"status {_read_answer(keep)}"] += 1
            elif kind == "huge":
                s = socket.create_connection(("127.0.0.1", port), timeout=30)
                if n % 2:
                    s.sendall(_host(f"POST {SCOPES} HTTP/1.1\r\nhost: HOSTPORT\r\ncontent-length: {100 * MIB}\r\n\r\n"
                                    .encode(), port))
                    chunk = b" " * MIB
                else:
                    s.sendall(_host(f"POST {SCOPES} HTTP/1.1\r\nhost: HOSTPORT\r\ntransfer-encoding: chunked\r\n\r\n"
                                    .encode(), port))
                    chunk = b"%x\r\n" % MIB + b" " * MIB + b"\r\n"
                s.setblocking(False)
                sent, answer = 0, b""
                t0 = time.monotonic()
                while b"\r\n\r\n" not in answer and time.monotonic() - t0 < 10:
                    try:
                        answer += s.recv(65536)
                    except BlockingIOError:
                        pass
                    if sent < 8 * MIB and b"\r\n\r\n" not in answer:
                        try:
                            sent += s.send(chunk[: 65536])
                        except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                            time.sleep(0.001)
                    else:
                        time.sleep(0.001)
                got[f"status {int(answer.split()[1])}" if answer else "no answer"] += 1
                got["body MiB sent"] += sent / MIB
                s.close()
        except (OSError, ConnectionError) as e:
            got[f"failed: {type(e).__name__}"] += 1
            if keep is not None:
                keep.close()
                keep = None
            time.sleep(0.01)
    if keep is not None:
        keep.close()
    out.put(dict(got))


HOLDERS = ("slowloris", "keepalive", "slowbody", "perpeer")


def _holder_worker(kind: str, port: int, seconds: float, holders: int, proc: int, out) -> None:
    """One process holding ``holders`` connections the way ``kind`` says, each reopened
    when the daemon closes it; puts a Counter of what happened on ``out``."""
    raise_nofile()
    got: collections.Counter = collections.Counter()
    srcs = sources(kind, proc)

    async def one(i: int) -> None:
        while True:
            stream = await connect_from(srcs[i % len(srcs)], port, got)
            if stream is None:
                continue
            answer = b""
            try:
                async with trio.open_nursery() as n:

                    async def read() -> None:
                        nonlocal answer
                        try:
                            while True:
                                data = await stream.receive_some(65536)
                                if not data:
                                    break
                                answer += data
                        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                            pass  # (reset by the daemon: closed as well)
                        n.cancel_scope.cancel()

                    n.start_soon(read)
                    if kind == "slowloris":
                        await stream.send_all(_host(f"GET {SCOPES}/sc_x HTTP/1.1\r\nhost: HOSTPORT\r\n".encode(), port))
                        k = 0
                        while True:
                            await trio.sleep(1)
                            k += 1
                            await stream.send_all(f"x-slow-{k}: {k}\r\n".encode())
                    elif kind == "keepalive":
                        await stream.send_all(_host(f"GET {SCOPES}/sc_x HTTP/1.1\r\nhost: HOSTPORT\r\n\r\n".encode(), port))
                        await trio.sleep_forever()
                    elif kind == "slowbody":
                        await stream.send_all(_host(f"POST {SCOPES} HTTP/1.1\r\nhost: HOSTPORT\r\ncontent-type: "
                                                    f"application/json\r\ncontent-length: 100000\r\n\r\n".encode(), port))
                        while True:
                            await trio.sleep(1)
                            await stream.send_all(b" " * 10)
                    else:  # perpeer: silent
                        await trio.sleep_forever()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass  # (a send to a connection the daemon closed)
            finally:
                await trio.aclose_forcefully(stream)
            statuses = [int(line.split()[1]) for line in answer.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]
            if kind == "keepalive" and statuses:
                statuses = statuses[1:]  # the first is the request's own answer
            got[f"closed by the daemon with {', '.join(map(str, statuses))}" if statuses
                else "closed by the daemon without an answer"] += 1
            await trio.sleep(0.05 if not statuses or statuses[-1] != 503 else 0.2)

    hold(one, holders, seconds)
    out.put(dict(got))


# ------------------------------------------------------------------------------ probes


class Probe(ProbeSamples):
    """The well-behaved clients: an HTTP GET (keep-alive) and a TCP ``server.status``,
    each every 10 ms."""

    def __init__(self, d: Daemon, ramp_s: float = 0.0) -> None:
        super().__init__("http", "new http", "tcp", ramp_s=ramp_s)
        self.d = d

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as n:
            await n.start(self._http)
            await n.start(self._fresh)
            await n.start(self._tcp)
            task_status.started()

    async def _http(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with httpx.AsyncClient(base_url=self.d.http, timeout=10) as c:
            task_status.started()
            while True:
                t0 = time.perf_counter()
                try:
                    r = await c.get(f"{SCOPES}/sc_probe")
                    if r.status_code != 404:
                        code = r.headers.get("content-type", "").startswith("application/json") and \
                            (r.json().get("error") or {}).get("code") if r.content else None
                        self.failures[f"http {r.status_code} {code or ''}".rstrip()] += 1
                except httpx.HTTPError as e:
                    self.failures[f"http {type(e).__name__}"] += 1
                self.sample("http", t0)
                await trio.sleep(0.01)

    async def _fresh(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """A new connection for each request, every 100 ms: waits behind whatever
        the listener has not accepted yet."""
        task_status.started()
        request = _host(f"GET {SCOPES}/sc_probe HTTP/1.1\r\nhost: HOSTPORT\r\nconnection: close\r\n\r\n".encode(),
                        self.d.port)
        while True:
            t0 = time.perf_counter()
            try:
                with trio.fail_after(30):
                    s = await trio.open_tcp_stream("127.0.0.1", self.d.port)
                    try:
                        await s.send_all(request)
                        got = b""
                        while b"\r\n\r\n" not in got:
                            data = await s.receive_some()
                            if not data:
                                raise trio.BrokenResourceError("closed before an answer")
                            got += data
                    finally:
                        await s.aclose()
                if not got.startswith(b"HTTP/1.1 404"):
                    self.failures[f"new http {got[:12]!r}"] += 1
            except (OSError, trio.TooSlowError, trio.BrokenResourceError) as e:
                self.failures[f"new http {type(e).__name__}"] += 1
            self.sample("new http", t0)
            await trio.sleep(0.1)

    async def _tcp(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with rallypoint.connect(self.d.url) as rs:
            task_status.started()
            while True:
                t0 = time.perf_counter()
                await rs.status()
                self.sample("tcp", t0)
                await trio.sleep(0.01)



# ------------------------------------------------------------------------------ report


def row(d: Daemon, label: str) -> dict:
    rss, hwm = d.memory()
    logs = d.log_counts()
    fds = d.fds()
    levels = " ".join(f"{lv} {logs[lv]:,}" for lv in ("DEBUG", "INFO", "WARNING", "ERROR"))
    print(f"{label:<14} fds {fds:>5}  accept queue {d.accept_queue():>5}  RSS {rss / MIB:6.1f} MiB (peak {hwm / MIB:6.1f})  log {logs['lines']:>7,} lines "
          f"({levels}; tracebacks {logs['tracebacks']:,})")
    return {"fds": fds, **logs}


async def soak(args, d: Daemon) -> dict:
    phase_s = args.seconds / len(args.phases)
    probe = Probe(d, args.ramp)
    result: dict = {"answers": collections.Counter(), "holders": collections.Counter()}
    async with trio.open_nursery() as nursery:
        await nursery.start(probe.run)
        await trio.sleep(0.5)
        probe.take()
        probe.mark()
        await trio.sleep(args.idle)
        print(f"{'idle':<14} probes alone for {args.idle:g} s: {probe.take(idle=True)}")
        base = row(d, "start")
        for kind in args.phases:
            probe.mark()
            out = multiprocessing.get_context("spawn").Queue() if kind in HOLDERS else multiprocessing.Queue()
            if kind in HOLDERS:  # (spawned: a child forked from inside trio.run cannot trio.run)
                procs = [multiprocessing.get_context("spawn").Process(target=_holder_worker,
                                                 args=(kind, d.port, phase_s, args.holders, i, out))
                         for i in range(args.procs)]
            else:
                procs = [multiprocessing.Process(target=_worker, args=(kind, d.port, phase_s, out))
                         for _ in range(args.procs)]
            t0 = time.monotonic()
            for p in procs:
                p.start()
            got: collections.Counter = collections.Counter()
            for _ in procs:
                got.update(await trio.to_thread.run_sync(out.get))
            await trio.to_thread.run_sync(lambda: [p.join() for p in procs])
            took = time.monotonic() - t0
            if kind in HOLDERS:
                result["holders"].update({f"{kind}: {k}": v for k, v in got.items()})
            else:
                result["answers"].update({k: v for k, v in got.items()
                                          if k.startswith(("status", "failed", "no answer"))})
            row(d, f"after {kind}")
            what = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(got.items()))
            print(f"{'':<14} {what} in {took:.1f} s")
            print(f"{'':<14} probes: {probe.take(phase=kind)}")
            t0 = time.monotonic()
            while d.accept_queue() and time.monotonic() - t0 < 60:
                await trio.sleep(0.05)
            drained = time.monotonic() - t0
            print(f"{'':<14} accept queue empty {drained:.2f} s after the phase (left: {d.accept_queue()}); "
                  f"probes meanwhile: {probe.take() if drained > 0.2 else '-'}")
        t0 = time.monotonic()
        while d.fds() > base["fds"] and time.monotonic() - t0 < 30:
            await trio.sleep(0.05)
        result["fds_back_s"] = time.monotonic() - t0 if d.fds() <= base["fds"] else None
        back = (f"{result['fds_back_s']:.2f} s" if result["fds_back_s"] is not None
                else f"not within 30 s ({d.fds()} held, {base['fds']} at the start)")
        print(f"{'':<14} descriptors back to the start's {base['fds']}: {back}")
        result["probe_failures"] = dict(probe.failures)
        result["ratios"] = probe.ratios
        result["ramp_max_s"] = probe.ramps
        if probe.failures:
            print(f"{'':<14} probe failures: {dict(probe.failures)}")
        nursery.cancel_scope.cancel()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    phases = ("empty", "aborted", "deep", "huge") + HOLDERS
    ap.add_argument("--seconds", type=float, default=80.0, help="total attack time, split between the phases")
    ap.add_argument("--procs", type=int, default=2, help="attacking processes per phase")
    ap.add_argument("--phases", type=lambda v: tuple(x for x in v.split(",") if x), default=phases,
                    help=f"comma-separated, in order (default all: {','.join(phases)})")
    ap.add_argument("--holders", type=int, default=600,
                    help="connections each process holds in the slowloris, keepalive, slowbody, perpeer phases")
    ap.add_argument("--idle", type=float, default=5.0, help="seconds the probes run alone first (the baseline)")
    ap.add_argument("--ramp", type=float, default=2.0,
                    help="a phase's first seconds (the attackers starting and opening their connections), "
                         "summarized apart: the ratios judge the attack held")
    ap.add_argument("--nofile", type=int, default=0, help="the daemon's RLIMIT_NOFILE (0: inherited)")
    ap.add_argument("--max-connections", type=int, default=0, help="the daemon's --max-connections (0: its default)")
    ap.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                    help="the daemon's --log-level (default %(default)s, the daemon's default)")
    ap.add_argument("--keep-log", action="store_true", help="keep the daemon's log and print its path")
    args = ap.parse_args()
    unknown = [x for x in args.phases if x not in phases]
    if unknown or not args.phases:
        ap.error(f"--phases: unknown {unknown} (known: {','.join(phases)})")
    workdir = tempfile.mkdtemp(prefix="rallypoint-soak-http-")
    d = Daemon(args, workdir)
    print(f"daemon {d.http} (TCP {d.url}) pid {d.proc.pid}, rallypoint {rallypoint.__version__} from "
          f"{os.path.dirname(rallypoint.__file__)}, log level {args.log_level}, {args.seconds:g} s, "
          f"{args.procs} processes a phase, phases {','.join(args.phases)}" + (f", RLIMIT_NOFILE {args.nofile}" if args.nofile else ""))
    result: dict = {}
    try:
        result = trio.run(soak, args, d)
    finally:
        rc = d.stop()
    final = d.log_counts()
    answers = result.get("answers", {})
    bad = {k: v for k, v in answers.items() if k != "status 400"}
    print(f"{'after SIGTERM':<14} log {final['lines']:,} lines, {final['bytes']:,} B (ERROR {final['ERROR']}, "
          f"tracebacks {final['tracebacks']}); daemon exit code {rc}")
    print(f"{'answers':<14} {json.dumps(dict(sorted(answers.items())))}; unexpected: {json.dumps(bad)}")
    if result.get("holders"):
        print(f"{'holders':<14} {json.dumps(dict(sorted(result['holders'].items())))}")
    for phase, ratios in result.get("ratios", {}).items():
        print(f"{'p99 / idle':<14} {phase:<10} " + "  ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
              + "   ramp max " + "  ".join(f"{k} {v * 1e3:.0f} ms" for k, v in result.get("ramp_max_s", {}).get(phase, {}).items()))
    if args.keep_log:
        print(f"log: {d.log_path}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    ok = (rc == 0 and final["ERROR"] == 0 and final["tracebacks"] == 0 and not bad
          and result.get("fds_back_s") is not None and not result.get("probe_failures"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
