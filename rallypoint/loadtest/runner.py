"""``rallypoint bench``: start processes, show progress, merge, report.

The parent process: (optionally) spawns a daemon with a fresh temporary data dir,
creates the bench run and mailbox, starts producer and worker processes
(multiprocessing, ``spawn``), waits until every one is connected, sets a common start
instant, shows a live progress line, collects each process's encoded histograms, and
writes the report. Exit status: 0 when the run had no error, 1 otherwise, 2 when it
could not start.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue as queue_mod
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import trio

from .report import build_report, format_table

SCENARIOS = ("lifecycle", "groups", "barriers", "joinsets", "mixed")
MAILBOX = "rallypoint-bench"


class SpawnedDaemon:
    """``rallypoint serve`` on a free loopback port with a fresh temp data dir (or
    ``data_dir``, which is kept). ``tree``: run that source tree's daemon (its directory
    as the working directory and ``PYTHONPATH``: for comparing trees); ``preexec_fn``:
    as :class:`subprocess.Popen`'s (e.g. to pin it to a CPU). The benchmark scripts
    start their daemons with it too."""

    def __init__(self, durability: str, extra: list[str] | None = None, *, tree: str | None = None,
                 data_dir: str | None = None, preexec_fn=None) -> None:
        self.durability = durability
        self.extra = extra or []
        self.tree = tree
        self.preexec_fn = preexec_fn
        self.dir = tempfile.mkdtemp(prefix="rallypoint-bench-")
        self.data_dir = data_dir or os.path.join(self.dir, "data")
        self.log_path = os.path.join(self.dir, "daemon.log")
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 30.0) -> str:
        args = [sys.executable, "-m", "rallypoint", "serve", "--listen", "127.0.0.1:0",
                "--durability", self.durability, "--data-dir", self.data_dir, *self.extra]
        self._log = open(self.log_path, "w")
        env = None if self.tree is None else {**os.environ, "PYTHONPATH": self.tree}
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self._log, text=True, cwd=self.tree,
                                     env=env, preexec_fn=self.preexec_fn)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("READY "):
                self.url = line.split()[1]
                return self.url
            if not line and self.proc.poll() is not None:
                break
        self.stop()
        with open(self.log_path) as f:
            raise RuntimeError(f"the daemon did not start: {f.read()[-2000:]}")

    def stop(self, timeout: float = 30.0) -> int | None:
        rc = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            rc = self.proc.returncode
            self.proc.stdout.close()
            self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        return rc


async def _setup(url: str, api_key: str | None = None, runs: int = 1) -> tuple[list[str], str]:
    """The bench's root runs (one named ``bench``; with ``runs`` > 1 that many unnamed
    ones, which a sharded cluster's router gives its shards in turn) and the server's
    durability."""
    import rallypoint

    async with rallypoint.connect(url, api_key=api_key, client_name="bench") as rs:
        info = await rs.status()
        if runs == 1:
            ids = [(await rs.scopes.create(name="bench", child_limit=1_000_000)).id]
        else:
            ids = [(await rs.scopes.create(child_limit=1_000_000)).id for _ in range(runs)]
        await rs.mailboxes.ensure(MAILBOX, max_attempts=5)
        return ids, info.durability, info.sync_helper.split(" ")[0]


async def _teardown(url: str, run_ids: list[str], api_key: str | None = None) -> None:
    import rallypoint

    async with rallypoint.connect(url, api_key=api_key, client_name="bench") as rs:
        for run_id in run_ids:
            await rs.scope(run_id).cancel(reason="bench finished")


class Progress:
    """On a terminal, a rich progress bar over the whole run (warm-up + measured
    window) with the request and lifecycle rates and the errors; otherwise a plain line
    every ``every`` seconds (logs and CI stay readable)."""

    def __init__(self, stream=sys.stderr, every: float = 5.0, total_s: float | None = None) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.every = every
        self.last_print = 0.0
        self.prev: tuple[float, int, int] | None = None
        self.rate = self.lrate = 0.0
        self._bar = None
        if self.tty and total_s:
            from rich.console import Console
            from rich.progress import BarColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

            self._bar = RichProgress(
                TextColumn("[bold]{task.fields[phase]:<8}"), BarColumn(bar_width=24), TimeElapsedColumn(),
                TextColumn("{task.fields[stats]}"), console=Console(file=stream), transient=False,
                refresh_per_second=4,
            )
            self._task = self._bar.add_task("bench", total=total_s, phase="starting", stats="")
            self._bar.start()

    def update(self, now: float, elapsed: float, phase: str, totals: dict) -> None:
        if self.prev is not None and now - self.prev[0] >= 1.0:
            dt = now - self.prev[0]
            self.rate = (totals["ops"] - self.prev[1]) / dt
            self.lrate = (totals["lifecycles"] + totals["rounds"] - self.prev[2]) / dt
            self.prev = (now, totals["ops"], totals["lifecycles"] + totals["rounds"])
        elif self.prev is None:
            self.prev = (now, totals["ops"], totals["lifecycles"] + totals["rounds"])
        line = (f"[{elapsed:6.1f}s {phase:<8}] {self.rate:9,.0f} req/s  {self.lrate:8,.0f} lifecycles+rounds/s  "
                f"total {totals['lifecycles']:,} lifecycles {totals['rounds']:,} rounds  errors {totals['errors']}")
        if self._bar is not None:
            err = f"[red]{totals['errors']} err[/red]" if totals["errors"] else "0 err"
            self._bar.update(self._task, completed=min(elapsed, self._bar.tasks[0].total or elapsed), phase=phase,
                             stats=f"{self.rate:,.0f} req/s  {self.lrate:,.0f} cycles/s  {err}")
        elif self.tty:
            self.stream.write("\r" + line + "\x1b[K")
            self.stream.flush()
        elif now - self.last_print >= self.every:
            self.stream.write(line + "\n")
            self.stream.flush()
            self.last_print = now

    def done(self) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif self.tty:
            self.stream.write("\n")
            self.stream.flush()


def run_bench(args, argv: list[str] | None = None) -> int:
    command = shlex.join(["rallypoint", *(argv if argv is not None else sys.argv[1:])])
    err = sys.stderr
    daemon = None
    if args.spawn:
        extra = ["--sync-helper", args.sync_helper] if args.sync_helper else []
        daemon = SpawnedDaemon(args.durability or "fsync", extra)
        try:
            url = daemon.start()
        except RuntimeError as e:
            print(f"rallypoint bench: {e}", file=err)
            return 2
        helper = f", --sync-helper {args.sync_helper}" if args.sync_helper else ""
        print(f"rallypoint bench: spawned daemon pid {daemon.proc.pid} at {url} "
              f"(durability {daemon.durability}{helper}, data dir {daemon.data_dir})", file=err, flush=True)
    else:
        url = args.connect
        print(f"rallypoint bench: load-testing the daemon at {url} for {args.warmup + args.duration:g} s: "
              f"{args.producers} producers and {args.workers} workers write tasks (tens of thousands) into the "
              f"mailbox {MAILBOX!r} under " + ("a run named 'bench'" if args.runs == 1 else f"{args.runs} root runs")
              + ", cancelled afterwards and left there; "
              "without --connect it benches a throwaway daemon instead", file=err, flush=True)
    procs: list[mp.Process] = []
    try:
        from ..errors import RallypointError

        try:
            run_ids, durability, sync_helper = trio.run(_setup, url, args.api_key, args.runs)
        except RallypointError as e:
            print(f"rallypoint bench: cannot set up on {url}: {e}", file=err)
            return 2
        if args.durability and not args.spawn and durability != args.durability:
            print(f"rallypoint bench: note: the daemon runs durability {durability}, not {args.durability}", file=err)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        go, stop = ctx.Event(), ctx.Event()
        start_value = ctx.Value("d", 0.0)
        base = {
            "url": url, "api_key": args.api_key, "run_ids": run_ids, "mailbox": MAILBOX, "scenario": args.scenario,
            "warmup": args.warmup, "duration": args.duration, "rate": args.rate, "producers": args.producers,
            "workers": args.workers, "batch": args.batch, "pipeline": args.pipeline,
            "max_messages": args.max_messages, "worker_concurrency": args.worker_concurrency,
            "lease_seconds": args.lease_seconds, "group_size": args.group_size, "accept_n": args.accept_n, "barrier_n": args.barrier_n,
            "joinset_size": args.joinset_size, "coalesce_ms": args.coalesce_ms, "settle": args.settle,
        }
        from .scenarios import child_main

        roles = [("worker", i) for i in range(args.workers)] + [("producer", i) for i in range(args.producers)]
        for role, i in roles:
            p = ctx.Process(target=child_main, args=({**base, "role": role, "index": i}, q, go, start_value, stop),
                            name=f"bench-{role}{i}", daemon=True)
            p.start()
            procs.append(p)
        by_key = {r: p for r, p in zip(roles, procs)}

        progress: dict = {}
        finals: dict = {}
        crashed: list[str] = []
        ready: set = set()

        def pump(timeout: float) -> None:
            try:
                kind, key, payload = q.get(timeout=timeout)
            except queue_mod.Empty:
                return
            key = tuple(key)
            if kind == "ready":
                ready.add(key)
            elif kind == "progress":
                progress[key] = payload
            elif kind == "final":
                finals[key] = payload
            elif kind == "crash":
                crashed.append(f"{key[0]}{key[1]}: {payload.strip().splitlines()[-1]}")
                print(f"rallypoint bench: {key[0]} {key[1]} crashed:\n{payload}", file=err)

        t_wait = time.monotonic() + 120
        while len(ready) < len(roles) and time.monotonic() < t_wait and len(crashed) == 0:
            pump(0.2)
            if any(not p.is_alive() and k not in ready for k, p in by_key.items()):
                pump(0.5)
                break
        if len(ready) < len(roles):
            print(f"rallypoint bench: only {len(ready)} of {len(roles)} processes connected", file=err)
            return 2
        t0 = time.time() + 0.3
        start_value.value = t0
        go.set()
        disp = Progress(err, every=args.progress_every, total_s=args.warmup + args.duration)
        end_at = t0 + args.warmup + args.duration
        producers = [k for k in roles if k[0] == "producer"]
        workers = [k for k in roles if k[0] == "worker"]
        stop_sent = False
        hard_deadline = end_at + 60
        while True:
            pump(0.25)
            now = time.time()
            done_p = all(k in finals or not by_key[k].is_alive() for k in producers)
            if done_p and not stop_sent:
                stop.set()
                stop_sent = True
            if done_p and all(k in finals or not by_key[k].is_alive() for k in workers):
                # Collect what is still in the queue (finals racing process exit).
                while len(finals) + len(crashed) < len(roles):
                    before = len(finals) + len(crashed)
                    pump(1.0)
                    if len(finals) + len(crashed) == before:
                        break
                break
            if now > hard_deadline:
                print("rallypoint bench: processes did not finish in time; stopping them", file=err)
                stop.set()
                break
            totals = {k: sum(v.get(k, 0) for v in progress.values()) for k in ("ops", "lifecycles", "rounds", "errors")}
            el = now - t0
            phase = "warm-up" if el < args.warmup else ("measure" if now < end_at else "draining")
            disp.update(time.monotonic(), max(el, 0.0), phase, totals)
        disp.done()
        for k, p in by_key.items():
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(5)
            if k not in finals and not any(c.startswith(f"{k[0]}{k[1]}:") for c in crashed):
                crashed.append(f"{k[0]}{k[1]}: exited {p.exitcode} without a report")
        config = {
            "scenario": args.scenario, "mode": "open" if args.rate else "closed", "rate": args.rate,
            "producers": args.producers, "workers": args.workers, "durability": durability,
            "warmup_s": args.warmup, "url": url, "spawned": bool(args.spawn),
            "batch": args.batch, "pipeline": args.pipeline, "max_messages": args.max_messages,
            "worker_concurrency": args.worker_concurrency, "settle": args.settle, "group_size": args.group_size,
            "accept_n": args.accept_n, "barrier_n": args.barrier_n, "joinset_size": args.joinset_size,
            "coalesce_ms": args.coalesce_ms, "daemon_pid": daemon.proc.pid if daemon else None, "runs": args.runs,
            # where the daemon's fdatasync runs, from its status: process, thread, inline ("" in memory)
            "sync_helper": sync_helper,
        }
        report = build_report(command=command, config=config, finals=list(finals.values()),
                              duration=float(args.duration), crashed=crashed)
        try:
            trio.run(_teardown, url, run_ids, args.api_key)
        except Exception as e:  # noqa: BLE001 - the report matters more
            print(f"rallypoint bench: could not cancel the bench run: {e}", file=err)
        print(format_table(report))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
            print(f"report written to {args.json}")
        return 0 if report["ok"] else 1
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        if daemon is not None:
            rc = daemon.stop()
            if rc not in (0, None):
                print(f"rallypoint bench: the spawned daemon exited {rc}", file=err)


def add_arguments(b) -> None:
    """The ``bench`` subcommand's options (used by rallypoint.cli)."""
    b.add_argument("--scenario", choices=SCENARIOS, default="lifecycle", help="(default %(default)s)")
    b.add_argument("--duration", type=float, default=30.0, help="measured seconds (default %(default)s)")
    b.add_argument("--warmup", type=float, default=2.0, help="seconds before measuring (default %(default)s)")
    b.add_argument("--producers", type=int, default=4, help="producer processes (default %(default)s)")
    b.add_argument("--workers", type=int, default=8, help="worker processes (default %(default)s)")
    g = b.add_mutually_exclusive_group()
    g.add_argument("--connect", metavar="URL", default=None,
                   help="load-test this daemon: it writes tens of thousands of tasks (a run named 'bench' and the "
                        "mailbox 'rallypoint-bench' are left there); never $RALLYPOINT_URL unless given here")
    g.add_argument("--spawn", action="store_true",
                   help="start a daemon with a fresh temp data dir and stop it after (the default)")
    b.add_argument("--api-key", default=os.environ.get("RALLYPOINT_API_KEY"),
                   help="API key for a daemon with keys (default $RALLYPOINT_API_KEY)")
    b.add_argument("--durability", choices=["fsync", "interval", "memory"], default=None,
                   help="with --spawn: the daemon's durability (default fsync)")
    b.add_argument("--sync-helper", choices=["process", "thread", "inline"], default=None,
                   help="with --spawn: where the daemon's fdatasync runs (rallypoint serve --sync-helper; "
                        "default process)")
    b.add_argument("--rate", type=float, default=0.0,
                   help="open loop: lifecycles per second across producers, latency from the intended send time")
    b.add_argument("--coalesce-ms", type=float, default=2.0,
                   help="open loop: arrivals due within this many ms share one submit_many (default %(default)s)")
    b.add_argument("--batch", type=int, default=64, help="tasks per submit_many (default %(default)s)")
    b.add_argument("--pipeline", type=int, default=2,
                   help="concurrent batches (lifecycle) or rounds (others) per producer (default %(default)s)")
    b.add_argument("--max-messages", type=int, default=32, help="deliveries per receive (default %(default)s)")
    b.add_argument("--lease-seconds", type=float, default=30.0,
                   help="lifecycle: the lease each receive asks for, seconds (default %(default)s)")
    b.add_argument("--settle", choices=["next", "separate"], default="next",
                   help="how a worker completes a batch: next (default: its completes and the next receive in one "
                        "round trip, delivery.complete_next) or separate (complete_many, then a receive)")
    b.add_argument("--worker-concurrency", type=int, default=2,
                   help="receive loops per worker process (default %(default)s)")
    b.add_argument("--group-size", type=int, default=12, help="groups scenario: members per group (default %(default)s)")
    b.add_argument("--accept-n", type=int, default=5, help="groups scenario: accepts to decide (default %(default)s)")
    b.add_argument("--barrier-n", type=int, default=8, help="barriers scenario: arrivals (default %(default)s)")
    b.add_argument("--joinset-size", type=int, default=8,
                   help="joinsets scenario: children per set (default %(default)s)")
    b.add_argument("--runs", type=int, default=1,
                   help="root runs to spread the load over (producer and worker i use run i mod N): 1, the run "
                        "named 'bench'; more, unnamed runs a sharded cluster spreads over its shards "
                        "(default %(default)s)")
    b.add_argument("--progress-every", type=float, default=5.0,
                   help="seconds between progress lines off a TTY (default %(default)s)")
    b.add_argument("--json", metavar="PATH", help="write the JSON report here")


