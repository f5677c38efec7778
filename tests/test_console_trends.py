"""The console's queue trends (issue 46): the ring sampled from operations (depth, in
flight, completions/s, p50/p99 lifecycle latency from the events), its bound, the queue
page's chart data and table, and the pacing of the Live stream's messages. Embedded,
under MockClock (autojump): the latencies are the mock clock's. The chart drawn in a
browser: ``tests/test_console_acts_browser.py``."""

from __future__ import annotations

import json
import re
from html import unescape

import httpx
import msgspec
import trio

from rallypoint import protocol as p
from rallypoint.actors.api import REPLY_TYPES
from rallypoint.console import ConsoleApp
from rallypoint.console import trends as tr
from rallypoint.service import Session

S = Session(space="default")


async def call(rs, op):
    return msgspec.msgpack.decode(await rs.node.service.call(S, op), type=REPLY_TYPES[type(op)])


async def work(rs, queue: str, n: int, run_s: float) -> None:
    """Submit ``n`` tasks, let them wait ``run_s`` seconds, then receive and complete them."""
    run = await call(rs, p.ScopeCreate(name="load"))
    for _ in range(n):
        await call(rs, p.TaskSubmit(mailbox=queue, scope_id=run.id))
    await trio.sleep(run_s)
    got = (await call(rs, p.Receive(mailbox=queue, scope_id=run.id, max_messages=n))).deliveries
    for d in got:
        await call(rs, p.DeliveryComplete(task_id=d.task_id, token=d.token))


def test_quantile_is_the_nearest_rank():
    assert tr.quantile([], 0.5) is None
    assert tr.quantile([7.0], 0.99) == 7.0
    vals = [float(i) for i in range(1, 101)]
    assert tr.quantile(vals, 0.5) == 50.0 and tr.quantile(vals, 0.99) == 99.0 and tr.quantile(vals, 1.0) == 100.0


def test_a_series_keeps_the_last_capacity_samples_oldest_first():
    s = tr.Series()
    for i in range(tr.CAPACITY + 25):
        s.add((float(i), i, None, 1.5, None, 2.0))
    rows = s.rows()
    assert len(rows) == tr.CAPACITY == 360
    assert rows[0][0] == 25.0 and rows[-1][0] == tr.CAPACITY + 24.0
    assert rows[-1][2] is None and rows[-1][3] == 1.5
    assert [r[0] for r in s.rows(since=tr.CAPACITY + 20.0)] == [float(tr.CAPACITY + i) for i in range(20, 25)]
    assert sum(len(c) * c.itemsize for c in s.cols) == 6 * 360 * 8  # the memory bound the docs give


async def test_samples_give_depth_in_flight_rate_and_lifecycle_latency(autojump_clock, ers):
    app = ConsoleApp(ers.node.service)
    await call(ers, p.MailboxEnsure(name="jobs"))
    await call(ers, p.MailboxEnsure(name="idle"))
    await app.trends.sample(now_s=1000.0)  # the first: the cursor starts at the newest event
    await work(ers, "jobs", 10, run_s=2.0)  # ten tasks, each 2 s from submission to its end
    run = await call(ers, p.ScopeCreate(name="backlog"))
    for _ in range(4):
        await call(ers, p.TaskSubmit(mailbox="jobs", scope_id=run.id))
    await call(ers, p.Receive(mailbox="jobs", scope_id=run.id, max_messages=1, lease_ms=60_000))
    await app.trends.sample(now_s=1010.0)
    rows = app.trends.get("default", "jobs").rows()
    assert rows[0][:4] == (1000.0, 0.0, 0.0, None)  # no rate before a second sample
    t, depth, in_flight, rate, p50, p99 = rows[1]
    assert (t, depth, in_flight, rate) == (1010.0, 3.0, 1.0, 1.0)  # 10 done in 10 s
    assert 2000.0 <= p50 <= 2100.0 and 2000.0 <= p99 <= 2100.0
    # a quiet period: no latency, no rate; the idle queue has a series too
    await app.trends.sample(now_s=1020.0)
    last = app.trends.get("default", "jobs").rows()[-1]
    assert last[3] == 0.0 and last[4] is None and last[5] is None
    assert [r[1] for r in app.trends.get("default", "idle").rows()] == [0.0, 0.0, 0.0]
    assert app.trends.statistics()["pending"] == 4  # the backlog's submissions, waiting for their ends


