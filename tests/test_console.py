"""The web console (issue 32).

In-process (an embedded coordinator, the ASGI app through httpx): sign-in and its cookie,
revocation, cross-origin forms, read-only, escaping and the security headers.

In a real headless browser (Debian's Chromium driven by Playwright; ``tests/_browser.py``)
against ``rallypoint serve --console`` daemons running a workload: every page, the run
tree's lazy paging, a run cancelled from the CLI changing the open page without a reload,
the Live page's events and charts, and a key of space B seeing nothing of space A. Each
page's screenshot is written to ``$RALLYPOINT_SCREENSHOTS`` (the docs' are made with
``RALLYPOINT_SCREENSHOTS=docs/console``), else to the test's temp dir.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace
from urllib.parse import urlparse

import httpx
import msgspec
import pytest
import trio

import rallypoint
from rallypoint import protocol as p
from rallypoint.actors.api import REPLY_TYPES
from rallypoint.clock import to_iso
from rallypoint.console import ConsoleApp
from rallypoint.console.app import READ_ONLY
from rallypoint.errors import RallypointError
from rallypoint.service import Session

from _browser import CHROMIUM_ARGS, require_browser

try:
    from playwright.sync_api import expect
except ImportError:  # the browser tests skip (tests/_browser.py says why)
    expect = None


def enc(v) -> msgspec.Raw:
    return msgspec.Raw(msgspec.msgpack.encode(v))


# ============================================================================ in-process
async def _console(rs):
    app = ConsoleApp(rs.node.service)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://console.test")
    return app, client


async def test_open_mode_needs_no_sign_in_and_every_answer_is_hardened():
    async with rallypoint.open_embedded() as rs:
        app, client = await _console(rs)
        await rs.scopes.create(name="<script>alert(1)</script>")
        r = await client.get("/runs")
        assert r.status_code == 200
        assert "<script>alert(1)</script>" not in r.text and "&lt;script&gt;alert(1)&lt;/script&gt;" in r.text
        csp = r.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp and "'unsafe-inline'" not in csp
        assert r.headers["x-frame-options"] == "DENY" and r.headers["cache-control"] == "no-store"
        assert (await client.get("/login")).status_code == 303  # nothing to sign in to
        assert (await client.post("/runs")).status_code == 405  # read-only: GET only
        part = await client.get("/runs?part=list")
        assert part.status_code == 200 and "<html" not in part.text and "&lt;script&gt;" in part.text
        assert (await client.get("/runs/scp_nope")).status_code == 404
        js = await client.get("/static/console.js")
        assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
        again = await client.get("/static/console.js", headers={"if-none-match": js.headers["etag"]})
        assert again.status_code == 304 and again.content == b""
        assert (await client.get("/static/../app.py")).status_code == 404


async def test_an_empty_payload_shows_a_dash_not_nil():
    """Issue 46: a queued task's page showed ``nil`` for its result (msgpack's name for
    none); every empty field shows a muted dash."""
    async with rallypoint.open_embedded() as rs:
        app, client = await _console(rs)
        run = await rs.scopes.create(name="empty")
        jobs = await rs.mailboxes.ensure("jobs")
        task = await jobs.submit(None, scope=run)
        r = await client.get(f"/tasks/{task.id}")
        assert r.status_code == 200
        assert "nil" not in r.text and '<span class="muted">—</span>' in r.text


async def test_the_console_only_reads_even_in_open_mode():
    async with rallypoint.open_embedded() as rs:
        app = ConsoleApp(rs.node.service)
        run = await rs.scopes.create()
        with pytest.raises(RallypointError) as e:
            await app.call(Session(space="default"), p.ScopeCancel(scope_id=run.id))
        assert e.value.code == "INTERNAL"
        assert (await run.status()).stored_state == "ACTIVE"
        assert (await app.call(Session(space="default"), p.ScopeStatus(scope_id=run.id))).id == run.id


async def test_sign_in_keeps_the_key_out_of_urls_in_an_httponly_strict_cookie_until_revoked():
    async with rallypoint.open_embedded() as rs:
        coord = rs.node.coordinator
        key_a, secret_a = coord.keys.create_key("a", ["coordination_read", "coordination_write"], "alice")
        _, writer_secret = coord.keys.create_key("a", ["coordination_write"])
        await rs.node.service.call(Session(space="a"), p.ScopeCreate(name="a-run"))
        app, client = await _console(rs)
        r = await client.get("/runs")
        assert r.status_code == 303 and r.headers["location"] == "/login?next=%2Fruns"
        assert (await client.get("/runs?part=list")).status_code == 401  # a fragment: the script reloads
        form = await client.get("/login?next=/runs")
        assert 'type="password"' in form.text and 'method="post"' in form.text
        bad = await client.post("/login", data={"key": "rp_wrong", "next": "/runs"})
        assert bad.status_code == 401 and "Unknown or revoked" in bad.text and "set-cookie" not in bad.headers
        weak = await client.post("/login", data={"key": writer_secret})
        assert weak.status_code == 403 and "coordination_read" in weak.text
        foreign = await client.post("/login", data={"key": secret_a}, headers={"origin": "http://evil.test"})
        assert foreign.status_code == 403 and "set-cookie" not in foreign.headers
        ok = await client.post("/login", data={"key": secret_a, "next": "//evil.test/x"})
        assert ok.status_code == 303 and ok.headers["location"] == "/runs"  # never another site
        cookie = ok.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict") and "Path=/" in cookie
        assert secret_a not in cookie and secret_a not in ok.headers["location"]
        page = await client.get("/runs")
        assert page.status_code == 200 and "a-run" in page.text and "space <b>a</b>" in page.text
        [login] = app.logins.values()
        assert login.space == "a" and login.key_id == key_a.id and secret_a not in repr(app.logins)
        # a console session holds the read permission only
        token = cookie.split(";")[0].split("=", 1)[1]
        ctx = app._ctx(SimpleNamespace(cookies={app.cookie_name: token}, client=None, url=SimpleNamespace(query="")), {})
        assert ctx.session.permissions == READ_ONLY and ctx.session.space == "a"
        # revoking the key ends its console sessions at their next request
        await rs.node.service.call(Session(space="a", local=True), p.KeyRevoke(key_id=key_a.id))
        assert (await client.get("/runs")).status_code == 303 and not app.logins
        # signing out forgets the session
        key_b, secret_b = coord.keys.create_key("a", ["coordination_read"])
        await client.post("/login", data={"key": secret_b})
        assert (await client.get("/runs")).status_code == 200
        out = await client.post("/logout")
        assert out.status_code == 303 and not app.logins and (await client.get("/runs")).status_code == 303


# ============================================================================ daemons
class ConsoleDaemon:
    """``rallypoint serve --console`` on free loopback ports (memory durability)."""

    def __init__(self, extra: list[str] | None = None) -> None:
        args = [sys.executable, "-m", "rallypoint", "serve", "--listen", "127.0.0.1:0", "--durability", "memory",
                "--console", "127.0.0.1:0", "--retain-finished", "0", *(extra or [])]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.url = self.console = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.console is None:
            line = self.proc.stdout.readline()
            if line.startswith("READY "):
                self.url = line.split()[1]
            elif line.startswith("CONSOLE "):
                self.console = line.split()[1]
            elif not line and self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited: {self.proc.stderr.read()}")
        assert self.console is not None, "the daemon printed no CONSOLE line"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        err = self.proc.stderr.read()
        assert rc == 0 and "Traceback" not in err, err


async def _workload(url: str) -> dict:
    """Runs (a tree, a wide run, one to cancel, one with a deadline), a queue with tasks in
    every state, a group decided with a late verdict, a join set closed with closing
    consumes, a barrier, a timer, a claim, a pool grant, a quota and a budget in use."""
    out: dict = {}
    async with rallypoint.connect(url) as rs:
        async def c(op):
            return await rs._call(op, REPLY_TYPES[type(op)])

        now = rs_now = time.time() * 1000
        root = await c(p.ScopeCreate(name="research swarm", deadline=to_iso(int(rs_now + 3_600_000))))
        agents = [await c(p.ScopeCreate(parent_id=root.id, name=f"agent-{i}")) for i in range(3)]
        await c(p.ScopeCreate(parent_id=agents[0].id, name="sub-agent"))
        wide = await c(p.ScopeCreate(name="wide"))
        for i in range(55):
            await c(p.ScopeCreate(parent_id=wide.id, name=f"w-{i:02d}"))
        out["doomed"] = (await c(p.ScopeCreate(name="to be cancelled"))).id
        await c(p.MailboxEnsure(name="jobs", max_attempts=3))
        await c(p.MailboxEnsure(name="reviews"))
        tasks = [await c(p.TaskSubmit(mailbox="jobs", scope_id=agents[1].id, input=enc({"n": i}))) for i in range(6)]
        got = (await c(p.Receive(mailbox="jobs", scope_id=agents[1].id, max_messages=3, lease_ms=600_000,
                                 holder="researcher-1"))).deliveries
        await c(p.DeliveryComplete(task_id=got[0].task_id, token=got[0].token, outcome=enc({"answer": 42})))
        await c(p.DeliveryReject(task_id=got[1].task_id, token=got[1].token, error=enc("bad input")))
        out.update(root=root.id, wide=wide.id, agents=[a.id for a in agents], running=got[2].task_id,
                   failed=got[1].task_id, tasks=[t.id for t in tasks])
        g = await c(p.GroupCreate(scope_id=root.id, mailbox="reviews", condition="FIRST_ACCEPTED"))
        members = [(await c(p.GroupSubmit(group_id=g.id, input=enc(i)))).task for i in range(2)]
        for d in (await c(p.Receive(mailbox="reviews", scope_id=g.scope_id, max_messages=2))).deliveries:
            await c(p.DeliveryComplete(task_id=d.task_id, token=d.token))
        await c(p.GroupVerdictOp(group_id=g.id, task_id=members[0].id, verdict="ACCEPTED"))
        await c(p.GroupVerdictOp(group_id=g.id, task_id=members[1].id, verdict="REJECTED"))  # late
        out["group"] = g.id
        js = await c(p.JoinSetCreate(scope_id=agents[2].id, name="fan-out"))
        kids = [(await c(p.JoinSetSubmit(joinset_id=js.id, mailbox="jobs"))).child_id for _ in range(3)]
        ds = {d.task_id: d for d in (await c(p.Receive(mailbox="jobs", scope_id=agents[2].id, max_messages=3))).deliveries}
        await c(p.DeliveryComplete(task_id=kids[1], token=ds[kids[1]].token))
        await c(p.JoinNext(joinset_id=js.id))
        await c(p.DeliveryComplete(task_id=kids[2], token=ds[kids[2]].token))
        await c(p.JoinSetClose(joinset_id=js.id))
        out["joinset"] = js.id
        bar = await c(p.BarrierCreate(scope_id=root.id, target=3, name="sync"))
        await c(p.BarrierArrive(barrier_id=bar.id, key="agent-0"))
        await c(p.TimerCreate(scope_id=root.id, after_ms=3_600_000, name="checkpoint"))
        await c(p.ClaimAcquire(scope_id=agents[0].id, key="leader", holder="agent-0", lease_ms=600_000))
        await c(p.PoolEnsure(name="gpu", units_total=4))
        await c(p.PoolAcquire(pool="gpu", scope_id=agents[0].id, units=3, holder="agent-0", lease_ms=300_000))
        await c(p.QuotaEnsure(name="llm-calls", units_limit=100, window_ms=86_400_000))
        await c(p.QuotaTake(quota="llm-calls", scope_id=root.id, units=37))
        await c(p.BudgetEnsure(name="tokens", limit_minor=10_000))
        res = await c(p.BudgetReserve(budget="tokens", scope_id=root.id, amount_minor=2_500))
        await c(p.BudgetSettle(reservation_id=res.id, amount_minor=800, usage_key="u1", final=False))
        del now
    return out


@pytest.fixture(scope="module")
def chromium():
    path = require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def swarm():
    require_browser()
    d = ConsoleDaemon()
    try:
        ids = trio.run(_workload, d.url)
        yield d, ids
    finally:
        d.stop()


@pytest.fixture
def shots(tmp_path):
    """Where screenshots go: $RALLYPOINT_SCREENSHOTS (docs/console for the docs), else
    the test's temp dir."""
    where = os.environ.get("RALLYPOINT_SCREENSHOTS") or str(tmp_path)
    os.makedirs(where, exist_ok=True)

    def shot(page, name: str) -> None:
        page.screenshot(path=os.path.join(where, name + ".png"), full_page=True)
        assert os.path.getsize(os.path.join(where, name + ".png")) > 10_000

    return shot


