"""The console's actions, trends and timelines in a real headless browser (issue 46):
Debian's Chromium driven by Playwright (``tests/_browser.py``) against a ``rallypoint
serve --console`` daemon with keys. Each action is clicked on its page, confirmed on
the confirmation page, and its effect read back through the SDK, with its
``console.action`` event naming the key; a read-only key's pages show no button and
its POST is refused; a forged POST without the token is refused (403); the queue trend
is drawn by uPlot and a run's timeline shows its bars. Screenshots go to
``$RALLYPOINT_SCREENSHOTS`` (else the test's temp dir)."""

from __future__ import annotations

import re

import msgspec
import pytest
import trio

import rallypoint
from rallypoint import protocol as p
from rallypoint.actors.api import REPLY_TYPES

from test_console import ConsoleDaemon, _create_key, _page, chromium, shots  # noqa: F401 (fixtures)


def enc(v) -> msgspec.Raw:
    return msgspec.Raw(msgspec.msgpack.encode(v))


async def _sdk(url: str, key: str, *ops):
    async with rallypoint.connect(url, api_key=key) as rs:
        return [await rs._call(op, REPLY_TYPES[type(op)]) for op in ops]


async def _setup(url: str, key: str) -> dict:
    """A run with a child and tasks under lease, a join set, a schedule."""
    async with rallypoint.connect(url, api_key=key) as rs:
        async def c(op):
            return await rs._call(op, REPLY_TYPES[type(op)])

        run = await c(p.ScopeCreate(name="stuck agent"))
        child = await c(p.ScopeCreate(parent_id=run.id, name="sub-agent"))
        await c(p.MailboxEnsure(name="jobs", max_attempts=5))
        pending = await c(p.TaskSubmit(mailbox="jobs", scope_id=child.id))
        work = await c(p.ScopeCreate(name="work"))
        tasks = [(await c(p.TaskSubmit(mailbox="jobs", scope_id=work.id, input=enc(i)))).id for i in range(3)]
        got = (await c(p.Receive(mailbox="jobs", scope_id=work.id, max_messages=3, lease_ms=600_000,
                                 holder="poison-worker"))).deliveries
        assert {d.task_id for d in got} == set(tasks)
        js = await c(p.JoinSetCreate(scope_id=work.id, name="fan-out"))
        await c(p.JoinSetSubmit(joinset_id=js.id, mailbox="jobs"))
        sched = await c(p.ScheduleCreate(name="nightly-report", cron=["0 3 * * *"]))
        return {"run": run.id, "child": child.id, "pending": pending.id, "work": work.id, "tasks": tasks,
                "joinset": js.id, "schedule": sched.id}


def _act(page, base: str, path: str, action: str, note: str | None = None) -> str:
    """Open ``path``, click the action's button, confirm; the result page's text."""
    page.goto(base + path)
    page.click(f'button[data-action="{action}"]')
    page.wait_for_url(re.compile(rf"/actions/{action}\?target="))
    if note is not None:
        page.fill("input[name=note]", note)
    page.click("#confirm")
    page.wait_for_selector(f'p.done[data-action="{action}"]')
    return page.inner_text("main")


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    from _browser import require_browser

    require_browser()
    data = str(tmp_path_factory.mktemp("console-acts"))
    writer = _create_key(data, "default", "coordination_read", "coordination_write", name="oncall")
    reader = _create_key(data, "default", "coordination_read", name="viewer")
    admin = _create_key(data, "default", "admin", name="setup")  # (queues, schedules: resource_config)
    d = ConsoleDaemon(["--durability", "interval", "--data-dir", data])
    try:
        yield d, writer, reader, admin
    finally:
        d.stop()


def _sign_in(page, base: str, secret: str) -> None:
    page.goto(base + "/login")
    page.fill("input[name=key]", secret)
    page.click("main button")
    page.wait_for_url(re.compile(r"/runs$"))


