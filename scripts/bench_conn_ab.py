#!/usr/bin/env python
"""CPU time per request of the TCP server's connection code, this tree against an older
revision, in ONE process (so a busy machine slows both alike).

End-to-end figures (``bench_rpc.py``, ``perf_smoke.py``) swing 2-4x between identical
runs minutes apart when other work shares the cores; they cannot resolve a few percent.
This drives the real ``_Conn.reader`` coroutine of each version without Trio or a
socket: the stream's receive and send never suspend, so a whole run of pre-built chunks
is handled synchronously, and ``time.process_time`` counts only this process's CPU.
The versions alternate round by round; the minimum and median per request are printed.

Scenarios: ``echo`` (the dispatcher answers inside ``submit``, as the echo benchmark
does) and ``actor`` (``submit`` queues; before the next chunk an "actor" delivers the
answers and calls ``flush``, whose ``os.write`` goes to /dev/null), each with 1 request
per received chunk (a sequential client) and 64 (a pipelined one).

The older revision's ``transport/server.py`` is loaded from git next to this tree's
(the rest of the package is this tree's), so it must be compatible with this tree's
``framing.py`` and ``sockio.py``; this was written for the ConnState change (issue 28).

    python scripts/bench_conn_ab.py --base a25e2f7 [--requests 20000] [--rounds 12]
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import time

import msgspec

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from rallypoint import wire  # noqa: E402
from rallypoint.transport import server as new_mod  # noqa: E402
from rallypoint.transport.framing import encode_frame  # noqa: E402

_enc = msgspec.msgpack.Encoder().encode
_DEVNULL = os.open(os.devnull, os.O_WRONLY)


def load_base(rev: str):
    """The ``transport/server.py`` of ``rev``, imported as a sibling module."""
    src = subprocess.check_output(["git", "-C", ROOT, "show", f"{rev}:rallypoint/transport/server.py"])
    path = os.path.join(ROOT, "rallypoint", "transport", "_ab_base_server.py")
    with open(path, "wb") as f:
        f.write(src)
    try:
        return importlib.import_module("rallypoint.transport._ab_base_server")
    finally:
        os.unlink(path)


class Dispatcher:
    def __init__(self, actor: bool) -> None:
        self.actor = actor
        self.queue: list = []

    def hello(self, hello, peer):
        return None, wire.HelloOk(wire.PROTOCOL_VERSION, "bench")

    def submit(self, session, body, sink, rid) -> None:
        sink.note_op(rid, "scope.status")
        if self.actor:
            self.queue.append((sink, rid, bytes(body)))
        else:
            sink.deliver(rid, bytes(body), 0)

    def durable_lsn(self) -> int:
        return 10

    async def wait_durable(self, lsn: int) -> None:
        return None

    def run_batch(self) -> None:
        """The actor's batch: every queued answer, then one flush per connection."""
        if self.queue:
            sinks = {}
            for sink, rid, body in self.queue:
                sink.deliver(rid, body, 5)
                sinks[sink] = None
            self.queue.clear()
            for sink in sinks:
                sink.flush()


class Stream:
    """Receive and send that never suspend; before each receive, the actor's batch."""

    socket = None

    def __init__(self, chunks: list[bytes], dispatcher: Dispatcher) -> None:
        self.chunks = chunks
        self.i = 0
        self.dispatcher = dispatcher

    async def receive_some(self, n: int | None = None) -> bytes:
        self.dispatcher.run_batch()
        i = self.i
        self.i += 1
        return self.chunks[i] if i < len(self.chunks) else b""

    async def send_all(self, data) -> None:
        return None


def run(mod, chunks: list[bytes], actor: bool) -> float:
    """CPU seconds for the whole run of chunks."""
    dispatcher = Dispatcher(actor)
    server = mod.Server(dispatcher, idle_ping_interval=None)
    stream = Stream(chunks, dispatcher)

    async def receive_plain(fd, size, ready=False):
        return await stream.receive_some()

    mod.receive_plain = receive_plain
    conn = mod._Conn(server, stream, "bench")
    conn._fd = _DEVNULL  # flush() writes; the reader reads through receive_plain
    conn.writer_event = object()  # an idle writer: the reader sends after each chunk
    st = getattr(conn, "st", None)
    if st is not None:  # the ConnState version: past the handshake, a chunk begins
        st.phase = type(st.phase).OPEN
        st.reading = type(st.reading).HANDLING
        coro = conn.reader()
    else:
        coro = conn.reader([])
    t0 = time.process_time()
    try:
        coro.send(None)
    except StopIteration:
        pass
    return time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the older revision (a git commit)")
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    base_mod = load_base(args.base)
    body = msgspec.Raw(_enc({"scope": "scp_0123456789abcdef"}))
    print(f"per request, CPU ns (min / median of {args.rounds} alternating rounds), "
          f"{args.base} -> this tree; load average {os.getloadavg()[0]:.1f}")
    for actor in (False, True):
        for per_chunk in (1, 64):
            chunks = []
            rid = 1
            while rid <= args.requests:
                chunks.append(b"".join(encode_frame(_enc(wire.Request(r, body)))
                                       for r in range(rid, rid + per_chunk)))
                rid += per_chunk
            n = rid - 1
            res: dict[str, list[float]] = {"base": [], "new": []}
            for r in range(args.rounds):
                order = [("base", base_mod), ("new", new_mod)]
                for name, mod in (order if r % 2 == 0 else order[::-1]):
                    res[name].append(run(mod, chunks, actor) / n * 1e9)
            b, a = min(res["base"]), min(res["new"])
            print(f"  {'actor' if actor else 'echo':5s} {per_chunk:2d} req/chunk: before {b:6.0f} / "
                  f"{statistics.median(res['base']):6.0f}   after {a:6.0f} / {statistics.median(res['new']):6.0f}"
                  f"   after/before (min) {a / b:.3f}", flush=True)


if __name__ == "__main__":
    main()