def _page(browser):
    ctx = browser.new_context(viewport={"width": 1280, "height": 860})
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    return ctx, page, errors


def _live(page) -> None:
    page.wait_for_selector("body[data-live=on]", timeout=10_000)


# ============================================================================ in a browser
def test_every_page_against_a_daemon_running_a_workload(chromium, swarm, shots):
    d, ids = swarm
    ctx, page, errors = _page(chromium)
    base = d.console
    try:
        page.goto(base + "/")
        assert urlparse(page.url).path == "/runs"
        _live(page)
        rows = page.locator("table.runs tbody tr")
        names = rows.all_inner_texts()
        assert any("research swarm" in r for r in names) and any("wide" in r for r in names)
        assert "in 59m" in page.inner_text(f'tr[data-run="{ids["root"]}"]')  # the deadline's time left
        shots(page, "runs")
        page.goto(base + "/runs?name=SWARM")
        assert [r for r in page.locator("table.runs tbody tr").all_inner_texts()] and \
            all("swarm" in r for r in page.locator("table.runs tbody tr").all_inner_texts())

        # a run: summary, holds, the tree expanded lazily, what it owns
        page.goto(base + f"/runs/{ids['root']}")
        _live(page)
        summary = page.inner_text(".part-summary")
        assert "6 runs in its subtree" in summary  # itself, 3 agents, a sub-agent, the group's gate run
        assert "leader" in summary and "agent-0" in summary  # the claim, held below
        # the running task's delivery, by its holder, linked (issue 32 item 2)
        leased = page.locator('.part-summary tr[data-holder="researcher-1"] td').nth(2)
        assert leased.inner_text() == ids["running"]
        assert leased.locator("a").get_attribute("href").endswith("/tasks/" + ids["running"])
        agent0 = page.locator(f'li[data-run="{ids["agents"][0]}"]')
        assert agent0.locator("ul.tree li").count() == 0  # not loaded before it is expanded
        agent0.locator("button.toggle").click()
        page.wait_for_selector(f'li[data-run="{ids["agents"][0]}"] ul.tree li')
        assert "sub-agent" in agent0.inner_text()
        items = page.inner_text(".part-items")
        assert "sync" in items and "checkpoint" in items and "FIRST_ACCEPTED" in items
        shots(page, "run")

        # a wide run: the first page of children, then the next one on demand
        page.goto(base + f"/runs/{ids['wide']}")
        tree = page.locator(".part-tree ul.tree.root > li > ul.tree > li[data-run]")
        assert tree.count() == 50
        page.click("button.more")
        expect(page.locator(".part-tree li[data-run] li[data-run]")).to_have_count(55)
        assert page.locator("button.more").count() == 0

        # tasks: the running one with its delivery, the failed one with its error
        page.goto(base + f"/tasks/{ids['running']}")
        text = page.inner_text("main")
        assert "RUNNING" in text and "fencing token" in text and "task.delivered" in text
        # the delivery's holder (issue 32 item 2): on the current delivery and its event's row
        assert page.inner_text(".part-detail .holder") == "researcher-1"
        delivered = page.locator('.part-history tr[data-event="task.delivered"] td')
        assert delivered.nth(3).inner_text() == "1" and delivered.nth(4).inner_text() == "researcher-1"
        shots(page, "task")
        page.goto(base + f"/tasks/{ids['failed']}")
        assert "bad input" in page.inner_text(".part-detail") and "FAILED" in page.inner_text(".part-detail")
        assert "last holder" in page.inner_text(".part-detail")
        assert page.inner_text(".part-detail .holder") == "researcher-1"  # no lease now: the last one's holder

        # queues: depth, in flight, and done per second once two samples were read
        page.goto(base + "/queues")
        _live(page)
        row = page.locator('tr[data-queue="jobs"]')
        assert row.locator("td").nth(2).inner_text() == "3" and row.locator("td").nth(3).inner_text() == "1"
        page.wait_for_selector('tr[data-queue="jobs"] .rate')  # a second sample came (the part refreshed)
        shots(page, "queues")
        page.goto(base + "/queues/jobs?state=FAILED")
        assert page.locator("tr[data-task]").count() == 1
        assert page.locator("tr[data-task] td").nth(4).inner_text() == "researcher-1"  # its holder

        # groups: decided, with the late verdict marked
        page.goto(base + "/groups")
        assert "SUCCESS" in page.inner_text(".part-list")
        # an instant is one line, not wrapped onto three (issue 46), in a narrow window too
        page.set_viewport_size({"width": 700, "height": 900})
        lines = page.locator(".part-list time").first.evaluate("e => e.getClientRects().length")
        assert lines == 1, lines
        page.set_viewport_size({"width": 1280, "height": 900})
        page.goto(base + f"/groups/{ids['group']}")
        assert page.locator("tr.late").count() == 1 and "SUCCESS" in page.inner_text(".part-group")
        shots(page, "group")

        # join sets: completion order, closing consumes, the steps
        page.goto(base + "/joinsets")
        assert "fan-out" in page.inner_text(".part-list")
        page.goto(base + f"/joinsets/{ids['joinset']}")
        text = page.inner_text(".part-joinset")
        assert text.count("closing consume") == 2 and "join_next" in text and "CLOSED" in text
        shots(page, "joinset")

        # resources
        page.goto(base + "/resources")
        text = page.inner_text("main")
        assert "37 / 100" in text and "3 / 4" in text and "8.00 USD" in text and "17.00 USD" in text
        shots(page, "resources")
        assert not errors, errors
    finally:
        ctx.close()


