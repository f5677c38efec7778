#!/usr/bin/env python
"""Where a daemon restart's time goes, as a client sees it (issue 31 item 5).

A restart is ``SIGTERM`` (or ``SIGINT``) to a running ``rallypoint serve --http``, then
the same command started again on the same data dir, as a supervisor would. Two pollers
try a TCP connect to the daemon's ``--listen`` and ``--http`` ports every 2 ms, and an
HTTP poller sends ``GET /v1/spaces/default/scopes/<none>`` (a 404 is an answer)
throughout, so the figures are what a client sees:

- **stop**, from the signal: until each port refuses connections; until the process
  has exited (drain, final snapshot, journal closed);
- **refused**: how long a connect to the HTTP port was refused (old listener closed,
  new one not bound yet): a request sent then fails at once (the runstate SDK retries a
  refused connect for about 0.7 s, then gives up: its lease renewal is lost);
- **start**, from the new process's exec: until each port takes connections (kernel
  level: a request sent then waits in the backlog), until the first HTTP answer, until
  the ``READY`` line; and, from its JSON log lines, exec to the first line (interpreter
  and imports), the recovery itself, and recovery to ``READY``.

Before the first restart it creates ``--tasks`` tasks (half left RUNNING under a lease,
half queued) so that recovery and the lease extension have something to do.

Usage::

    python scripts/bench_restart.py                   # 5 restarts, 2,000 tasks
    python scripts/bench_restart.py --restarts 10 --tasks 20000 --signal INT --json out.json

The machine is shared (2 cores, other agents' tests): the figures print the load average
next to them; take the median, and compare runs made close together.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortWatch(threading.Thread):
    """Tries a TCP connect to ``port`` every ``period`` s; records (time, open?) at every
    change. ``http``: also send a GET and count an answer (any status) as served."""

    def __init__(self, port: int, period: float = 0.002, http: bool = False) -> None:
        super().__init__(daemon=True)
        self.port, self.period, self.http = port, period, http
        self.changes: list[tuple[float, str]] = []
        self.stop = threading.Event()

    def state(self) -> str:
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        except OSError:
            return "refused"
        try:
            if not self.http:
                return "open"
            s.settimeout(0.05)
            s.sendall(b"GET /v1/spaces/default/scopes/scp_none HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            try:
                return "served" if s.recv(12).startswith(b"HTTP/1.1") else "open"
            except OSError:
                return "open"  # connected (backlog), no answer yet
        finally:
            s.close()

    def run(self) -> None:
        last = None
        while not self.stop.is_set():
            st = self.state()
            if st != last:
                self.changes.append((time.monotonic(), st))
                last = st
            time.sleep(self.period)

    def first(self, state: str, after: float) -> float | None:
        for t, st in self.changes:
            if t >= after and st == state:
                return t
        return None


def cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) the process ``pid`` used so far, or None once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuWatch(threading.Thread):
    """Samples a process's CPU time every 2 ms: the last sample before it is gone, and
    the first sample after each of the given moments (set later by the port pollers)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.samples: list[tuple[float, float]] = []

    def run(self) -> None:
        while True:
            c = cpu_s(self.pid)
            if c is None:
                return
            self.samples.append((time.monotonic(), c))
            time.sleep(0.002)

    def at(self, t: float | None) -> float | None:
        if t is None:
            return None
        for ts, c in self.samples:
            if ts >= t:
                return c
        return self.samples[-1][1] if self.samples else None


def start_daemon(args: list[str], env: dict, log_path: str, tree: str) -> tuple[subprocess.Popen, float, float]:
    """Start ``rallypoint serve`` of ``tree`` (its directory as the working directory:
    ``python -m`` looks there first); stderr into ``log_path``; (process, exec time,
    READY time)."""
    with open(log_path, "w") as log:
        t0 = time.monotonic()
        p = subprocess.Popen([sys.executable, "-m", "rallypoint", "serve", *args], stdout=subprocess.PIPE,
                             stderr=log, text=True, env=env, cwd=tree)
    p.cpu = CpuWatch(p.pid)
    p.cpu.start()
    ready = None
    while True:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"daemon exited {p.wait()}: {Path(log_path).read_text()[-3000:]}")
        if line.startswith("READY "):
            ready = time.monotonic()
        if line.startswith("HTTP "):
            break
    return p, t0, ready


def log_times(stderr_text: str) -> dict:
    """The JSON log's instants (epoch seconds) of the events this script reads."""
    out: dict = {}
    for line in stderr_text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        ts = rec.get("ts")
        if not ts:
            continue
        import datetime as dt

        t = dt.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
        out.setdefault("first", t)
        ev = rec.get("event")
        if ev == "recovery":
            out["recovered"] = t
            out["recovery_s"] = rec.get("seconds")
            out["leases_extended_ms"] = rec.get("leases_extended_ms")
        elif ev == "startup":
            out["startup"] = t
        elif "draining" in rec.get("msg", ""):
            out["signal_logged"] = t
        elif "stopping the coordinator" in rec.get("msg", "") or "closing the coordinator" in rec.get("msg", ""):
            out["closing"] = t
        elif "stopped cleanly" in rec.get("msg", ""):
            out["stopped"] = t
    return out