def cmd_bench(args) -> int:
    """``rallypoint bench``: a throwaway daemon (``--spawn``, the default) or, only when
    asked with ``--connect URL``, the daemon there -- after saying so on stderr, since
    the load writes tens of thousands of tasks into it. Exit 0 ok, 1 errors during the
    run, 2 bad usage or could not start."""
    if args.connect is None:
        args.spawn = True  # never the user's own daemon by default ($RALLYPOINT_URL included)
    if args.producers < 1 or args.workers < 1 or args.duration <= 0 or args.warmup < 0:
        print("rallypoint bench: --producers and --workers must be >= 1, --duration > 0", file=sys.stderr)
        return 2
    # checked before anything starts (the server would refuse each request, or the report be lost)
    bad = []
    if not 1 <= args.batch <= 1000:
        bad.append(f"--batch must be 1 to 1000 tasks (one submit_many; got {args.batch})")
    if not 1 <= args.max_messages <= 100:
        bad.append(f"--max-messages must be 1 to 100 (one receive; got {args.max_messages})")
    if not 1 <= args.lease_seconds <= 3600:
        bad.append(f"--lease-seconds must be 1 to 3600 (got {args.lease_seconds:g})")
    if args.rate < 0 or args.coalesce_ms < 0:
        bad.append("--rate and --coalesce-ms must be >= 0 (--rate 0: closed loop)")
    if args.pipeline < 1 or args.worker_concurrency < 1:
        bad.append("--pipeline and --worker-concurrency must be >= 1")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        bad.append(f"--json: no directory {os.path.dirname(os.path.abspath(args.json))!r} to write the report in")
    if bad:
        for line in bad:
            print(f"rallypoint bench: {line}", file=sys.stderr)
        return 2
    if args.durability and not args.spawn:
        pass  # checked against the daemon's status in run_bench
    if args.sync_helper and args.durability == "memory":
        print("rallypoint bench: --sync-helper with --durability memory: there is no fdatasync to place",
              file=sys.stderr)
        return 2
    if args.sync_helper and not args.spawn:
        print("rallypoint bench: --sync-helper is the spawned daemon's; a daemon given with --connect was "
              "started with its own", file=sys.stderr)
        return 2
    try:
        return run_bench(args)
    except KeyboardInterrupt:
        return 130