def test_live_page_streams_events_and_draws_the_charts(chromium, swarm, shots):
    d, ids = swarm
    ctx, page, errors = _page(chromium)
    try:
        page.goto(d.console + "/live?types=task.*")
        _live(page)
        page.wait_for_selector("body[data-charted=yes]")  # three samples drawn

        async def submit():
            async with rallypoint.connect(d.url) as rs:
                op = p.TaskSubmit(mailbox="jobs", scope_id=ids["agents"][1], key="live-1")
                return (await rs._call(op, p.TaskView)).id

        tid = trio.run(submit)
        page.wait_for_selector(f'#events tr[data-type="task.submitted"] >> text={tid}')
        page.set_viewport_size({"width": 700, "height": 900})  # (issue 46: dates wrapped onto three lines)
        assert page.locator("#events .when").first.evaluate("e => e.getClientRects().length") == 1
        page.set_viewport_size({"width": 1280, "height": 900})
        assert page.locator('#events tr[data-type^="scope."]').count() == 0  # filtered by type
        assert page.locator("#chart-rate polyline").count() == 3
        assert page.locator("#chart-latency polyline").count() == 2
        assert "requests/s" in page.inner_text("#rate-now")
        shots(page, "live")
        assert not errors, errors
    finally:
        ctx.close()