async def test_the_queue_page_carries_the_chart_data_and_the_same_figures_as_a_table(autojump_clock, ers):
    app = ConsoleApp(ers.node.service)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://console.test")
    await call(ers, p.MailboxEnsure(name="jobs"))
    r = await client.get("/queues/jobs")
    assert "no sample yet" in r.text and "data-trend" not in r.text
    await app.trends.sample(now_s=1000.0)
    await work(ers, "jobs", 5, run_s=1.0)
    await app.trends.sample(now_s=1005.0)
    r = await client.get("/queues/jobs")
    m = re.search(r'data-trend="([^"]*)"', r.text)
    assert m
    cols = json.loads(unescape(m.group(1)))
    assert cols["t"] == [1000.0, 1005.0] and cols["done_per_s"] == [None, 1.0] and cols["depth"] == [0.0, 0.0]
    assert 1000.0 <= cols["p50_ms"][1] <= 1100.0
    table = r.text[r.text.index('<table class="trend-table">'):]
    first_row = re.search(r"<tbody><tr>(.*?)</tr>", table).group(1)  # newest first
    assert re.findall(r"<td>(.*?)</td>", first_row)[1:4] == ["0", "0", "1.0"]
    js = await client.get("/static/vendor/uPlot.iife.min.js")
    assert js.status_code == 200 and b"uPlot" in js.content
    assert (await client.get("/static/vendor/uPlot.min.css")).status_code == 200
    assert (await client.get("/static/vendor/../app.py")).status_code == 404


async def test_pending_submissions_are_bounded(autojump_clock, ers, monkeypatch):
    monkeypatch.setattr(tr, "MAX_PENDING", 3)
    app = ConsoleApp(ers.node.service)
    await call(ers, p.MailboxEnsure(name="jobs"))
    await app.trends.sample(now_s=1.0)
    run = await call(ers, p.ScopeCreate())
    for _ in range(5):
        await call(ers, p.TaskSubmit(mailbox="jobs", scope_id=run.id))
    await app.trends.sample(now_s=2.0)
    assert app.trends.statistics()["pending"] == 3


async def test_the_sampler_survives_a_failing_sample_and_keeps_its_period(autojump_clock, ers, monkeypatch):
    app = ConsoleApp(ers.node.service)
    app.trends.period_s = 10.0
    seen: list[float] = []
    real = app.trends.sample

    async def flaky(now_s=None):
        seen.append(trio.current_time())
        if len(seen) == 1:
            raise ValueError("a bug in a sample")
        await real(now_s)

    monkeypatch.setattr(app.trends, "sample", flaky)
    await call(ers, p.MailboxEnsure(name="jobs"))
    with trio.move_on_after(35):
        await app.trends.run()
    assert len(seen) == 4 and [round(b - a) for a, b in zip(seen, seen[1:])] == [10, 10, 10]
    assert app.trends.failures == 1 and app.trends.samples == 3


async def test_the_live_streams_events_messages_are_paced(autojump_clock, ers):
    """Issue 46 (the console's cost): an ``events`` stream sends at most one message per
    EVENTS_EVERY_S (0.2 s); what arrives meanwhile joins the next message, none lost
    from the count."""
    from rallypoint.console import app as console_app

    app = ConsoleApp(ers.node.service)

    class Sink:  # an event every 10 ms
        def __init__(self):
            self.buf: list = []

        async def next_batch(self):
            while not self.buf:
                await trio.sleep(0.001)
            out, self.buf = self.buf, []
            return out

    sink = Sink()
    raw = msgspec.msgpack.encode(p.EventView(seq=1, type="task.submitted", kind="task", id="tsk_x",
                                             at="2026-12-07T00:00:00.000Z"))
    sent: list = []

    async def emit(event, data, cursor=None):  # the cursor: a cluster stream's resume point
        sent.append((trio.current_time(), len(data["events"]) + data["skipped"]))

    counter = [0]
    async with trio.open_nursery() as n:
        async def produce():
            for _ in range(300):
                sink.buf.append(raw)
                await trio.sleep(0.01)

        n.start_soon(produce)
        n.start_soon(app._events_loop, sink, "events", emit, counter)
        await trio.sleep(2.0)
        n.cancel_scope.cancel()
    assert counter[0] == 200 and sum(k for _, k in sent) <= 200
    assert len(sent) <= 2.0 / console_app.EVENTS_EVERY_S + 1  # (unpaced: one message per event, 200)
    gaps = [b - a for (a, _), (b, _) in zip(sent, sent[1:])]
    assert min(gaps) >= console_app.EVENTS_EVERY_S - 1e-6
