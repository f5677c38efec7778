"""Screenshots of the console's queue trend, a run's timeline and an action's
confirmation (issue 46), from a real workload, into ``docs/console/``.

One daemon (``serve --console``, memory durability, the trends sampled every
``--trend-period`` seconds so a few minutes fill a chart) gets:

- a queue ``ingest`` fed in waves for ``--seconds`` seconds: a producer submits at a
  rate that rises and falls while two workers complete at a steady pace with a varying
  delay, so the backlog grows, then drains (depth, in flight, completions/s and the
  lifecycle latency all move);
- a run ``research agent`` with its own work: tasks (one retried, one failed), a join
  set with children consumed one by one, a group of reviewers with verdicts, and a child
  run cancelled -- the lanes of its timeline.

Then Chromium (Debian's, through Playwright) takes the pages: ``queue-trend.png``
(``/queues/ingest``), ``run-timeline.png`` (the run's page) and ``action-confirm.png``
(the confirmation of cancelling a run).

    python3 scripts/console_screenshots.py --seconds 90 --out docs/console
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import msgspec  # noqa: E402
import trio  # noqa: E402

import rallypoint  # noqa: E402
from rallypoint import protocol as p  # noqa: E402
from rallypoint.actors.api import REPLY_TYPES  # noqa: E402
from rallypoint.loadtest.runner import SpawnedDaemon  # noqa: E402


def enc(v) -> msgspec.Raw:
    return msgspec.Raw(msgspec.msgpack.encode(v))


async def waves(url: str, seconds: float) -> None:
    """The ``ingest`` queue in waves: submissions at 20-200/s (a sine over the run),
    two workers completing up to 60/s each, each task held 20-120 ms."""
    async with rallypoint.connect(url) as rs:
        async def c(op):
            return await rs._call(op, REPLY_TYPES[type(op)])

        await c(p.MailboxEnsure(name="ingest", max_attempts=3))
        run = await c(p.ScopeCreate(name="ingest stream"))
        end = trio.current_time() + seconds

        async def producer():
            i = 0
            while trio.current_time() < end:
                phase = (trio.current_time() - end + seconds) / seconds
                rate = 20 + 180 * max(0.0, math.sin(phase * 2 * math.pi)) ** 2
                await c(p.TaskSubmit(mailbox="ingest", scope_id=run.id, input=enc({"doc": i})))
                i += 1
                await trio.sleep(1 / rate)

        async def worker(name: str):
            while trio.current_time() < end + 15:
                got = (await c(p.Receive(mailbox="ingest", scope_id=run.id, max_messages=3, wait_ms=500,
                                         holder=name))).deliveries
                for d in got:
                    await trio.sleep(0.02 + 0.1 * (hash(d.task_id) % 5) / 4)
                    await c(p.DeliveryComplete(task_id=d.task_id, token=d.token))

        async with trio.open_nursery() as n:
            n.start_soon(producer)
            n.start_soon(worker, "worker-1")
            n.start_soon(worker, "worker-2")


async def agent_run(url: str) -> str:
    """A run with tasks, a join set, a group and a child run, spread over a few seconds."""
    async with rallypoint.connect(url) as rs:
        async def c(op):
            return await rs._call(op, REPLY_TYPES[type(op)])

        await c(p.MailboxEnsure(name="tools", max_attempts=3))
        await c(p.MailboxEnsure(name="reviews"))
        run = await c(p.ScopeCreate(name="research agent"))
        plan = await c(p.TaskSubmit(mailbox="tools", scope_id=run.id, input=enc("plan")))
        [d] = (await c(p.Receive(mailbox="tools", scope_id=run.id, holder="planner"))).deliveries
        await trio.sleep(0.6)
        await c(p.DeliveryComplete(task_id=plan.id, token=d.token))
        js = await c(p.JoinSetCreate(scope_id=run.id, name="searches"))
        kids = [(await c(p.JoinSetSubmit(joinset_id=js.id, mailbox="tools", input=enc(q)))).child_id
                for q in ("papers", "code", "news", "patents")]
        got = {x.task_id: x for x in (await c(p.Receive(mailbox="tools", scope_id=run.id, max_messages=4,
                                                        holder="searcher"))).deliveries}
        for k, kid in enumerate(kids):
            await trio.sleep(0.3 + 0.25 * k)
            if k == 2:  # one search fails once, then succeeds
                await c(p.DeliveryRetry(task_id=kid, token=got[kid].token))
                [again] = (await c(p.Receive(mailbox="tools", scope_id=run.id, holder="searcher"))).deliveries
                await trio.sleep(0.4)
                await c(p.DeliveryComplete(task_id=kid, token=again.token))
            else:
                await c(p.DeliveryComplete(task_id=kid, token=got[kid].token))
            await c(p.JoinNext(joinset_id=js.id))
        await c(p.JoinSetClose(joinset_id=js.id))
        g = await c(p.GroupCreate(scope_id=run.id, mailbox="reviews", condition="FIRST_ACCEPTED"))
        members = [(await c(p.GroupSubmit(group_id=g.id, input=enc(i)))).task for i in range(3)]
        ds = (await c(p.Receive(mailbox="reviews", scope_id=g.scope_id, max_messages=3, holder="reviewer"))).deliveries
        for dd in ds:
            await trio.sleep(0.3)
            await c(p.DeliveryComplete(task_id=dd.task_id, token=dd.token))
        for k in range(2):  # the first rejected, the second accepted: the group decides
            await trio.sleep(0.3)
            verdict = "REJECTED" if k == 0 else "ACCEPTED"
            await c(p.GroupVerdictOp(group_id=g.id, task_id=members[k].id, verdict=verdict))
        sub = await c(p.ScopeCreate(parent_id=run.id, name="side quest"))
        await c(p.TaskSubmit(mailbox="tools", scope_id=sub.id, input=enc("dig")))
        await trio.sleep(0.5)
        await c(p.ScopeCancel(scope_id=sub.id, reason="not needed"))
        bad = await c(p.TaskSubmit(mailbox="tools", scope_id=run.id, input=enc("summarise")))
        [d] = (await c(p.Receive(mailbox="tools", scope_id=run.id, holder="writer"))).deliveries
        await trio.sleep(0.4)
        await c(p.DeliveryReject(task_id=bad.id, token=d.token, error=enc("context too long")))
        last = await c(p.TaskSubmit(mailbox="tools", scope_id=run.id, input=enc("summarise, shorter")))
        await trio.sleep(0.3)
        [d] = (await c(p.Receive(mailbox="tools", scope_id=run.id, holder="writer"))).deliveries
        await trio.sleep(0.5)
        await c(p.DeliveryComplete(task_id=last.id, token=d.token))
        return run.id


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=90.0, help="length of the queue's waves")
    ap.add_argument("--trend-period", type=float, default=1.0, help="seconds between two trend samples")
    ap.add_argument("--out", default=str(REPO / "docs" / "console"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.environ["RALLYPOINT_CONSOLE_TREND_S"] = str(args.trend_period)
    daemon = SpawnedDaemon("memory", ["--console", "127.0.0.1:0"])
    url = daemon.start()
    console = None
    while console is None:
        line = daemon.proc.stdout.readline()
        if not line:
            raise RuntimeError("the daemon printed no CONSOLE line")
        if line.startswith("CONSOLE "):
            console = line.split()[1]
    from _browser import CHROMIUM_ARGS, chromium_path
    from playwright.sync_api import sync_playwright

    try:
        t0 = time.perf_counter()
        run_id = trio.run(agent_run, url)
        trio.run(waves, url, args.seconds)
        print(f"workload done in {time.perf_counter() - t0:.0f} s", flush=True)
        time.sleep(2 * args.trend_period)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
            page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
            page.goto(console + "/queues/ingest")
            page.wait_for_selector("body[data-trend=drawn]", timeout=30_000)
            page.locator("section.part-trend").screenshot(path=os.path.join(args.out, "queue-trend.png"))
            page.goto(console + f"/runs/{run_id}")
            page.wait_for_selector("svg.timeline")
            page.locator("section.part-timeline").screenshot(path=os.path.join(args.out, "run-timeline.png"))
            page.goto(console + f"/actions/cancel-run?target={run_id}")
            page.wait_for_selector("#confirm")
            page.screenshot(path=os.path.join(args.out, "action-confirm.png"))
            browser.close()
        for name in ("queue-trend", "run-timeline", "action-confirm"):
            path = os.path.join(args.out, name + ".png")
            print(f"{path}: {os.path.getsize(path)} bytes", flush=True)
    finally:
        daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
