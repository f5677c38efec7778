"""A run's timeline in the console (issue 46): lanes built from the run's events -- a
task's queued and running stretches and its end, a join set's steps, a group's verdicts,
a child run -- and drawn as SVG bars on the run page. Embedded, under MockClock: the
stretches are the mock clock's seconds."""

from __future__ import annotations

import re

import httpx
import msgspec
import trio

from rallypoint import protocol as p
from rallypoint.actors.api import REPLY_TYPES
from rallypoint.console import ConsoleApp
from rallypoint.console.timeline import lanes_of, read_events
from rallypoint.service import Session

S = Session(space="default")


async def call(rs, op):
    return msgspec.msgpack.decode(await rs.node.service.call(S, op), type=REPLY_TYPES[type(op)])


class Ctx:
    def __init__(self, app):
        self.app = app

    async def call(self, op):
        return await self.app.call(S, op)


async def test_lanes_tell_each_tasks_waits_and_runs_and_the_join_set_steps(autojump_clock, ers):
    app = ConsoleApp(ers.node.service)
    run = await call(ers, p.ScopeCreate(name="agent"))
    child = await call(ers, p.ScopeCreate(parent_id=run.id, name="sub"))
    await call(ers, p.MailboxEnsure(name="jobs", max_attempts=3))
    t1 = await call(ers, p.TaskSubmit(mailbox="jobs", scope_id=run.id))
    await trio.sleep(3)
    [d] = (await call(ers, p.Receive(mailbox="jobs", scope_id=run.id, lease_ms=60_000))).deliveries
    await trio.sleep(2)
    await call(ers, p.DeliveryRetry(task_id=t1.id, token=d.token))
    [d] = (await call(ers, p.Receive(mailbox="jobs", scope_id=run.id, lease_ms=60_000))).deliveries
    await trio.sleep(4)
    await call(ers, p.DeliveryComplete(task_id=t1.id, token=d.token))
    js = await call(ers, p.JoinSetCreate(scope_id=run.id, name="fan"))
    kid = (await call(ers, p.JoinSetSubmit(joinset_id=js.id, mailbox="jobs"))).child_id
    [d] = (await call(ers, p.Receive(mailbox="jobs", scope_id=run.id))).deliveries
    await call(ers, p.DeliveryReject(task_id=kid, token=d.token))
    await call(ers, p.JoinNext(joinset_id=js.id))
    await call(ers, p.JoinSetClose(joinset_id=js.id))
    await call(ers, p.ScopeCancel(scope_id=child.id))

    events, more = await read_events(Ctx(app), run.id)
    assert not more
    lanes = {ln.id: ln for ln in lanes_of(events, run.id)}
    task = lanes[t1.id]
    kinds = [(s.kind, None if s.end_ms is None else round((s.end_ms - s.start_ms) / 1000)) for s in task.segments]
    assert kinds == [("queued", 3), ("running", 2), ("queued", 0), ("running", 4), ("succeeded", 0)]
    assert task.outcome == "succeeded"
    assert lanes[kid].outcome == "failed"
    fan = lanes[js.id]
    assert fan.kind == "joinset" and fan.outcome == "closed"
    assert [n.split(" ")[0] for _, n in fan.ticks] == ["child_done", "consumed", "closing"]
    assert lanes[child.id].kind == "run" and lanes[child.id].outcome == "cancelled"
    assert run.id not in lanes  # the run itself is the page, not a lane

    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://console.test")
    page = await client.get(f"/runs/{run.id}")
    assert page.status_code == 200 and '<svg class="timeline"' in page.text
    svg = page.text[page.text.index('<svg class="timeline"'):page.text.index("</svg>")]
    assert len(re.findall(r'class="lane lane-task"', svg)) == 2 and 'data-outcome="closed"' in svg
    assert len(re.findall(r'class="seg seg-running"', svg)) == 3 and "style=" not in svg  # (CSP: no inline style)
    assert f'href="/tasks/{t1.id}"' in svg


async def test_a_run_without_entities_says_so(autojump_clock, ers):
    app = ConsoleApp(ers.node.service)
    run = await call(ers, p.ScopeCreate(name="empty"))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://console.test")
    r = await client.get(f"/runs/{run.id}?part=timeline")
    assert r.status_code == 200 and "no task, join set" in r.text
