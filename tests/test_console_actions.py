"""The console's actions (issue 46), in process (an embedded coordinator, the ASGI app
through httpx): each action's confirmation page and CSRF-checked POST, its effect seen
through the SDK, its audit event naming the key; the permission the wire's operation
needs (a read-only key sees no button, and its POST is refused); forged POSTs (no
token, a wrong one, another session's, another origin) refused with 403 and nothing done.
The same actions clicked in a browser: ``tests/test_console.py``."""

from __future__ import annotations

import re

import httpx
import msgspec
import pytest

import rallypoint
from rallypoint import protocol as p
from rallypoint.actors.api import OPS, REPLY_TYPES
from rallypoint.console import ConsoleApp
from rallypoint.console.actions import ACTIONS, allowed, check_csrf, csrf_token
from rallypoint.errors import ForbiddenError
from rallypoint.service import Session


async def call(rs, op, session):
    raw = await rs.node.service.call(session, op)
    return msgspec.msgpack.decode(raw, type=REPLY_TYPES[type(op)])


def client_of(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://console.test")


async def sign_in(app, secret: str) -> httpx.AsyncClient:
    c = client_of(app)
    r = await c.post("/login", data={"key": secret, "next": "/runs"})
    assert r.status_code == 303, r.text
    return c


def token_of(html: str) -> str:
    m = re.search(r'name="csrf" value="([^"]+)"', html)
    assert m, "no CSRF token on the confirmation page"
    return m.group(1)


def hidden(html: str) -> dict:
    return dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', html))


async def confirm_and_post(client, name: str, target: str, **extra) -> httpx.Response:
    """What a browser does: the button's GET (the confirmation page), then its form's POST."""
    page = await client.get(f"/actions/{name}", params={"target": target})
    assert page.status_code == 200, page.text
    assert 'method="post"' in page.text and f'action="/actions/{name}"' in page.text
    return await client.post(f"/actions/{name}", data={**hidden(page.text), **extra})


async def console_events(rs, session) -> list:
    page = await call(rs, p.EventsList(types=["console.action"], limit=1000), session)
    return [msgspec.msgpack.decode(bytes(r), type=p.EventView) for r in page.events]


@pytest.fixture
async def keyed():
    """An embedded node with a writer key, a read-only key (space s1) and a console."""
    async with rallypoint.open_embedded() as rs:
        coord = rs.node.coordinator
        writer, writer_secret = coord.keys.create_key("s1", ["coordination_read", "coordination_write"], "ops")
        reader, reader_secret = coord.keys.create_key("s1", ["coordination_read"], "viewer")
        app = ConsoleApp(rs.node.service)
        yield rs, app, Session(space="s1"), (writer, writer_secret), (reader, reader_secret)


# ---------------------------------------------------------------------------- rights and tokens
def test_allowed_follows_the_service_rule():
    assert allowed(None, "coordination_write")  # open mode
    assert allowed(frozenset({"coordination_write"}), "coordination_write")
    assert allowed(frozenset({"admin"}), "coordination_write") and allowed(frozenset({"operator"}), "resource_config")
    assert not allowed(frozenset({"coordination_read"}), "coordination_write")
    assert not allowed(frozenset({"resource_config", "coordination_read"}), "coordination_write")
    # every action needs exactly what its operation needs over the wire
    assert {OPS[a.op].permission for a in ACTIONS.values()} == {"coordination_write"}


async def test_a_csrf_token_is_per_session_and_checked_in_full(keyed):
    rs, app, s1, (writer, secret), _ = keyed
    c1, c2 = await sign_in(app, secret), await sign_in(app, secret)
    run = await call(rs, p.ScopeCreate(name="r"), s1)
    t1 = token_of((await c1.get("/actions/cancel-run", params={"target": run.id})).text)
    t2 = token_of((await c2.get("/actions/cancel-run", params={"target": run.id})).text)
    assert t1 != t2 and len(t1) == 43  # two sessions of one key: two tokens
    assert t1 == token_of((await c1.get("/actions/cancel-run", params={"target": run.id})).text)  # stable

    class Req:  # (check_csrf reads the request's cookies only)
        def __init__(self, client):
            self.cookies = {app.cookie_name: client.cookies[app.cookie_name]}

    check_csrf(app, Req(c1), {"csrf": t1})
    assert csrf_token(app, Req(c1)) == t1
    for bad in ({"csrf": t2}, {}, {"csrf": ""}, {"csrf": t1[:-1]}, {"csrf": t1 + "A"}):
        with pytest.raises(ForbiddenError):
            check_csrf(app, Req(c1), bad)
    # another process (another secret): the old tokens are void
    other = ConsoleApp(rs.node.service)
    assert csrf_token(other, Req(c1)) != t1


async def test_a_forged_post_is_refused_with_403_and_nothing_is_done(keyed):
    rs, app, s1, (writer, secret), _ = keyed
    run = await call(rs, p.ScopeCreate(name="target"), s1)
    c = await sign_in(app, secret)
    other = await sign_in(app, secret)
    other_token = token_of((await other.get("/actions/cancel-run", params={"target": run.id})).text)
    good = token_of((await c.get("/actions/cancel-run", params={"target": run.id})).text)
    forged = [
        ({"target": run.id, "confirm": "yes"}, {}),  # no token
        ({"target": run.id, "confirm": "yes", "csrf": "x" * 43}, {}),  # a wrong one
        ({"target": run.id, "confirm": "yes", "csrf": other_token}, {}),  # another session's
        ({"target": run.id, "confirm": "yes", "csrf": good}, {"origin": "http://evil.test"}),  # another origin
        ({"target": run.id, "confirm": "yes", "csrf": good}, {"sec-fetch-site": "cross-site"}),
    ]
    for data, headers in forged:
        r = await c.post("/actions/cancel-run", data=data, headers=headers)
        assert r.status_code == 403, (data, headers, r.status_code)
        assert "FORBIDDEN" in r.text
    unconfirmed = await c.post("/actions/cancel-run", data={"target": run.id, "csrf": good})
    assert unconfirmed.status_code == 400
    signed_out = await client_of(app).post("/actions/cancel-run", data={"target": run.id, "confirm": "yes",
                                                                       "csrf": good})
    assert signed_out.status_code == 303 and signed_out.headers["location"].startswith("/login")
    assert (await call(rs, p.ScopeStatus(scope_id=run.id), s1)).stored_state == "ACTIVE"
    assert await console_events(rs, s1) == []
    assert (await c.post("/actions/no-such", data={})).status_code == 404


async def test_a_read_only_key_sees_no_button_and_its_post_is_refused(keyed):
    rs, app, s1, _, (reader, reader_secret) = keyed
    run = await call(rs, p.ScopeCreate(name="watched"), s1)
    js = await call(rs, p.JoinSetCreate(scope_id=run.id, name="fan"), s1)
    c = await sign_in(app, reader_secret)
    for path in (f"/runs/{run.id}", f"/joinsets/{js.id}"):
        page = await c.get(path)
        assert page.status_code == 200 and "/actions/" not in page.text and 'class="act' not in page.text, path
    assert (await c.get("/actions/cancel-run", params={"target": run.id})).status_code == 403
    # even with its own valid token, the operation is refused where the wire refuses it
    from types import SimpleNamespace

    token = csrf_token(app, SimpleNamespace(cookies={app.cookie_name: c.cookies[app.cookie_name]}))
    r = await c.post("/actions/cancel-run", data={"target": run.id, "confirm": "yes", "csrf": token})
    assert r.status_code == 403 and "coordination_write" in r.text
    assert (await call(rs, p.ScopeStatus(scope_id=run.id), s1)).stored_state == "ACTIVE"
    assert await console_events(rs, s1) == []


async def test_cancel_a_run_with_its_subtree_recorded_with_the_key(keyed):
    rs, app, s1, (writer, secret), _ = keyed
    run = await call(rs, p.ScopeCreate(name="stuck"), s1)
    child = await call(rs, p.ScopeCreate(parent_id=run.id, name="child"), s1)
    await call(rs, p.MailboxEnsure(name="jobs"), s1)
    task = await call(rs, p.TaskSubmit(mailbox="jobs", scope_id=child.id), s1)
    c = await sign_in(app, secret)
    page = await c.get(f"/runs/{run.id}")
    assert 'data-action="cancel-run"' in page.text
    confirm = await c.get("/actions/cancel-run", params={"target": run.id})
    assert "2 runs" in confirm.text and "cannot be undone" in confirm.text
    done = await c.post("/actions/cancel-run", data={**hidden(confirm.text), "note": "runaway agent"})
    assert done.status_code == 200 and f"Run {run.id} cancelled" in done.text and writer.id in done.text
    assert (await call(rs, p.ScopeStatus(scope_id=run.id), s1)).stored_state == "CANCELLED"
    assert (await call(rs, p.ScopeStatus(scope_id=child.id), s1)).effective != "ACTIVE"
    assert (await call(rs, p.TaskStatus(task_id=task.id), s1)).state == "CANCELLED"
    [ev] = await console_events(rs, s1)
    assert (ev.kind, ev.id, ev.run) == ("console", run.id, run.id)
    assert ev.data == {"action": "cancel-run", "key": writer.id, "note": "runaway agent"}
    cancelled = await call(rs, p.EventsList(types=["scope.cancelled"], aggregate=f"scope:{run.id}"), s1)
    assert msgspec.msgpack.decode(bytes(cancelled.events[0]), type=p.EventView).data == {"reason": "runaway agent"}
    # the page no longer offers it; a second try is refused (it is CANCELLED)
    assert 'data-action="cancel-run"' not in (await c.get(f"/runs/{run.id}")).text
    assert (await c.get("/actions/cancel-run", params={"target": run.id})).status_code == 409


async def test_retry_fail_and_release_a_task_fenced_by_the_delivery_seen(keyed):
    rs, app, s1, (writer, secret), _ = keyed
    run = await call(rs, p.ScopeCreate(name="work"), s1)
    await call(rs, p.MailboxEnsure(name="jobs", max_attempts=5), s1)
    ids = [(await call(rs, p.TaskSubmit(mailbox="jobs", scope_id=run.id), s1)).id for _ in range(3)]
    got = (await call(rs, p.Receive(mailbox="jobs", scope_id=run.id, max_messages=3, lease_ms=600_000,
                                    holder="poison-worker"), s1)).deliveries
    tokens = {d.task_id: d.token for d in got}
    c = await sign_in(app, secret)
    page = await c.get(f"/tasks/{ids[0]}")
    assert all(f'data-action="{n}"' in page.text for n in ("retry-task", "fail-task", "release-lease"))

    r = await confirm_and_post(c, "retry-task", ids[0])
    assert r.status_code == 200, r.text
    t = await call(rs, p.TaskStatus(task_id=ids[0]), s1)
    assert (t.state, t.attempt) == ("QUEUED", 2)
    r = await confirm_and_post(c, "release-lease", ids[1])
    assert r.status_code == 200
    t = await call(rs, p.TaskStatus(task_id=ids[1]), s1)
    assert (t.state, t.attempt) == ("QUEUED", 1)  # the attempt not counted
    r = await confirm_and_post(c, "fail-task", ids[2], note="poison")
    assert r.status_code == 200
    t = await call(rs, p.TaskStatus(task_id=ids[2]), s1)
    assert t.state == "FAILED" and t.outcome_reason == "rejected"
    # the worker's own settle is now refused: its lease is gone
    with pytest.raises(rallypoint.errors.RallypointError) as e:
        await call(rs, p.DeliveryComplete(task_id=ids[0], token=tokens[ids[0]]), s1)
    assert e.value.code == "STALE_CLAIM"
    evs = await console_events(rs, s1)
    assert [(e.data["action"], e.id, e.run, e.data["key"]) for e in evs] == [
        ("retry-task", ids[0], run.id, writer.id), ("release-lease", ids[1], run.id, writer.id),
        ("fail-task", ids[2], run.id, writer.id)]
    # a task without a lease offers no action; a confirmation seen before a takeover is refused
    assert 'data-action="retry-task"' not in (await c.get(f"/tasks/{ids[2]}")).text
    confirm = await c.get("/actions/retry-task", params={"target": ids[0]})
    assert confirm.status_code == 409  # QUEUED: no lease to act on
    [again] = (await call(rs, p.Receive(mailbox="jobs", scope_id=run.id, lease_ms=600_000), s1)).deliveries
    confirm = await c.get("/actions/fail-task", params={"target": again.task_id})
    form = hidden(confirm.text)
    await call(rs, p.DeliveryRelease(task_id=again.task_id, token=again.token), s1)
    await call(rs, p.Receive(mailbox="jobs", scope_id=run.id, lease_ms=600_000), s1)  # another worker takes it
    stale = await c.post("/actions/fail-task", data=form)
    assert stale.status_code == 409 and "STALE_CLAIM" in stale.text
    assert (await call(rs, p.TaskStatus(task_id=again.task_id), s1)).state == "RUNNING"
    assert len(await console_events(rs, s1)) == 3  # nothing recorded for a refused action


async def test_close_a_join_set_and_pause_then_unpause_a_schedule(keyed):
    rs, app, s1, (writer, secret), _ = keyed
    run = await call(rs, p.ScopeCreate(name="fan"), s1)
    await call(rs, p.MailboxEnsure(name="jobs"), s1)
    js = await call(rs, p.JoinSetCreate(scope_id=run.id, name="fan-out"), s1)
    await call(rs, p.JoinSetSubmit(joinset_id=js.id, mailbox="jobs"), s1)
    sched = await call(rs, p.ScheduleCreate(name="nightly", cron=["0 3 * * *"]), s1)
    c = await sign_in(app, secret)
    assert 'data-action="close-joinset"' in (await c.get(f"/joinsets/{js.id}")).text
    assert (await confirm_and_post(c, "close-joinset", js.id)).status_code == 200
    assert (await call(rs, p.OpsJoinSet(joinset_id=js.id), s1)).joinset.state != "OPEN"

    resources = await c.get("/resources")
    assert 'data-action="pause-schedule"' in resources.text and 'data-action="unpause-schedule"' not in resources.text
    assert (await confirm_and_post(c, "pause-schedule", sched.id, note="maintenance")).status_code == 200
    d = await call(rs, p.ScheduleGet(schedule=sched.id), s1)
    assert d.paused and d.note == "maintenance"
    assert 'data-action="unpause-schedule"' in (await c.get("/resources")).text
    assert (await c.get("/actions/pause-schedule", params={"target": sched.id})).status_code == 409
    assert (await confirm_and_post(c, "unpause-schedule", sched.id)).status_code == 200
    assert not (await call(rs, p.ScheduleGet(schedule=sched.id), s1)).paused
    evs = await console_events(rs, s1)
    assert [(e.data["action"], e.id, e.run) for e in evs] == [
        ("close-joinset", js.id, run.id), ("pause-schedule", sched.id, None), ("unpause-schedule", sched.id, None)]


async def test_open_mode_acts_with_every_permission_and_records_no_key():
    async with rallypoint.open_embedded() as rs:
        app = ConsoleApp(rs.node.service)
        c = client_of(app)
        run = await rs.scopes.create(name="open")
        assert 'data-action="cancel-run"' in (await c.get(f"/runs/{run.id}")).text
        assert (await c.post("/actions/cancel-run", data={"target": run.id, "confirm": "yes"})).status_code == 403
        assert (await confirm_and_post(c, "cancel-run", run.id)).status_code == 200
        assert (await run.status()).stored_state == "CANCELLED"
        [ev] = await console_events(rs, Session(space="default"))
        assert ev.data == {"action": "cancel-run", "key": None}
