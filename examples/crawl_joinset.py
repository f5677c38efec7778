#!/usr/bin/env python
"""A join set over crawl tasks, racing a timeout delay (results in completion order).

The coordinator submits one child task per page to a join set, plus a durable delay
(the time budget). Fetcher PROCESSES serve the tasks with ``rallypoint.consume``; a
"fetch" reads a page from a local, made-up site with a simulated network latency (no
real network). ``join_next`` returns children in the order they finished on the server:
pages are printed as they arrive, until the delay's record comes first; then the set
is closed, which cancels the pages still in flight (in reverse submission order).

    python examples/crawl_joinset.py --connect tcp://127.0.0.1:7411 [--api-key KEY]
    python examples/crawl_joinset.py --spawn --quick
"""

from __future__ import annotations

import hashlib
import random
import time

import trio

import rallypoint
from _common import daemon, join_processes, parser, start_processes

PAGES = ["/", "/docs", "/docs/queues", "/docs/groups", "/docs/join-sets", "/docs/barriers", "/blog",
         "/blog/launch", "/pricing", "/about", "/careers", "/status"]


def fetcher_process(index: int, server: dict, run_id: str, ready_id: str) -> None:
    async def fetch(delivery):
        page, latency = delivery.input["page"], delivery.input["latency"]
        await trio.sleep(latency)  # the simulated network
        body = f"<html><title>{page}</title>{'lorem ipsum ' * len(page)}</html>"
        return {"page": page, "bytes": len(body), "etag": hashlib.sha1(body.encode()).hexdigest()[:12],
                "latency": latency, "fetcher": index}

    async def main():
        async with rallypoint.connect(**server, client_name=f"fetcher-{index}") as rs:
            await rs.scope(run_id).barriers.get(ready_id).arrive(f"fetcher-{index}")  # "I'm up"
            await rallypoint.consume(rs, "crawl", run_id, fetch, concurrency=8, lease_seconds=10)

    trio.run(main)


async def crawl(server: dict, fetchers: int, budget: float, scale: float, seed: int) -> int:
    rng = random.Random(seed)
    async with rallypoint.connect(**server, client_name="crawler") as rs:
        run = await rs.scopes.create(name="crawl")
        mbx = await rs.mailboxes.ensure("crawl")
        ready = await run.barriers.create(fetchers)
        procs = start_processes(fetcher_process, fetchers, server, run.id, ready.id)
        await ready.wait(timeout=60)  # every fetcher is connected: start the clock
        js = await run.join_sets.create("crawl")
        t0 = time.monotonic()
        names = {}
        for p in PAGES:
            latency = round(rng.uniform(0.05, 1.0) * scale, 3)
            cid = await js.submit(mbx, {"page": p, "latency": latency})
            names[cid] = f"{p} (latency {latency:.2f} s)"
        timeout_id = await js.submit_delay(budget)
        print(f"{len(PAGES)} pages submitted to join set {js.id}, time budget {budget:g} s")
        first = None
        got = 0
        while True:
            try:
                cid, value = await js.join_next(timeout=60)
            except rallypoint.ChildError as e:
                print(f"  {names.get(e.details.get('child_id'), '?')} failed: {e.details.get('failure_kind')}")
                continue
            if cid == timeout_id:
                print(f"  +{time.monotonic() - t0:5.2f} s  the time budget ran out")
                first = first or "timeout"
                break
            got += 1
            first = first or value["page"]
            print(f"  +{time.monotonic() - t0:5.2f} s  {value['page']:<18} {value['bytes']:>4} bytes "
                  f"etag {value['etag']} (latency {value['latency']:.2f} s, fetcher {value['fetcher']})")
            if got == len(PAGES):
                break
        st = await js.close(timeout=30)
        print(f"\nfirst to finish: {first}")
        print(f"fetched {got} of {len(PAGES)} pages within the budget; closing the set cancelled "
              f"{len(PAGES) - got} page(s); the timeout {'won the race' if got < len(PAGES) else 'did not fire first'}")
        print(f"join set {st.state}")
        await run.complete()  # the run's end also stops the fetchers' consume loops
        await trio.to_thread.run_sync(join_processes, procs)
    return 0


def main() -> int:
    ap = parser(__doc__.splitlines()[1])
    ap.add_argument("--fetchers", type=int, default=2)
    ap.add_argument("--budget", type=float, default=None, help="seconds (default 0.5; 0.2 with --quick)")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    scale = 0.5 if args.quick else 1.0
    budget = args.budget or (0.2 if args.quick else 0.5)
    with daemon(args) as server:
        return trio.run(crawl, server, args.fetchers, budget, scale, args.seed)


if __name__ == "__main__":
    raise SystemExit(main())
