#!/usr/bin/env python
"""Nested work: crawler tasks fan out into join sets of their own; cancel it halfway.

The top run "crawl" has a join set of *site* tasks. A crawler worker takes a site, gives
its task a run of its own (``delivery.run()``), and fans out there: a join set "pages"
with one fetch task per page, whose results it joins in completion order. Fetcher
workers serve the page tasks (they receive for the top run, which includes every
task's own run below it). Halfway through -- when half of all pages were fetched -- the
top run is cancelled.

One step cancels everything: the site tasks, each crawler's own run, its "pages" set
and every page task in it, in reverse submission order; the consume loops stop. The
example then walks the whole tree -- runs, tasks, join sets -- and exits non-zero if
anything is still pending anywhere.

    python examples/crawl_nested.py --connect tcp://127.0.0.1:7411 [--api-key KEY]
    python examples/crawl_nested.py --spawn --quick
"""

from __future__ import annotations

import random

import trio

import rallypoint
from _common import daemon, parser

SITES = {
    "docs.example": ["/", "/queues", "/groups", "/join-sets", "/barriers", "/timers"],
    "blog.example": ["/", "/launch", "/runs", "/leases", "/fencing"],
    "shop.example": ["/", "/pricing", "/checkout", "/cart"],
    "wiki.example": ["/", "/Main", "/Help", "/Random", "/Recent", "/About", "/Talk"],
}
UNFINISHED = ("QUEUED", "RUNNING")


async def crawler(delivery):
    """A site task: its own run, a join set of page tasks, their results joined."""
    site = delivery.input["site"]
    run = await delivery.run()  # the task's own run: it ends with this task
    pages = await run.join_sets.create("pages")
    for page in SITES[site]:
        await pages.submit("pages", {"site": site, "page": page, "latency": delivery.input["latency"]})
    fetched = []
    for _ in SITES[site]:
        try:
            _, result = await pages.join_next()
            fetched.append(result["page"])
        except rallypoint.ChildError as e:
            print(f"  {site}: a page failed ({e.failure_kind})", flush=True)
    return {"site": site, "pages": fetched}


async def crawl(server: dict, quick: bool, seed: int, cancel: bool) -> int:
    rng = random.Random(seed)
    total = sum(len(p) for p in SITES.values())
    half = trio.Event()
    fetched: list[str] = []

    async def fetcher(delivery):
        await trio.sleep(delivery.input["latency"] * rng.uniform(0.5, 1.5))  # the simulated network
        fetched.append(f"{delivery.input['site']}{delivery.input['page']}")
        if len(fetched) >= total // 2:
            half.set()
        return {"page": delivery.input["page"], "bytes": 100 * len(delivery.input["page"])}

    async with rallypoint.connect(**server, client_name="crawl-main") as rs:
        top = await rs.scopes.create(name="crawl")
        await rs.mailboxes.ensure("sites")
        await rs.mailboxes.ensure("pages")
        sites = await top.join_sets.create("sites")
        latency = 0.05 if quick else 0.3
        names = {}
        for site in SITES:
            names[await sites.submit("sites", {"site": site, "latency": latency})] = site
        print(f"{len(SITES)} sites, {total} pages; the top run {top.id} is cancelled after {total // 2} pages")

        async def workers(mailbox, handler, concurrency, name):
            async with rallypoint.connect(**server, client_name=name) as wrs:
                stats = await rallypoint.consume(wrs, mailbox, top.id, handler, concurrency=concurrency,
                                                 lease_seconds=10, wait=5)
                print(f"  {name}: stopped ({stats.stop_reason}): {stats.completed} completed, "
                      f"{stats.lost} stopped by the cancel", flush=True)

        async with trio.open_nursery() as n:
            n.start_soon(workers, "sites", crawler, 2, "crawlers")
            n.start_soon(workers, "pages", fetcher, 3, "fetchers")
            done_sites = []

            async def joiner():
                try:
                    while True:
                        cid, value = await sites.join_next()
                        done_sites.append(value["site"])
                        print(f"  site {value['site']} done: {len(value['pages'])} pages", flush=True)
                except rallypoint.ChildError as e:  # the first cancelled site: the cancel happened
                    print(f"  site {names.get(e.child_id)} ended {e.failure_kind}", flush=True)
                except rallypoint.JoinSetExhaustedError:
                    pass

            n.start_soon(joiner)
            await half.wait()
            if not cancel:
                print("(--no-cancel: the top run is left running; the check below must fail)")
                await trio.sleep(0.2)
                n.cancel_scope.cancel()
            else:
                st = await top.cancel(reason="halfway")
                print(f"cancelled the top run after {len(fetched)} pages ({st.stored_state})")
        print(f"sites done before the cancel: {len(done_sites)} of {len(SITES)}")
        return await check_nothing_pending(rs, top, sites)


async def check_nothing_pending(rs, top, sites) -> int:
    """Walk the run tree from ``top``: every run inactive, no task QUEUED or RUNNING
    (or completing), every join set CLOSED with each child finished and consumed."""
    problems: list[str] = []
    runs = tasks = sets = 0
    stack = [top.id]
    while stack:
        run = rs.scope(stack.pop())
        st = await run.status()
        runs += 1
        if st.effective != "INACTIVE":
            problems.append(f"run {st.id} is still {st.effective}")
        pending = {k: v for k, v in st.tasks.items() if k in UNFINISHED and v}
        if pending:
            problems.append(f"run {st.id} has unfinished tasks {pending}")
        tasks += sum(st.tasks.values())
        stack.extend(c.id for c in await run.children())
    checked = [(await sites.status(), "the top run")]
    for c in checked[0][0].children:  # each site task's own run has a "pages" set
        run_id = (await rs.task(c.child_id).status()).run_id
        if run_id is not None:
            try:
                pages = await rs.scope(run_id).join_sets.by_name("pages")
            except rallypoint.NotFoundError:
                continue  # cancelled after its run was made, before it made its set: nothing there
            checked.append((await pages.status(), c.child_id))
    for js_st, owner in checked:
        sets += 1
        if js_st.state != "CLOSED" or not js_st.submitted == js_st.finished == js_st.consumed:
            problems.append(f"join set {js_st.id} (of {owner}) is {js_st.state}: {js_st.submitted} submitted, "
                            f"{js_st.finished} finished, {js_st.consumed} consumed")
        for c in js_st.children:
            if c.kind == "task":
                info = await rs.task(c.child_id).status()
                if info.state in UNFINISHED or info.completing:
                    problems.append(f"task {c.child_id} is {info.state}")
    if problems:
        print("PENDING after the cancel:")
        for p in problems:
            print("  " + p)
        return 1
    print(f"nothing pending: {runs} runs, {tasks} tasks, {sets} join sets checked")
    return 0


def main() -> int:
    ap = parser(__doc__.splitlines()[1])
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--no-cancel", action="store_true", help="(for tests) never cancel: the check must fail")
    args = ap.parse_args()
    with daemon(args) as server:
        return trio.run(crawl, server, args.quick, args.seed, not args.no_cancel)


if __name__ == "__main__":
    raise SystemExit(main())
