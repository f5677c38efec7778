#!/usr/bin/env python
"""What the event path and the metrics cost: lifecycle throughput side by side.

    python scripts/bench_events.py --baseline /work/main [--rounds 3] [--duration 10]
                                   [--durability fsync] [--json out.json]

Each round starts three daemons in turn, each with a fresh data dir, and drives each with
the same ``rallypoint bench`` lifecycle load (this checkout's harness; the load is the
same for all three):

* ``baseline``: the daemon of the ``--baseline`` checkout (a tree without events);
* ``events``: this checkout with ``--metrics`` on and ONE watcher attached to every
  event (by default a frame-level client that counts what is pushed, so that the
  watcher's own CPU does not compete with the daemon on a small machine; ``--watcher
  cli`` uses ``rallypoint watch --json`` instead);
* ``events-idle``: this checkout, no watcher, no metrics endpoint.

``--watcher stuck`` attaches a watcher that subscribes to every event and never reads
its socket (a small receive buffer): its buffer fills, it stalls, and after
``--watch-stall`` seconds (by default longer than the bench) the daemon cuts it off
(SLOW_CONSUMER). The ``events`` figure is then the rate the others get while a stuck
watcher is attached (what issue 16 asks:
a watcher that never reads does not slow the others down).

Reported per configuration: lifecycles/s (median of the rounds) and the daemon's CPU
time per lifecycle (utime + stime of the daemon process over the measured bench, read
from /proc), which is what contention with other processes on a shared machine
disturbs least. The goal (issue 16): ``events`` within 10 % of ``baseline``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from rallypoint.loadtest.runner import SpawnedDaemon  # noqa: E402
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


RAW_WATCHER = r"""
import socket, struct, sys, msgspec
from rallypoint import protocol as p, wire
host, port = sys.argv[1].removeprefix("tcp://").rsplit(":", 1)
s = socket.create_connection((host, int(port)))
def frame(m):
    b = msgspec.msgpack.encode(m)
    return struct.pack(">I", len(b)) + b
s.sendall(frame(wire.Hello(wire.PROTOCOL_VERSION, None, "bench-watcher")))
s.sendall(frame(wire.Request(1, msgspec.Raw(msgspec.msgpack.encode(p.EventsWatch(start="now"))))))
# count the events of each Push from its array header, without decoding them: the
# watcher's own CPU stays negligible (it shares the machine with the daemon)
buf, n, pos = bytearray(), 0, 0
try:
    while True:
        chunk = s.recv(1 << 20)
        if not chunk:
            break
        buf += chunk
        while len(buf) - pos >= 4:
            size = int.from_bytes(buf[pos:pos + 4], "big")
            if len(buf) - pos < 4 + size:
                break
            i = buf.find(b"\xa6events", pos + 4, pos + 40)
            if i >= 0:
                h = buf[i + 7]
                if 0x90 <= h <= 0x9F:
                    n += h & 0x0F
                elif h == 0xDC:
                    n += int.from_bytes(buf[i + 8:i + 10], "big")
                elif h == 0xDD:
                    n += int.from_bytes(buf[i + 8:i + 12], "big")
            pos += 4 + size
        if pos > (1 << 20):
            del buf[:pos]
            pos = 0
except KeyboardInterrupt:
    pass
print(n, flush=True)
"""


STUCK_WATCHER = r"""
import signal, socket, struct, sys, msgspec
from rallypoint import protocol as p, wire
host, port = sys.argv[1].removeprefix("tcp://").rsplit(":", 1)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
s.connect((host, int(port)))
def frame(m):
    b = msgspec.msgpack.encode(m)
    return struct.pack(">I", len(b)) + b
s.sendall(frame(wire.Hello(wire.PROTOCOL_VERSION, None, "bench-stuck-watcher")))
s.sendall(frame(wire.Request(1, msgspec.Raw(msgspec.msgpack.encode(p.EventsWatch(start="now"))))))
try:
    signal.pause()  # never reads
except KeyboardInterrupt:
    pass