def test_a_run_cancelled_from_the_cli_changes_the_open_page_without_a_reload(chromium, swarm):
    d, ids = swarm
    ctx, page, errors = _page(chromium)
    try:
        page.goto(d.console + f"/runs/{ids['doomed']}")
        _live(page)  # subscribed: the cancel's event will reach this page
        assert page.get_attribute(".part-summary .state-line", "data-state") == "ACTIVE"
        page.evaluate("window.__loaded_once = true")
        cli = subprocess.run([sys.executable, "-m", "rallypoint", "runs", "cancel", ids["doomed"], "--connect", d.url],
                             capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        page.wait_for_selector('.part-summary .state-line[data-state="CANCELLED"]', timeout=15_000)
        assert page.evaluate("window.__loaded_once") is True  # the same document: no reload
        assert not errors, errors
    finally:
        ctx.close()


def _create_key(data_dir: str, space: str, *perms: str, name: str | None = None) -> str:
    """A key made offline on ``data_dir`` before the daemon starts (``rallypoint keys
    create --data-dir``): keys of several spaces need the operator's path -- an open-mode
    connection loses its rights with the first key it makes (issue 41 item 1)."""
    args = [sys.executable, "-m", "rallypoint", "keys", "create", "--data-dir", data_dir, "--space", space,
            "--secret-only"]
    for perm in perms:
        args += ["--permission", perm]
    if name:
        args += ["--name", name]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _keyed_daemon(data_dir: str) -> "ConsoleDaemon":
    return ConsoleDaemon(["--durability", "interval", "--data-dir", data_dir])


async def _act(url: str, key: str, name: str) -> dict:
    async with rallypoint.connect(url, api_key=key) as rs:
        async def c(op):
            return await rs._call(op, REPLY_TYPES[type(op)])

        run = await c(p.ScopeCreate(name=name))
        await c(p.MailboxEnsure(name=name + "-jobs"))
        task = await c(p.TaskSubmit(mailbox=name + "-jobs", scope_id=run.id))
        return {"run": run.id, "task": task.id}


def test_a_key_of_space_b_sees_nothing_of_space_a(chromium, shots, tmp_path):
    require_browser()
    secret_a = _create_key(str(tmp_path), "a", "admin", name="alice")
    secret_b = _create_key(str(tmp_path), "b", "admin", name="bob")
    d = _keyed_daemon(str(tmp_path))
    try:
        a = trio.run(_act, d.url, secret_a, "alpha-secret")
        ctx, page, errors = _page(chromium)
        try:
            page.goto(d.console + "/runs")
            assert urlparse(page.url).path == "/login"
            shots(page, "login")
            page.fill("input[name=key]", secret_b)
            page.click("main button")
            page.wait_for_url(re.compile(r"/runs$"))
            assert secret_b not in page.url
            cookies = ctx.cookies()
            assert [(c["httpOnly"], c["sameSite"]) for c in cookies] == [(True, "Strict")]
            assert secret_b not in cookies[0]["value"]
            assert "alpha" not in page.inner_text("main") and "space b" in page.inner_text("header")
            for path in (f"/runs/{a['run']}", f"/tasks/{a['task']}", "/queues/alpha-secret-jobs"):
                page.goto(d.console + path)
                assert "NOT_FOUND" in page.inner_text("h1"), path
            errors.clear()  # (the browser logs each 404 page as an error)
            page.goto(d.console + "/queues")
            assert "alpha" not in page.inner_text("main")
            # live: space A's events never reach B's stream; B's own do
            page.goto(d.console + "/live")
            _live(page)
            trio.run(_act, d.url, secret_a, "alpha-later")
            b = trio.run(_act, d.url, secret_b, "bravo")
            page.wait_for_selector(f'#events tr >> text={b["task"]}')
            assert "alpha" not in page.inner_text("#events") and a["run"] not in page.inner_text("main")
            # space A's key sees its own
            page.click("header form.logout button")
            page.wait_for_url(re.compile(r"/login$"))
            page.fill("input[name=key]", secret_a)
            page.click("main button")
            page.wait_for_url(re.compile(r"/runs$"))
            assert "alpha-secret" in page.inner_text("main") and "bravo" not in page.inner_text("main")
            assert not errors, errors
        finally:
            ctx.close()
    finally:
        d.stop()


def test_a_revoked_keys_open_live_page_stops_streaming_and_signs_out(chromium, tmp_path):
    """issue 41 item 3: the console's ``/stream`` of a login whose key is revoked (``keys
    revoke --connect``) while its Live page is open. In the browser: the stream ends
    with ``gone`` and ``signedOut``, the page leaves for the sign-in form, and no event
    committed after the revocation reaches it (before: it kept streaming)."""
    require_browser()
    viewer = _create_key(str(tmp_path), "default", "coordination_read", name="viewer")
    admin = _create_key(str(tmp_path), "default", "admin", name="ops")
    d = _keyed_daemon(str(tmp_path))
    ctx, page, errors = _page(chromium)
    try:
        page.goto(d.console + "/live")
        page.fill("input[name=key]", viewer)
        page.click("main button")
        page.wait_for_url(re.compile(r"/live$"))
        _live(page)
        before = trio.run(_act, d.url, admin, "before")
        page.wait_for_selector(f'#events tr >> text={before["task"]}')
        listed = subprocess.run([sys.executable, "-m", "rallypoint", "keys", "list", "--connect", d.url, "--api-key",
                                 admin, "--json"], capture_output=True, text=True, timeout=60)
        (vid,) = [k["id"] for k in msgspec.json.decode(listed.stdout) if k["name"] == "viewer"]
        shown: list[str] = []  # every event cell the page shows from here on (across the reload)
        page.expose_function("rpShown", lambda text: shown.append(text))
        page.evaluate("""() => new MutationObserver(() => {
            for (const td of document.querySelectorAll('#events td')) window.rpShown(td.textContent); })
          .observe(document.body, {subtree: true, childList: true})""")
        cli = subprocess.run([sys.executable, "-m", "rallypoint", "keys", "revoke", vid, "--connect", d.url,
                              "--api-key", admin], capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        after = trio.run(_act, d.url, admin, "after")
        page.wait_for_url(re.compile(r"/login"), timeout=15_000)  # the stream said signedOut: reloaded, signed out
        assert page.locator("input[name=key]").count() == 1
        # nothing after the revocation was shown before the page left
        assert not [t for t in shown if after["task"] in t or after["run"] in t], shown
        assert not errors, errors
    finally:
        ctx.close()
        d.stop()


def test_serve_console_flag_is_checked_before_start(tmp_path):
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        r = subprocess.run([sys.executable, "-m", "rallypoint", "serve", "--durability", "memory", "--listen",
                            "127.0.0.1:0", "--console", f"127.0.0.1:{port}"], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and "--console" in r.stderr, r.stderr
        # a node of a cluster serves the console too (tests/test_console_cluster.py): its
        # address is checked before the node starts all the same
        r = subprocess.run([sys.executable, "-m", "rallypoint", "serve", "--cluster", "etcd://127.0.0.1:1", "--node",
                            "n1", "--data-dir", str(tmp_path), "--console", f"127.0.0.1:{port}"], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2 and "--console" in r.stderr and "already in use" in r.stderr, r.stderr
    finally:
        busy.close()


async def test_a_queues_page_shows_its_ready_backlog_per_priority_and_per_key():
    """Issue 44: the queue's page has a table of its ready tasks per priority, then per
    fairness key (largest first, ties by name: no key first) with the key's weight on
    the queue; keys are escaped."""
    async with rallypoint.open_embedded() as rs:
        app, client = await _console(rs)
        run = await rs.scopes.create(name="fair")
        jobs = await rs.mailboxes.ensure("fair-jobs", weights={"tenant-a": 3})
        await jobs.submit_many([1, 2, 3], scope=run, fair_key="tenant-a", priority=2)
        await jobs.submit("b", scope=run, fair_key="<b>")
        await jobs.submit("plain", scope=run, priority=1)
        r = await client.get("/queues/fair-jobs?part=backlog")
        assert r.status_code == 200
        rows = re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td></tr>", r.text)
        assert rows == [("priority 1", "1", ""), ("priority 2", "3", ""), ("priority 3", "1", ""),
                        ("key tenant-a", "3", "3"), ("no key", "1", ""), ("key &lt;b&gt;", "1", "")], r.text
        got = await jobs.receive(run, wait=0, max_messages=5)
        assert len(got) == 5
        r = await client.get("/queues/fair-jobs?part=backlog")
        assert "no task ready" in r.text, r.text
