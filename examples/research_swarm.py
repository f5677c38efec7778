#!/usr/bin/env python
"""A research swarm under three limits: browser sessions (a pool), a search API's rate
limit (a quota: 60 requests a minute) and model spend (a budget: $5).

The coordinator submits one task per topic, each requiring one unit of the ``browsers``
pool (4 sessions): admission hands a topic out only together with a session, taken in
the same step and given back when the task ends, so at most 4 run at once however many
handlers wait. Researcher PROCESSES serve them with ``rallypoint.consume``: each topic,
holding its browser session, makes a few search calls --
each takes a unit of the ``search-api`` quota, waiting in line on the server when the
minute's 60 are used up -- then summarizes with a (simulated) model call whose worst
case is reserved on the ``model-spend`` budget for that delivery and settled at its
actual cost. When the budget cannot hold a call the topic is skipped ("over budget"),
so the swarm stops spending at the limit; nothing is charged twice, and a researcher
that dies mid-topic releases its reservation when its lease runs out.

    python examples/research_swarm.py --connect tcp://127.0.0.1:7411 [--api-key KEY]
    python examples/research_swarm.py --spawn --quick

With --quick the sizes shrink (6 requests per 2 s, $1.50) so that the quota makes
researchers wait and the budget runs out within seconds.
"""

from __future__ import annotations

import random
import time

import trio

import rallypoint
from _common import daemon, join_processes, parser, start_processes

TOPICS = ["actors", "fencing tokens", "group commit", "write-ahead logs", "lmdb", "msgspec", "trio nurseries",
          "structured concurrency", "token buckets", "fixed windows", "leases", "idempotency keys",
          "snapshots", "backpressure", "rate limits", "budgets", "join sets", "barriers", "timers", "quorums"]
SESSIONS = 4  # at most 4 browser sessions at once


def researcher_process(index: int, server: dict, run_id: str, per_worker: int, budget: str, seed: int) -> None:
    rng = random.Random(seed + index)

    async def main():
        async with rallypoint.connect(**server, client_name=f"researcher-{index}") as rs:
            search, spend = rs.quota("search-api"), rs.budget(budget)

            async def research(delivery):
                topic = delivery.input["topic"]
                # POOL: the task required a browser session; admission handed it out with
                # one (delivery.grants), taken in the same step, given back when it ends
                assert [(g.pool, g.units) for g in delivery.grants] == [("browsers", 1)]
                calls = rng.randint(2, 3)
                for _ in range(calls):  # a unit each; waits in line when the minute is used up
                    await search.take(scope=run_id, wait=120, holder=f"researcher-{index}")
                    await trio.sleep(rng.uniform(0.01, 0.05))
                try:  # the model call's worst case, held for this delivery (released if it dies)
                    hold = await spend.reserve(40, scope=run_id, delivery=delivery, holder=f"researcher-{index}")
                except rallypoint.InsufficientBudgetError as e:
                    return {"topic": topic, "skipped": "over budget", "searches": calls,
                            "left_minor": e.details["available_minor"]}
                cost = rng.randint(15, 38)  # what the call actually cost, in cents
                await trio.sleep(rng.uniform(0.05, 0.2))
                settled = await hold.settle(cost, usage_key=f"model:{delivery.task_id}")
                return {"topic": topic, "searches": calls, "cost_minor": settled.charged_minor, "by": index}

            await rallypoint.consume(rs, "topics", run_id, research, concurrency=per_worker, lease_seconds=30)

    trio.run(main)


async def coordinate(server: dict, researchers: int, topics: list[str], per_minute: int, window: float,
                     budget_minor: int, seed: int) -> int:
    per_worker = SESSIONS  # more handlers than sessions: the pool is what keeps it at SESSIONS
    t0 = time.monotonic()
    async with rallypoint.connect(**server, client_name="research-lead") as rs:
        run = await rs.scopes.create(name="research")
        mbx = await rs.mailboxes.ensure("topics")
        search = await rs.quotas.ensure("search-api", units_limit=per_minute, window_seconds=window)
        budget = f"model-spend-{run.id[-8:]}"  # this swarm's own $5 (the search API's limit is shared)
        spend = await rs.budgets.ensure(budget, limit=budget_minor, currency="USD", scale=2)
        browsers = await rs.pools.ensure("browsers", units_total=SESSIONS)
        print(f"{len(topics)} topics, {researchers} researchers x {per_worker} handlers, {SESSIONS} browser sessions; "
              f"search-api {per_minute} per {window:g} s; {budget} "
              f"{rallypoint.format_minor(budget_minor, 2)} USD")
        tickets = [await mbx.submit({"topic": t}, key=f"topic-{i}", scope=run,
                                    requirements={"pools": {"browsers": 1}})  # a browser session each
                   for i, t in enumerate(topics)]
        procs = start_processes(researcher_process, researchers, server, run.id, per_worker, budget, seed)
        peak = 0
        async with trio.open_nursery() as n:
            async def watch_browsers():
                nonlocal peak
                while True:
                    peak = max(peak, (await browsers.status()).units_used)
                    await trio.sleep(0.01)

            n.start_soon(watch_browsers)
            infos = await rs.results(tickets, timeout=600)
            n.cancel_scope.cancel()
        await run.cancel()  # the work is done: the researchers' consume loops return
        await trio.to_thread.run_sync(join_processes, procs)
        done = [i.outcome for i in infos if i.state == "SUCCEEDED" and "skipped" not in i.outcome]
        skipped = [i.outcome for i in infos if i.state == "SUCCEEDED" and "skipped" in i.outcome]
        q = await search.status()
        b = await spend.status()
        print(f"pages done: {len(done)} in {time.monotonic() - t0:.1f} s")
        for o in done[:5]:
            print(f"  {o['topic']:<24} {o['searches']} searches, {rallypoint.format_minor(o['cost_minor'], 2)} USD "
                  f"(researcher {o['by']})")
        print(f"over budget: {len(skipped)} topics skipped")
        print(f"browser sessions: at most {peak} of {SESSIONS} in use at once (the pool), "
              f"{researchers * per_worker} handlers ready")
        ours = sum(o["searches"] for o in done + skipped)  # (a topic's last attempt)
        print(f"search calls: {ours} by this swarm, never more than {per_minute} per window "
              f"(search-api is shared: {q.consumed_total} taken from it since it was made)")
        print(f"spend: {rallypoint.format_minor(b.settled_minor, 2)} of {rallypoint.format_minor(b.limit_minor, 2)} "
              f"USD settled, {rallypoint.format_minor(b.reserved_minor, 2)} still reserved")
        ok = len(done) + len(skipped) == len(topics) and b.settled_minor <= b.limit_minor and peak <= SESSIONS
        return 0 if ok else 1


def main() -> int:
    ap = parser(__doc__.splitlines()[1])
    ap.add_argument("--researchers", type=int, default=2, help="researcher processes (4 sessions shared)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if args.quick:
        topics, per_minute, window, budget = TOPICS[:10], 6, 2.0, 150
    else:
        topics, per_minute, window, budget = TOPICS, 60, 60.0, 500
    with daemon(args) as server:
        return trio.run(coordinate, server, args.researchers, topics, per_minute, window, budget, args.seed)


if __name__ == "__main__":
    raise SystemExit(main())