print(0, flush=True)
"""


PIN: dict = {}  # --pin: {"daemon": {0}, "clients": {1}}


def _affinity(which: str):
    cpus = PIN.get(which)
    return (lambda: os.sched_setaffinity(0, cpus)) if cpus else None


def run_bench(url: str, args, out: str) -> dict:
    cmd = [sys.executable, "-m", "rallypoint", "bench", "--connect", url, "--scenario", "lifecycle",
           "--duration", str(args.duration), "--warmup", str(args.warmup), "--producers", str(args.producers),
           "--workers", str(args.workers), "--batch", "100", "--pipeline", "8", "--worker-concurrency", "8",
           "--max-messages", "100", "--json", out]
    subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=args.duration + args.warmup + 120,
                   preexec_fn=_affinity("clients"))
    with open(out) as f:
        return json.load(f)


def one(config: str, tree: Path, args, tmp: str) -> dict:
    data = tempfile.mkdtemp(dir=tmp)
    extra = ["--watch-stall", str(args.watch_stall)] if config == "events" and args.watcher == "stuck" else []
    if config == "events":
        extra += ["--metrics", "127.0.0.1:0"]
    daemon = SpawnedDaemon(args.durability, extra, tree=str(tree), data_dir=data, preexec_fn=_affinity("daemon"))
    url = daemon.start()
    watcher = None
    wout = os.path.join(tmp, f"watch-{config}.jsonl")
    try:
        if config == "events":
            f = open(wout, "w")
            if args.watcher == "cli":
                cmd = [sys.executable, "-m", "rallypoint", "watch", "--connect", url, "--json"]
            elif args.watcher == "stuck":  # subscribes, never reads
                cmd = [sys.executable, "-c", STUCK_WATCHER, url]
            else:  # a frame-level client that counts the pushed events: the watcher's own CPU stays small
                cmd = [sys.executable, "-c", RAW_WATCHER, url]
            watcher = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=f,
                                       stderr=subprocess.DEVNULL, preexec_fn=_affinity("clients"))
            time.sleep(1.0)
        c0, t0 = cpu_s(daemon.pid), time.monotonic()
        report = run_bench(url, args, os.path.join(tmp, f"{config}.json"))
        c1, t1 = cpu_s(daemon.pid), time.monotonic()
        if watcher is not None:
            time.sleep(1.0)
    finally:
        if watcher is not None:
            watcher.send_signal(signal.SIGINT)
            watcher.wait(10)
        daemon.stop(30)
        shutil.rmtree(data, ignore_errors=True)
    th = report["throughput"]
    # every lifecycle of the whole bench (warm-up included) cost daemon CPU
    all_lifecycles = th["lifecycles"] * (args.duration + args.warmup) / args.duration
    out = {
        "config": config,
        "lifecycles_per_s": th["lifecycles_per_s"],
        "errors": report["errors"]["total"],
        "daemon_cpu_s": round(c1 - c0, 2),
        "daemon_cpu_us_per_lifecycle": round((c1 - c0) / max(all_lifecycles, 1) * 1e6, 1),
        "wall_s": round(t1 - t0, 1),
    }
    if watcher is not None and args.watcher != "stuck":
        with open(wout) as f:
            text = f.read()
        out["events_watched"] = sum(1 for _ in text.splitlines()) if args.watcher == "cli" else int(text.strip() or 0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="a checkout without events (e.g. /work/main)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--durability", default="fsync", choices=["fsync", "interval", "memory"])
    ap.add_argument("--watcher", default="raw", choices=["raw", "cli", "stuck"],
                    help="raw: a frame-level client counting pushed events (default); cli: `rallypoint watch --json` "
                         "(decodes and prints every event: it needs a core of its own); stuck: a watcher that "
                         "never reads (cut off after --watch-stall seconds)")
    ap.add_argument("--watch-stall", type=float, default=None,
                    help="with --watcher stuck: the daemon's --watch-stall, in seconds (default: longer than the "
                         "bench, so the stuck watcher stays attached throughout)")
    ap.add_argument("--pin", action="store_true",
                    help="the daemon on CPU 0, the bench processes and the watcher on the others (less noise)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.watch_stall is None:
        args.watch_stall = args.duration + args.warmup + 30
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        PIN.update(daemon={cpus[0]}, clients=set(cpus[1:]) or {cpus[0]})
    trees = {"baseline": Path(args.baseline).resolve(), "events": ROOT, "events-idle": ROOT}
    results: dict[str, list[dict]] = {k: [] for k in trees}
    tmp = tempfile.mkdtemp(prefix="rp-bench-events-")
    try:
        for r in range(args.rounds):
            for config, tree in trees.items():
                res = one(config, tree, args, tmp)
                results[config].append(res)
                print(f"round {r + 1} {config:<12} {res['lifecycles_per_s']:>9,.0f} lifecycles/s  "
                      f"daemon CPU {res['daemon_cpu_us_per_lifecycle']:>6.1f} us/lifecycle  "
                      f"errors {res['errors']}" + (f"  watched {res['events_watched']:,} events"
                                                   if "events_watched" in res else ""), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = {}
    for config, rs in results.items():
        summary[config] = {
            "lifecycles_per_s": statistics.median(x["lifecycles_per_s"] for x in rs),
            "daemon_cpu_us_per_lifecycle": statistics.median(x["daemon_cpu_us_per_lifecycle"] for x in rs),
        }
    base = summary["baseline"]
    print()
    for config, s in summary.items():
        rel_t = s["lifecycles_per_s"] / base["lifecycles_per_s"] - 1
        rel_c = s["daemon_cpu_us_per_lifecycle"] / base["daemon_cpu_us_per_lifecycle"] - 1
        print(f"{config:<12} median {s['lifecycles_per_s']:>9,.0f} lifecycles/s ({rel_t:+.1%})  "
              f"daemon CPU {s['daemon_cpu_us_per_lifecycle']:.1f} us/lifecycle ({rel_c:+.1%})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": results, "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()
