"""Task lifecycle throughput over HTTP with the unchanged runstate SDK 0.3 (``queue`` +
``serve``) against the native TCP client, side by side on one daemon in one run.

A lifecycle is: submit one task, a worker receives it (admit / receive), completes it,
and the producer gets its result. Both sides run ``--concurrency`` producers (each:
submit, then wait for the result, one task at a time) and one worker process serving
``--concurrency`` tasks at once; the producers and the worker are separate processes
from the daemon (the SDK in its own virtual environment, tests/sdk_compat.py). Rounds
alternate HTTP and TCP so the shared machine's load swings hit both alike.

    python3 scripts/bench_http.py --tasks 400 --concurrency 8 --rounds 3

Prints one line per round and the medians (tasks/s, and p50 lifecycle latency in ms).

``--endpoint``: the HTTP layer's cost per request instead (issue 33). One run starts a
bare hypercorn (Trio worker) + starlette app whose ``POST /v1/spaces/{space}/scopes``
reads the body and answers a fixed ``{}`` (nothing else), and a ``rallypoint serve
--http`` daemon (plus one per ``--code DIR``: another checkout, for A/B in the same
run); the same raw-socket HTTP/1.1 client (asyncio protocols, one process,
``--connections`` keep-alive connections, one request in flight on each) drives each for
``--seconds`` in turn, ``--rounds`` times, alternating. Prints requests/s, the server's
CPU per request (from /proc: user+system of its process), each rallypoint server's rate
as a share of the bare endpoint's in the same round, the medians and the load average.

    python3 scripts/bench_http.py --endpoint --connections 16 --seconds 2 --rounds 15 \
        [--durability fsync,memory] [--code /tmp/old]

``--in-process``: the application layer alone, no sockets, no server: ``HttpApi`` called
as an ASGI app with ``POST /v1/spaces/bench/scopes`` (a bearer key, ``{}``) over a
service that answers a ``ScopeView`` at once (key lookup and hashing as the real
``Keys.authenticate``), against the bare endpoint's starlette app on the same
messages; µs per request, the best of ``--rounds`` passes of ``--requests``, each tree
(``--code``) in its own process, alternating.

    python3 scripts/bench_http.py --in-process --rounds 5 [--code /tmp/old]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from sdk_compat import HttpDaemon, sdk_python  # noqa: E402

HTTP_SIDE = r'''
import asyncio, json, os, threading, time
import runstate
n, conc, tag = int(os.environ["N"]), int(os.environ["C"]), os.environ["TAG"]
worker = runstate.Runstate(run=tag, worker="bench-worker")
@worker.queue("bench-" + tag, concurrency=conc)
def handle(x):
    return x + 1
stop = threading.Event()
th = threading.Thread(target=worker.serve, kwargs={"signal": stop})
th.start()
producer = runstate.Runstate(run=tag, worker="bench-producer")
q = producer.queue("bench-" + tag)
async def main():
    lat = []
    it = iter(range(n))
    async def one_producer():
        for i in it:
            t0 = time.perf_counter()
            assert await q.acall(i) == i + 1
            lat.append(time.perf_counter() - t0)
    await q.acall(-1)  # warm up: the run, the queue, the worker's first admit
    t0 = time.perf_counter()
    await asyncio.gather(*(one_producer() for _ in range(conc)))
    return time.perf_counter() - t0, lat
wall, lat = asyncio.run(main())
stop.set(); th.join(60)
lat.sort()
print(json.dumps({"wall": wall, "p50": lat[len(lat) // 2] * 1000, "p99": lat[int(len(lat) * 0.99)] * 1000}))
'''

TCP_SIDE = r'''
import json, os, sys, time
import trio, rallypoint
n, conc, tag = int(os.environ["N"]), int(os.environ["C"]), os.environ["TAG"]
async def main():
    async with rallypoint.connect(os.environ["URL"], api_key=os.environ["KEY"]) as rs:
        run = await rs.scopes.create(name=tag)
        mbx = await rs.mailboxes.ensure("bench-" + tag)
        async def handle(d):
            return d.input + 1
        lat = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: rallypoint.consume(rs, mbx, run, handle, concurrency=conc))
            async def call(i):
                t = await mbx.submit(i, scope=run)
                info = await t.result()
                assert info.outcome == i + 1
            await call(-1)
            it = iter(range(n))
            async def one_producer():
                for i in it:
                    t1 = time.perf_counter()
                    await call(i)
                    lat.append(time.perf_counter() - t1)
            t0 = time.perf_counter()
            async with trio.open_nursery() as p:
                for _ in range(conc):
                    p.start_soon(one_producer)
            wall = time.perf_counter() - t0
            await run.cancel()
        lat.sort()
        print(json.dumps({"wall": wall, "p50": lat[len(lat) // 2] * 1000, "p99": lat[int(len(lat) * 0.99)] * 1000}))
trio.run(main)
'''


BARE_SERVER = r'''
import socket, sys
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
async def scopes(request):
    await request.body()
    return Response(b"{}", media_type="application/json")
app = Starlette(routes=[Route("/v1/spaces/{space}/scopes", scopes, methods=["POST"])])
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", 0))
port = sock.getsockname()[1]
sock.close()
cfg = Config()
cfg.bind = [f"127.0.0.1:{port}"]
cfg.accesslog = None
cfg.include_server_header = False
print(f"HTTP http://127.0.0.1:{port}", flush=True)
trio.run(serve, app, cfg)
'''

LOAD_CLIENT = r'''
import asyncio, json, sys, time
host, port, path, auth, conns, seconds = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), float(sys.argv[6])
body = b"{}"
req = (f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\nauthorization: Bearer {auth}\r\n"
       f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
count = [0]
statuses = {}
lat = []
clock = time.perf_counter
class Conn(asyncio.Protocol):
    def connection_made(self, t):
        self.t = t; self.buf = b""; self.t0 = clock(); t.write(req)
    def data_received(self, data):
        buf = self.buf + data
        while True:
            i = buf.find(b"\r\n\r\n")
            if i < 0:
                break
            head = buf[:i].lower()
            j = head.find(b"content-length:")
            if j >= 0:
                k = head.find(b"\r\n", j)
                n = int(head[j + 15:k if k > 0 else len(head)])
            else:
                n = 0
            if len(buf) < i + 4 + n:
                break
            st = head[9:12]
            statuses[st] = statuses.get(st, 0) + 1
            buf = buf[i + 4 + n:]
            count[0] += 1
            now = clock()
            lat.append(now - self.t0)
            self.t0 = now
            self.t.write(req)
        self.buf = buf
async def main():
    loop = asyncio.get_running_loop()
    ts = [(await loop.create_connection(Conn, host, port))[0] for _ in range(conns)]
    await asyncio.sleep(0.5)  # warm-up
    c0 = count[0]; t0 = loop.time(); del lat[:]
    await asyncio.sleep(seconds)
    n = count[0] - c0; dt = loop.time() - t0
    got = sorted(lat[:n])
    for t in ts:
        t.close()
    print(json.dumps({"requests": n, "seconds": dt, "statuses": {k.decode(): v for k, v in statuses.items()},
                      "p50_ms": got[len(got) // 2] * 1e3 if got else 0}))
asyncio.run(main())
'''


IN_PROCESS = r'''
import sys, time
import msgspec, trio
from rallypoint import protocol as p
from rallypoint.actors.keys import hash_secret
mode, n = sys.argv[1], int(sys.argv[2])
SECRET = "rpk_" + "x" * 43
class Key:
    space = "bench"; permissions = ["admin"]; id = "key_1"; secret_sha256 = hash_secret(SECRET)
class Keys:
    open_mode = False
    def authenticate(self, secret):
        h = hash_secret(secret)
        if h != Key.secret_sha256:
            raise ValueError("bad key")
        return Key
class Coordinator:
    keys = Keys()
REPLY = msgspec.msgpack.encode(p.ScopeView(
    id="run_01m8vmvn1h0ks0d2px4r9vefgh", name=None, parent_id=None, stored_state="active", effective="active",
    inactive_reason=None, deadline=None, created_at="2026-12-02T14:00:00.123Z", ended_at=None, child_limit=1000,
    children=0, tasks={}))
class Service:
    coordinator = Coordinator()
    async def call(self, session, op):
        return REPLY
    async def call_applied(self, session, op):
        return REPLY, 0
    async def wait_durable(self, lsn):
        pass
if mode == "bare":
    ns = {}
    exec(BARE.split("sock = socket")[0], ns)
    app = ns["app"]
else:
    from rallypoint.http.app import HttpApi
    app = HttpApi(Service())
scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
         "path": "/v1/spaces/bench/scopes", "raw_path": b"/v1/spaces/bench/scopes", "query_string": b"",
         "root_path": "", "headers": [(b"host", b"127.0.0.1:8080"), (b"authorization", b"Bearer " + SECRET.encode()),
         (b"user-agent", b"bench"), (b"content-type", b"application/json"), (b"content-length", b"2")],
         "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8080), "state": {}}
async def main():
    sent = []
    send = sent.append
    async def asend(m):
        send(m)
    async def one():
        msgs = [{"type": "http.request", "body": b"{}", "more_body": False}]
        async def receive():
            return msgs.pop() if msgs else {"type": "http.disconnect"}
        await app(dict(scope), receive, asend)
    await one()
    assert sent[0]["status"] == 200, sent
    t0 = time.perf_counter()
    for _ in range(n):
        await one()
    return (time.perf_counter() - t0) / n * 1e6
print(trio.run(main))
'''


def in_process_main(args) -> None:
    """The ``--in-process`` comparison (see the module doc)."""
    trees = [("rallypoint", str(REPO))] + [(f"code:{Path(c).name or c}", os.path.abspath(c)) for c in args.code]
    sides = [("bare", "bare", str(REPO))] + [(name, "api", tree) for name, tree in trees]
    code = IN_PROCESS.replace("BARE.split", repr(BARE_SERVER) + ".split")
    got: dict[str, list[float]] = {name: [] for name, *_ in sides}
    print(f"load average before: {_load()}; {args.requests} requests a pass", flush=True)
    for r in range(args.rounds):
        for name, mode, tree in (sides if r % 2 == 0 else sides[::-1]):
            out = subprocess.run([sys.executable, "-c", code, mode, str(args.requests)], capture_output=True,
                                 text=True, env=dict(os.environ) | {"PYTHONPATH": tree}, timeout=600)
            if out.returncode != 0:
                raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
            got[name].append(float(out.stdout.strip().splitlines()[-1]))
        print(f"round {r}: " + "  ".join(f"{n} {v[-1]:6.1f} us" for n, v in got.items()), flush=True)
    for n, v in got.items():
        print(f"best {n:24} {min(v):6.1f} us/request  (median {statistics.median(v):6.1f})")
    print(f"load average after: {_load()}")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def endpoint_main(args) -> None:
    """The ``--endpoint`` comparison (see the module doc)."""
    from urllib.parse import urlsplit
    servers: list[tuple[str, Any, str, str, str]] = []  # (name, process, url, path, secret)
    tmp = tempfile.mkdtemp(prefix="bench-http-")
    daemons = []
    try:
        bare = subprocess.Popen([sys.executable, "-c", BARE_SERVER], stdout=subprocess.PIPE, text=True)
        line = bare.stdout.readline()
        if not line.startswith("HTTP "):
            raise SystemExit("the bare server did not start")
        servers.append(("bare", bare, line.split()[1], "/v1/spaces/bench/scopes", "x"))
        trees = [("rallypoint", str(REPO))] + [(f"code:{Path(c).name or c}", os.path.abspath(c)) for c in args.code]
        durabilities = args.durability.split(",")
        for name, tree in trees:
            for dur in durabilities:
                full = name if len(durabilities) == 1 else f"{name}:{dur}"
                d = HttpDaemon(os.path.join(tmp, full.replace(":", "_")), space="bench", durability=dur,
                               env={"PYTHONPATH": tree}).start()
                daemons.append(d)
                servers.append((full, d.proc, d.base_url, "/v1/spaces/bench/scopes", d.secret))
        print(f"load average before: {_load()}; {args.connections} connections, {args.seconds:g} s a turn, "
              f"durability {args.durability}", flush=True)
        rates: dict[str, list[float]] = {s[0]: [] for s in servers}
        cpus: dict[str, list[float]] = {s[0]: [] for s in servers}
        p50s: dict[str, list[float]] = {s[0]: [] for s in servers}
        shares: dict[str, list[float]] = {s[0]: [] for s in servers[1:]}
        for r in range(args.rounds):
            order = servers if r % 2 == 0 else [servers[0]] + servers[1:][::-1]
            got = {}
            for name, proc, url, path, secret in order:
                u = urlsplit(url)
                c0 = _cpu_s(proc.pid)
                out = subprocess.run([sys.executable, "-c", LOAD_CLIENT, u.hostname, str(u.port), path, secret,
                                      str(args.connections), str(args.seconds)],
                                     capture_output=True, text=True, timeout=args.seconds + 60)
                c1 = _cpu_s(proc.pid)
                if out.returncode != 0:
                    raise SystemExit(f"client against {name} failed:\n{out.stderr[-3000:]}")
                m = json.loads(out.stdout.strip().splitlines()[-1])
                bad = {k: v for k, v in m["statuses"].items() if k != "200"}
                if bad:
                    raise SystemExit(f"{name} answered {bad}")
                rate = m["requests"] / m["seconds"]
                cpu_us = (c1 - c0) / max(1, m["requests"]) * 1e6  # includes the warm-up's CPU: an upper bound
                rates[name].append(rate)
                cpus[name].append(cpu_us)
                p50s[name].append(m["p50_ms"])
                got[name] = rate
            line = f"round {r:2}: " + "  ".join(f"{n} {got[n]:5.0f}/s" for n, *_ in servers)
            for n in shares:
                shares[n].append(got[n] / got["bare"])
                line += f"  {got[n] / got['bare'] * 100:3.0f}%"
            print(line + f"  (load {_load()})", flush=True)
        for n, *_ in servers:
            tail = f"  = {statistics.median(shares[n]) * 100:5.1f}% of bare (median of the rounds' ratios)" \
                if n in shares else ""
            print(f"median {n:24} {statistics.median(rates[n]):7.0f} req/s  p50 {statistics.median(p50s[n]):6.1f} ms  "
                  f"server CPU <= {statistics.median(cpus[n]):5.0f} us/req{tail}")
        print(f"load average after: {_load()}")
    finally:
        for d in daemons:
            d.stop()
        for name, proc, *_ in servers:
            if name == "bare":
                proc.terminate()
                proc.wait(10)
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoint", action="store_true",
                    help="POST /scopes against a bare hypercorn+starlette endpoint (see the module doc)")
    ap.add_argument("--in-process", action="store_true",
                    help="the application layer alone against the bare starlette app (see the module doc)")
    ap.add_argument("--requests", type=int, default=20000, help="--in-process: requests a pass")
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=2.0,
                    help="--endpoint: measured seconds per turn (after 0.5 s of warm-up)")
    ap.add_argument("--code", action="append", default=[],
                    help="--endpoint: also a daemon importing rallypoint from this checkout (A/B)")
    ap.add_argument("--tasks", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--durability", default="fsync",
                    help="fsync | interval | memory (--endpoint: a comma-separated list, one daemon each)")
    args = ap.parse_args()
    for dur in args.durability.split(","):
        if dur not in ("fsync", "interval", "memory") or ("," in args.durability and not args.endpoint):
            ap.error(f"--durability {args.durability!r}: fsync, interval or memory (a list only with --endpoint)")
    if args.endpoint:
        endpoint_main(args)
        return
    if args.in_process:
        in_process_main(args)
        return
    py03 = sdk_python("0.3.0")
    with tempfile.TemporaryDirectory() as tmp:
        d = HttpDaemon(os.path.join(tmp, "data"), durability=args.durability).start()
        try:
            res: dict[str, list[dict]] = {"http": [], "tcp": []}
            for r in range(args.rounds):
                for side in ("http", "tcp"):
                    env = {"N": str(args.tasks), "C": str(args.concurrency), "TAG": f"{side}-{r}"}
                    if side == "http":
                        e = d.sdk_env() | env
                        cmd = [py03, "-c", HTTP_SIDE]
                    else:
                        e = dict(os.environ) | env | {"URL": d.tcp_url, "KEY": d.secret,
                                                      "PYTHONPATH": str(REPO)}
                        cmd = [sys.executable, "-c", TCP_SIDE]
                    out = subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=900)
                    if out.returncode != 0:
                        raise SystemExit(f"{side} round failed:\n{out.stdout}\n{out.stderr[-4000:]}")
                    m = json.loads(out.stdout.strip().splitlines()[-1])
                    m["rate"] = args.tasks / m["wall"]
                    res[side].append(m)
                    print(f"round {r} {side:4}: {m['rate']:8.1f} tasks/s  p50 {m['p50']:6.1f} ms  "
                          f"p99 {m['p99']:6.1f} ms", flush=True)
            for side in ("http", "tcp"):
                rates = [m["rate"] for m in res[side]]
                p50 = statistics.median(m["p50"] for m in res[side])
                print(f"median {side:4}: {statistics.median(rates):8.1f} tasks/s  p50 {p50:6.1f} ms  "
                      f"(rounds: {', '.join(f'{x:.0f}' for x in rates)})")
        finally:
            d.stop()


if __name__ == "__main__":
    main()
