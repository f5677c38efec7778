"""Page load times of the web console (issue 32): a run with 10,000 descendants, and the
Queues page while ``rallypoint bench`` loads the daemon.

One daemon (``serve --console``, fsync durability by default) gets a run tree of
``--descendants`` runs (``--fanout`` children of the root, each with the rest spread
evenly below it), then each page is loaded ``--samples`` times:

- *server*: the HTML of the page fetched with httpx (what the console's reads and
  rendering cost, plus one HTTP round trip on loopback);
- *browser*: a real headless Chromium (Debian's, through Playwright) loading the page in
  a fresh tab, by the browser's own clock (Navigation Timing): its first byte, its
  ``load`` event, and its live stream subscribed (the stream's ``ready`` event); and
  expanding one node of the tree (its first page of children fetched, by Resource
  Timing).

Then ``rallypoint bench --scenario lifecycle`` runs against the same daemon for
``--bench-duration`` seconds and the Queues page (and the big run's page) are measured
again while it runs; the bench's own throughput is printed with them.

    python3 scripts/bench_console.py --descendants 10000 --samples 20 --bench-duration 90
    python3 scripts/bench_console.py --descendants 10000 --samples 20 --in-process

With ``--cost`` (issue 46): the console's cost on the daemon instead. Rounds alternate a
daemon without the console and one with ``--console`` and 5 live pages open in Chromium
(Live with its per-second samples, Queues, the bench queue's page with its trend, Runs,
Resources: each subscribed to its stream; the trends' sampler running at its 10 s); each
round runs ``rallypoint bench --scenario lifecycle`` for ``--bench-duration`` seconds on a
fresh daemon and prints its lifecycles/s with the machine's load (``uptime``); the
medians of each side and their ratio end it (the goal: within 5 %).

    python3 scripts/bench_console.py --cost --rounds 3 --bench-duration 20

With ``--subscriptions``: where the console's cost on the daemon comes from, in process
(an embedded coordinator, no browser, no network): the coordinator's CPU per lifecycle
(submit, receive, complete; ``time.process_time``) with 0, 1 and 5 event subscriptions
open (the filters of the 5 pages of ``--cost``), each drained as the console's stream
drains it (a batch, then 0.2 s).

    python3 scripts/bench_console.py --subscriptions --lifecycles 5000

Prints one line per measurement (median and p95, ms) and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import httpx  # noqa: E402
import trio  # noqa: E402

import rallypoint  # noqa: E402
from rallypoint import protocol as p  # noqa: E402
from rallypoint.loadtest.runner import SpawnedDaemon  # noqa: E402


async def build_tree(url: str, descendants: int, fanout: int) -> dict:
    """A root with ``fanout`` children and the rest of ``descendants`` spread below them
    (one level further down); returns the root's and its newest child's ids."""
    per_child = max(0, (descendants - fanout) // fanout)
    async with rallypoint.connect(url) as rs:
        async def c(op):
            return await rs._call(op, p.ScopeView)

        root = await c(p.ScopeCreate(name="big tree", child_limit=max(1000, fanout)))
        kids = [None] * fanout
        made = [0]

        async def make_child(i):
            kids[i] = await c(p.ScopeCreate(parent_id=root.id, name=f"child-{i}", child_limit=max(1000, per_child)))
            made[0] += 1
            for j in range(per_child):
                await c(p.ScopeCreate(parent_id=kids[i].id, name=f"leaf-{i}-{j}"))
                made[0] += 1

        async with trio.open_nursery() as n:
            for i in range(fanout):
                n.start_soon(make_child, i)
        await rs.mailboxes.ensure("bench-console")
        # the newest child: on the first page of the root's children (newest first)
        return {"root": root.id, "child": max(k.id for k in kids), "descendants": made[0]}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def report(name: str, xs: list[float], rows: list) -> None:
    med, p95 = statistics.median(xs), pct(xs, 0.95)
    rows.append((name, med, p95, len(xs)))
    print(f"{name:58s} median {med:8.1f} ms   p95 {p95:8.1f} ms   (n={len(xs)})", flush=True)


def server_times(base: str, path: str, n: int) -> list[float]:
    out = []
    with httpx.Client(base_url=base, timeout=30) as client:
        client.get(path).raise_for_status()  # warm
        for _ in range(n):
            t0 = time.perf_counter()
            r = client.get(path)
            out.append((time.perf_counter() - t0) * 1000)
            r.raise_for_status()
    return out


class Browser:
    def __init__(self) -> None:
        from _browser import CHROMIUM_ARGS, chromium_path
        from playwright.sync_api import sync_playwright

        path = chromium_path()
        if path is None:
            raise RuntimeError("Chromium is not installed (apt-get install chromium)")
        self._pw = sync_playwright().start()
        self.browser = self._pw.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)

    def close(self) -> None:
        self.browser.close()
        self._pw.stop()

    def load_times(self, url: str, n: int) -> dict[str, list[float]]:
        """Per fresh page, ms from the navigation's start, by the browser's own clock
        (Navigation Timing): ``first byte``, ``load`` (the load event), and ``live`` (the
        stream's ``ready`` event arrived: the page is subscribed)."""
        out: dict[str, list[float]] = {"first byte": [], "load": [], "live": []}
        ctx = self.browser.new_context()
        try:
            for i in range(n + 1):
                page = ctx.new_page()
                page.goto(url, wait_until="load")
                page.wait_for_selector("body[data-live=on]", timeout=30_000)
                nav = page.evaluate("() => { const n = performance.getEntriesByType('navigation')[0]; "
                                    "return [n.responseStart - n.startTime, n.loadEventStart - n.startTime, "
                                    "parseFloat(document.body.dataset.liveAt) - n.startTime]; }")
                page.close()
                if i:  # the first one warms the browser's caches
                    out["first byte"].append(nav[0])
                    out["load"].append(nav[1])
                    out["live"].append(nav[2])
        finally:
            ctx.close()
        return out

    def bare_times(self, url: str, n: int) -> dict[str, list[float]]:
        """The control: a bare file of the same server (no script, no stream) in a fresh
        tab: first byte and load, ms (Navigation Timing)."""
        out: dict[str, list[float]] = {"first byte": [], "load": []}
        ctx = self.browser.new_context()
        try:
            for i in range(n + 1):
                page = ctx.new_page()
                page.goto(url, wait_until="load")
                nav = page.evaluate("() => { const n = performance.getEntriesByType('navigation')[0]; "
                                    "return [n.responseStart - n.startTime, n.loadEventStart - n.startTime]; }")
                page.close()
                if i:
                    out["first byte"].append(nav[0])
                    out["load"].append(nav[1])
        finally:
            ctx.close()
        return out

    def expand_times(self, url: str, run_id: str, n: int) -> list[float]:
        """ms from the click on a node's toggle to its children inserted (the browser's
        clock: the click handler's fetch, measured by Resource Timing, plus the insert)."""
        out = []
        ctx = self.browser.new_context()
        try:
            for _ in range(n):
                page = ctx.new_page()
                page.goto(url, wait_until="load")
                node = page.locator(f'li[data-run="{run_id}"]')
                node.locator("button.toggle").click()
                page.wait_for_selector(f'li[data-run="{run_id}"] ul.tree li')
                out.append(page.evaluate("() => { const r = performance.getEntriesByType('resource')"
                                         ".filter(e => e.name.includes('/children')); "
                                         "return r[r.length - 1].duration; }"))
                page.close()
        finally:
            ctx.close()
        return out


async def in_process(descendants: int, fanout: int, samples: int) -> None:
    """The run page rendered in process (an embedded coordinator, httpx on the ASGI
    app, no network, no other load): the big run against a run with no children, and
    each read the page makes."""
    import msgspec

    from rallypoint.console import ConsoleApp
    from rallypoint.service import Session

    async with rallypoint.open_embedded() as rs:
        svc, s = rs.node.service, Session()

        async def c(op):
            return msgspec.msgpack.decode(await svc.call(s, op), type=p.ScopeView)

        per_child = max(0, (descendants - fanout) // fanout)
        root = await c(p.ScopeCreate(name="big", child_limit=max(1000, fanout)))
        small = await c(p.ScopeCreate(name="small"))
        for _ in range(fanout):
            kid = await c(p.ScopeCreate(parent_id=root.id, child_limit=max(1000, per_child)))
            for _ in range(per_child):
                await c(p.ScopeCreate(parent_id=kid.id))
        app = ConsoleApp(svc)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://console") as client:
            for name, rid in ((f"run page, {descendants} descendants", root.id), ("run page, no children", small.id)):
                await client.get(f"/runs/{rid}")
                t0 = time.perf_counter()
                for _ in range(samples):
                    (await client.get(f"/runs/{rid}")).raise_for_status()
                print(f"in process: {name:44s} {(time.perf_counter() - t0) / samples * 1000:8.2f} ms per page",
                      flush=True)
        kinds = ["tasks", "groups", "joinsets", "barriers", "timers", "claims", "grants"]
        for op in (p.OpsRun(scope_id=root.id), p.ScopeStatus(scope_id=root.id),
                   p.ScopeList(parent_id=root.id, order="desc", limit=50),
                   p.OpsItems(scope_id=root.id, kinds=kinds, limit=20)):
            t0 = time.perf_counter()
            for _ in range(samples):
                await svc.call(s, op)
            print(f"in process: {op.__struct_config__.tag:44s} {(time.perf_counter() - t0) / samples * 1000:8.2f} ms",
                  flush=True)


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (``uptime``'s), e.g. ``2.31 2.05 1.90``."""
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process ``pid`` used so far (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_bench(url: str, seconds: float) -> float | None:
    """``rallypoint bench --scenario lifecycle`` against ``url``: lifecycles per second."""
    out = tempfile.mktemp(suffix=".json")
    rc = subprocess.run([sys.executable, "-m", "rallypoint", "bench", "--connect", url, "--scenario", "lifecycle",
                         "--duration", str(seconds), "--warmup", "2", "--json", out],
                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=seconds + 180)
    if rc.returncode != 0 or not os.path.exists(out):
        print(rc.stderr, file=sys.stderr)
        return None
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    return res["throughput"]["lifecycles_per_s"]


#: the event filters of the 5 pages of --cost: Live, Runs, a queue's page, Queues, Resources
PAGE_FILTERS = [None, ["scope.*", "task.*"], ["task.*"], ["mailbox.*"],
                ["quota.created", "pool.created", "budget.created", "schedule.fired", "schedule.skipped"]]


async def subscription_cost(subscriptions: int, lifecycles: int) -> float:
    """CPU microseconds per lifecycle of an embedded coordinator with ``subscriptions``
    event subscriptions open (the first of :data:`PAGE_FILTERS`), each drained as the
    console's stream does (a batch, then 0.2 s)."""
    import msgspec

    from rallypoint.actors.api import REPLY_TYPES
    from rallypoint.service import Session

    s = Session()
    async with rallypoint.open_embedded() as rs:
        svc = rs.node.service

        async def c(op):
            return msgspec.msgpack.decode(await svc.call(s, op), type=REPLY_TYPES[type(op)])

        await c(p.MailboxEnsure(name="q"))
        run = await c(p.ScopeCreate())
        async with trio.open_nursery() as nursery:
            for types in PAGE_FILTERS[:subscriptions]:
                sink = await svc.subscribe(s, p.EventsWatch(start="now", types=types))

                async def drain(sink=sink):
                    while True:
                        await sink.next_batch()
                        await trio.sleep(0.2)

                nursery.start_soon(drain)
            t0 = time.process_time()
            for _ in range(lifecycles // 50):
                for _ in range(50):
                    await c(p.TaskSubmit(mailbox="q", scope_id=run.id))
                for d in (await c(p.Receive(mailbox="q", scope_id=run.id, max_messages=50))).deliveries:
                    await c(p.DeliveryComplete(task_id=d.task_id, token=d.token))
            spent = time.process_time() - t0
            nursery.cancel_scope.cancel()
    return spent / lifecycles * 1e6


async def ensure_queue(url: str, name: str) -> None:
    async with rallypoint.connect(url) as rs:
        await rs.mailboxes.ensure(name, max_attempts=5)


def console_cost(args) -> int:
    """Rounds of (no console, console + live pages); prints each and the medians."""
    from rallypoint.loadtest.runner import MAILBOX

    paths = ["/live", "/queues", "/queues/" + MAILBOX, "/runs", "/resources"][:args.pages]
    results: dict[str, list[float]] = {"without the console": [], f"console + {len(paths)} live pages": []}
    #: the daemon's CPU ms per lifecycle, each round (a figure less bent by the other
    #: processes of a busy machine than the throughput is)
    cpu: dict[str, list[float]] = {k: [] for k in results}
    browser = Browser()
    try:
        for rnd in range(args.rounds):
            for side in results:
                with_console = side != "without the console"
                extra = ["--console", "127.0.0.1:0"] if with_console else []
                daemon = SpawnedDaemon(args.durability, extra)
                url = daemon.start()
                ctx = None
                try:
                    if with_console:
                        console = None
                        while console is None:
                            line = daemon.proc.stdout.readline()
                            if not line:
                                raise RuntimeError("the daemon printed no CONSOLE line")
                            if line.startswith("CONSOLE "):
                                console = line.split()[1]
                        trio.run(ensure_queue, url, MAILBOX)  # (its page needs it; the bench ensures it the same)
                        ctx = browser.browser.new_context()
                        for path in paths:
                            page = ctx.new_page()
                            page.goto(console + path, wait_until="load")
                            page.wait_for_selector("body[data-live=on]", timeout=30_000)
                    load = load_average()
                    c0, t0 = cpu_s(daemon.pid), time.perf_counter()
                    rate = run_bench(url, args.bench_duration)
                    c1, t1 = cpu_s(daemon.pid), time.perf_counter()
                    if with_console:  # the pages were live all along
                        assert all(pg.evaluate("document.body.dataset.live") == "on" for pg in ctx.pages)
                finally:
                    if ctx is not None:
                        ctx.close()
                    daemon.stop()
                # (the bench's run includes its start and warm-up: CPU over its measured lifecycles)
                per = (c1 - c0) * 1000 / (rate * args.bench_duration) if rate else None
                print(f"round {rnd + 1}: {side:28s} {rate} lifecycles/s, daemon CPU {c1 - c0:.1f} s in "
                      f"{t1 - t0:.1f} s ({per and round(per, 3)} ms per lifecycle)   (load before: {load}; after: "
                      f"{load_average()})", flush=True)
                if rate is not None:
                    results[side].append(rate)
                    cpu[side].append(per)
    finally:
        browser.close()
    base, withc = (statistics.median(v) if v else None for v in results.values())
    print(f"\n| daemon ({args.durability}, lifecycle bench {args.bench_duration:g} s, {args.rounds} rounds) "
          "| median lifecycles/s | rounds | daemon CPU ms per lifecycle (median) |\n|---|---|---|---|")
    for side, v in results.items():
        print(f"| {side} | {statistics.median(v) if v else float('nan'):.0f} | {', '.join(f'{x:.0f}' for x in v)} "
              f"| {statistics.median(cpu[side]) if cpu[side] else float('nan'):.3f} |")
    if base and withc:
        print(f"\nwith the console: {100 * (withc / base - 1):+.1f} % throughput (goal: within 5 %)")
        a, b = (statistics.median(v) for v in cpu.values())
        print(f"with the console: {100 * (b / a - 1):+.1f} % daemon CPU per lifecycle")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--descendants", type=int, default=10_000)
    ap.add_argument("--fanout", type=int, default=100, help="children of the root (default %(default)s)")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--bench-duration", type=float, default=60.0,
                    help="seconds of `rallypoint bench`; the measurements under load must end before it does")
    ap.add_argument("--durability", default="fsync", choices=("fsync", "interval", "memory"))
    ap.add_argument("--no-browser", action="store_true", help="server-side times only")
    ap.add_argument("--in-process", action="store_true",
                    help="only the run page rendered in process (embedded coordinator), and its reads")
    ap.add_argument("--cost", action="store_true",
                    help="the console's cost: lifecycle throughput with the console and 5 live pages vs without")
    ap.add_argument("--rounds", type=int, default=3, help="--cost: rounds of each side (default %(default)s)")
    ap.add_argument("--pages", type=int, default=5, help="--cost: live pages open (default %(default)s)")
    ap.add_argument("--subscriptions", action="store_true",
                    help="in process: CPU per lifecycle with 0, 1 and 5 event subscriptions open")
    ap.add_argument("--lifecycles", type=int, default=5000, help="--subscriptions: per measurement")
    args = ap.parse_args()
    if args.in_process:
        trio.run(in_process, args.descendants, args.fanout, args.samples)
        return 0
    if args.cost:
        return console_cost(args)
    if args.subscriptions:
        for k in (0, 1, 5, 0, 1, 5):
            us = trio.run(subscription_cost, k, args.lifecycles)
            print(f"in process: {k} subscriptions open: {us:6.1f} us CPU per lifecycle", flush=True)
        return 0

    daemon = SpawnedDaemon(args.durability, ["--console", "127.0.0.1:0", "--metrics", "127.0.0.1:0"])
    url = daemon.start()
    console = None
    while console is None:
        line = daemon.proc.stdout.readline()
        if not line:
            raise RuntimeError("the daemon printed no CONSOLE line")
        if line.startswith("CONSOLE "):
            console = line.split()[1]
    rows: list = []
    browser = None
    try:
        t0 = time.perf_counter()
        tree = trio.run(build_tree, url, args.descendants, args.fanout)
        print(f"built a run with {tree['descendants']} descendants in {time.perf_counter() - t0:.1f} s "
              f"({args.fanout} children of the root)", flush=True)
        big = f"/runs/{tree['root']}"
        report(f"server: run page, {tree['descendants']} descendants", server_times(console, big, args.samples), rows)
        report("server: expand one node (first 50 of its children)",
               server_times(console, f"{big.replace(tree['root'], tree['child'])}/children?part=children",
                            args.samples), rows)
        report("server: runs list (roots, newest first)", server_times(console, "/runs", args.samples), rows)
        report("server: queues page (idle)", server_times(console, "/queues", args.samples), rows)
        if not args.no_browser:
            browser = Browser()
            for what, xs in browser.bare_times(console + "/static/console.css", args.samples).items():
                report(f"browser (control): a bare file of the same server: {what}", xs, rows)
            for what, xs in browser.load_times(console + big, args.samples).items():
                report(f"browser: run page, {tree['descendants']} descendants: {what}", xs, rows)
            report("browser: expand one node (its children's fetch)",
                   browser.expand_times(console + big, tree["child"], args.samples), rows)
            for what, xs in browser.load_times(console + "/queues", args.samples).items():
                report(f"browser: queues page (idle): {what}", xs, rows)

        # the same pages while `rallypoint bench` runs
        out = tempfile.mktemp(suffix=".json")
        bench = subprocess.Popen([sys.executable, "-m", "rallypoint", "bench", "--connect", url, "--scenario",
                                  "lifecycle", "--duration", str(args.bench_duration), "--warmup", "2", "--json", out],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(4)  # warm-up done, load steady
        report("server: queues page under bench load", server_times(console, "/queues", args.samples), rows)
        report(f"server: run page, {tree['descendants']} descendants, under load",
               server_times(console, big, args.samples), rows)
        if browser is not None:
            for what, xs in browser.load_times(console + "/queues", args.samples).items():
                report(f"browser: queues page under bench load: {what}", xs, rows)
        during = bench.poll() is None  # the measurements above were made while the bench ran
        rc = bench.wait(args.bench_duration + 120)
        if rc != 0:
            print(bench.stderr.read(), file=sys.stderr)
        rate = None
        if os.path.exists(out):
            with open(out) as f:
                res = json.load(f)
            rate = res["throughput"]["lifecycles_per_s"]
            for op_name, lat in sorted(res.get("latency_ms", {}).items()):
                print(f"bench latency {op_name}: {json.dumps(lat)}", flush=True)
            os.unlink(out)
        print(f"bench (lifecycle, {args.bench_duration:g} s): {rate} lifecycles/s", flush=True)
        if not during:
            print("WARNING: the bench ended before the measurements under load did: raise --bench-duration",
                  flush=True)
    finally:
        if browser is not None:
            browser.close()
        daemon.stop()
    print("\n| page | median ms | p95 ms | n |\n|---|---|---|---|")
    for name, med, p95, n in rows:
        print(f"| {name} | {med:.1f} | {p95:.1f} | {n} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