def populate(tcp_url: str, tasks: int) -> None:
    import trio

    import rallypoint

    async def main():
        async with rallypoint.connect(tcp_url) as rs:
            from rallypoint import protocol as p

            run = await rs.scopes.create(name="bench-restart")
            await rs._call(p.MailboxEnsure(name="bench-restart"), dict)  # (the op as any tree takes it)
            m = rs.mailbox("bench-restart")
            for lo in range(0, tasks, 500):
                await m.submit_many([{"i": i} for i in range(lo, min(tasks, lo + 500))], scope=run)
            left = tasks // 2
            while left > 0:  # half of them leased (600 s): outstanding leases at every restart
                got = await m.receive(run, lease_seconds=600, wait=1, max_messages=min(100, left))
                left -= len(got)

    trio.run(main)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--restarts", type=int, default=5)
    ap.add_argument("--tasks", type=int, default=2000)
    ap.add_argument("--signal", choices=["TERM", "INT"], default="TERM")
    ap.add_argument("--durability", default="fsync", choices=["fsync", "interval"])
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--tree", default=str(ROOT), help="the source tree whose daemon runs (default: this one)")
    a = ap.parse_args()

    env = dict(os.environ, PYTHONPATH=a.tree + os.pathsep + os.environ.get("PYTHONPATH", ""))
    data = tempfile.mkdtemp(prefix="bench-restart-")
    tcp_port, http_port = free_port(), free_port()
    args = ["--listen", f"127.0.0.1:{tcp_port}", "--http", f"127.0.0.1:{http_port}", "--data-dir", data,
            "--durability", a.durability, "--log-format", "json"]
    sig = signal.SIGTERM if a.signal == "TERM" else signal.SIGINT
    tcp_watch, http_watch = PortWatch(tcp_port), PortWatch(http_port, http=True)
    rows = []
    logs = Path(data) / "logs"
    logs.mkdir()
    p, _, _ = start_daemon(args, env, str(logs / "0.log"), a.tree)
    populate(f"tcp://127.0.0.1:{tcp_port}", a.tasks)
    tcp_watch.start()
    http_watch.start()
    try:
        for i in range(a.restarts):
            time.sleep(0.5)
            t_sig = time.monotonic()
            p_old_cpu = p.cpu
            p.send_signal(sig)
            p.communicate(timeout=120)
            t_exit = time.monotonic()
            wall_exit = time.time()
            old_log = log_times((logs / f"{i}.log").read_text())
            p, t_exec, t_ready = start_daemon(args, env, str(logs / f"{i + 1}.log"), a.tree)
            # (the pollers noticed the new ports meanwhile; give the last one a moment)
            time.sleep(0.05)
            wall_exec = time.time() - (time.monotonic() - t_exec)
            tcp_closed = tcp_watch.first("refused", t_sig)
            http_closed = http_watch.first("refused", t_sig)
            http_back = next((t for t, st in http_watch.changes if t > (http_closed or t_sig) and st != "refused"),
                             None)
            tcp_back = tcp_watch.first("open", t_exec)
            served = http_watch.first("served", t_exec)
            row = {
                "stop: signal -> TCP port closed": tcp_closed and tcp_closed - t_sig,
                "stop: signal -> HTTP port closed": http_closed and http_closed - t_sig,
                "stop: signal -> process exited": t_exit - t_sig,
                "HTTP connects refused for": (http_back - http_closed) if http_back and http_closed else None,
                "start: exec -> TCP port takes connections": tcp_back and tcp_back - t_exec,
                "start: exec -> HTTP port takes connections": http_back and http_back - t_exec,
                "start: exec -> first HTTP answer": served and served - t_exec,
                "start: exec -> READY": t_ready - t_exec,
                "signal -> READY (the whole restart)": t_ready - t_sig,
            }
            new_log = log_times((logs / f"{i + 1}.log").read_text())
            if new_log.get("first"):
                row["start: exec -> first log line"] = new_log["first"] - wall_exec
            if new_log.get("recovery_s") is not None:
                row["start: recovery itself"] = new_log["recovery_s"]
                row["leases extended by (s)"] = (new_log.get("leases_extended_ms") or 0) / 1000
            old_cpu = p_old_cpu.samples
            if old_cpu:
                sig_cpu = p_old_cpu.at(t_sig)
                row["stop CPU: signal -> exit (s of CPU)"] = old_cpu[-1][1] - (sig_cpu or 0)
            row["start CPU: exec -> HTTP port takes connections (s of CPU)"] = p.cpu.at(http_back)
            row["start CPU: exec -> READY (s of CPU)"] = p.cpu.at(t_ready)
            if old_log.get("closing") and old_log.get("stopped"):
                row["stop: listeners closed -> coordinator closed (log)"] = old_log["stopped"] - old_log["closing"]
                row["stop: coordinator closed -> process exited"] = wall_exit - old_log["stopped"]
            if new_log.get("recovered") and new_log.get("startup"):
                row["start: recovered -> listening (log)"] = new_log["startup"] - new_log["recovered"]
            rows.append(row)
            print(f"restart {i + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if v is not None),
                  flush=True)
    finally:
        tcp_watch.stop.set()
        http_watch.stop.set()
        p.send_signal(signal.SIGTERM)
        p.wait(60)
    keys = list(rows[0])
    summary = {k: statistics.median([r[k] for r in rows if r.get(k) is not None])
               for k in keys if any(r.get(k) is not None for r in rows)}
    load = os.getloadavg()
    print(f"\nmedian of {len(rows)} restarts ({a.tasks} tasks, half leased; durability {a.durability}; "
          f"SIG{a.signal}; load average {load[0]:.1f} on {os.cpu_count()} cores, a shared machine):")
    for k, v in summary.items():
        if "CPU" in k:
            print(f"  {k:60} {v:9.2f} s")
        else:
            print(f"  {k:60} {v * 1000:9.0f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "median": summary, "load": load, "tasks": a.tasks}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