def test_each_action_from_the_page_and_its_effect_through_the_sdk(chromium, keyed, shots):
    d, writer, _, admin = keyed
    ids = trio.run(_setup, d.url, admin)
    ctx, page, errors = _page(chromium)
    try:
        _sign_in(page, d.console, writer)
        # cancel a run with its subtree
        page.goto(d.console + f"/runs/{ids['run']}")
        page.click('button[data-action="cancel-run"]')
        assert "its whole subtree (2 runs)" in page.inner_text("main")
        shots(page, "action-confirm")
        page.fill("input[name=note]", "runaway agent")
        page.click("#confirm")
        page.wait_for_selector('p.done[data-action="cancel-run"]')
        done = page.inner_text("main")
        key_id = re.search(r"key (key_\w+)", done).group(1)
        run, child, task = trio.run(_sdk, d.url, admin, p.ScopeStatus(scope_id=ids["run"]),
                                    p.ScopeStatus(scope_id=ids["child"]), p.TaskStatus(task_id=ids["pending"]))
        assert run.stored_state == "CANCELLED" and child.effective != "ACTIVE" and task.state == "CANCELLED"
        # retry, fail, release the tasks a poison worker holds
        t0, t1, t2 = ids["tasks"]
        _act(page, d.console, f"/tasks/{t0}", "retry-task")
        _act(page, d.console, f"/tasks/{t1}", "fail-task", note="poison input")
        _act(page, d.console, f"/tasks/{t2}", "release-lease")
        a, b, c = trio.run(_sdk, d.url, admin, *(p.TaskStatus(task_id=t) for t in ids["tasks"]))
        assert (a.state, a.attempt) == ("QUEUED", 2)
        assert (b.state, b.outcome_reason) == ("FAILED", "rejected")
        assert (c.state, c.attempt) == ("QUEUED", 1)
        # close the join set; pause then unpause the schedule
        _act(page, d.console, f"/joinsets/{ids['joinset']}", "close-joinset")
        [js] = trio.run(_sdk, d.url, admin, p.OpsJoinSet(joinset_id=ids["joinset"]))
        assert js.joinset.state != "OPEN"
        _act(page, d.console, "/resources", "pause-schedule", note="maintenance window")
        [s] = trio.run(_sdk, d.url, admin, p.ScheduleGet(schedule=ids["schedule"]))
        assert s.paused and s.note == "maintenance window"
        page.goto(d.console + "/resources")
        assert page.locator('tr[data-schedule="nightly-report"] button[data-action="unpause-schedule"]').count() == 1
        _act(page, d.console, "/resources", "unpause-schedule")
        [s] = trio.run(_sdk, d.url, admin, p.ScheduleGet(schedule=ids["schedule"]))
        assert not s.paused
        # every action is in the events, with the key that did it
        [evs] = trio.run(_sdk, d.url, admin, p.EventsList(types=["console.action"], limit=100))
        got = [msgspec.msgpack.decode(bytes(r), type=p.EventView) for r in evs.events]
        assert [(e.data["action"], e.id, e.data["key"]) for e in got] == [
            ("cancel-run", ids["run"], key_id), ("retry-task", t0, key_id), ("fail-task", t1, key_id),
            ("release-lease", t2, key_id), ("close-joinset", ids["joinset"], key_id),
            ("pause-schedule", ids["schedule"], key_id), ("unpause-schedule", ids["schedule"], key_id)]
        # a forged POST (the session's cookie, no token) is refused and changes nothing
        fresh = trio.run(_sdk, d.url, admin, p.ScopeCreate(name="target"))[0]
        r = page.request.post(d.console + "/actions/cancel-run", form={"target": fresh.id, "confirm": "yes"})
        assert r.status == 403
        r = page.request.post(d.console + "/actions/cancel-run",
                              form={"target": fresh.id, "confirm": "yes", "csrf": "A" * 43})
        assert r.status == 403
        assert trio.run(_sdk, d.url, admin, p.ScopeStatus(scope_id=fresh.id))[0].stored_state == "ACTIVE"
        assert not errors, errors
    finally:
        ctx.close()


def test_a_read_only_key_sees_no_action_button_and_its_post_is_refused(chromium, keyed):
    d, writer, reader, admin = keyed
    ids = trio.run(_setup, d.url, admin)
    ctx, page, errors = _page(chromium)
    try:
        _sign_in(page, d.console, reader)
        for path in (f"/runs/{ids['run']}", f"/tasks/{ids['tasks'][0]}", f"/joinsets/{ids['joinset']}", "/resources"):
            page.goto(d.console + path)
            assert page.locator("button.act, form.action").count() == 0, path
        r = page.request.get(d.console + f"/actions/cancel-run?target={ids['run']}")
        assert r.status == 403  # no confirmation page either
        r = page.request.post(d.console + "/actions/cancel-run", form={"target": ids["run"], "confirm": "yes"})
        assert r.status == 403
        assert trio.run(_sdk, d.url, admin, p.ScopeStatus(scope_id=ids["run"]))[0].stored_state == "ACTIVE"
        errors.clear()  # (the browser logs the 403s)
    finally:
        ctx.close()


async def _trend_load(url: str, key: str, seconds: float) -> str:
    """Tasks submitted and completed for ``seconds`` (a backlog left behind); a run's id."""
    async with rallypoint.connect(url, api_key=key) as rs:
        async def c(op):
            return await rs._call(op, REPLY_TYPES[type(op)])

        await c(p.MailboxEnsure(name="ingest"))
        run = await c(p.ScopeCreate(name="ingest batch"))
        with trio.move_on_after(seconds):
            while True:
                for i in range(20):
                    await c(p.TaskSubmit(mailbox="ingest", scope_id=run.id, input=enc(i)))
                await trio.sleep(0.05)
                got = (await c(p.Receive(mailbox="ingest", scope_id=run.id, max_messages=15))).deliveries
                for dl in got:
                    await c(p.DeliveryComplete(task_id=dl.task_id, token=dl.token))
        return run.id


def test_the_queue_trend_chart_and_a_run_timeline_render(chromium, tmp_path, shots, monkeypatch):
    from _browser import require_browser

    require_browser()
    monkeypatch.setenv("RALLYPOINT_CONSOLE_TREND_S", "0.5")
    secret = _create_key(str(tmp_path), "default", "admin", name="ops")
    d = ConsoleDaemon(["--durability", "interval", "--data-dir", str(tmp_path)])
    ctx, page, errors = _page(chromium)
    try:
        run_id = trio.run(_trend_load, d.url, secret, 4.0)
        _sign_in(page, d.console, secret)
        page.goto(d.console + "/queues/ingest")
        page.wait_for_selector("body[data-trend=drawn]", timeout=15_000)
        assert page.locator("figure.trend .trend-charts canvas").count() >= 3  # three uPlot charts
        assert page.locator("figure.trend details").get_attribute("open") is None  # the table folded away
        rows = page.locator("table.trend-table tbody tr").count()
        assert rows >= 4
        shots(page, "queue-trend")
        page.goto(d.console + f"/runs/{run_id}")
        page.wait_for_selector("svg.timeline")
        assert page.locator("svg.timeline g.lane-task").count() >= 20
        assert page.locator('svg.timeline g.lane-task[data-outcome="succeeded"]').count() >= 10
        assert not errors, errors  # (a CSP violation would be logged here)
    finally:
        ctx.close()
        d.stop()
