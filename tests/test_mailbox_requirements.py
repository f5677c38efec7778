"""Requirements declared on a mailbox (its *default requirements*; runstate 0.3's
``@worker.queue(name, slots=gpu)``, ``PUT /mailboxes/by-name`` with ``requirements``):
every task submitted to the mailbox without requirements of its own gets them, resolved
and stored on the task when it is submitted, by every path that makes tasks (submit,
submit_many, group members, join-set children); a task's own requirements win; an
ensure with requirements replaces them, one without leaves them, ``{}`` clears them;
they are validated like a task's; they are journaled and survive a restart; the HTTP
PUT stores them."""

from __future__ import annotations

import shutil

import httpx
import msgspec
import pytest
import trio

import rallypoint
from rallypoint import protocol as p
from rallypoint.actors.queue import MailboxState
from rallypoint.errors import ConflictError, NotFoundError, ValidationError
from rallypoint.http.app import HttpApi
from rallypoint.records import MailboxCreated, MailboxRequirementsSet, decode_commit


def _stored(rs, ticket) -> dict:
    """The requirements stored on a task (embedded: straight from the coordinator), by
    name again: ``{"pools": {...}, "budgets": {...}}`` with the empty kinds left out."""
    coord = rs.node.coordinator
    view = coord.admission.describe(coord.queues.tasks[ticket.id].requirements)
    return {} if view is None else {k: v for k, v in msgspec.structs.asdict(view).items() if v}


# ------------------------------------------------------------------ admission


async def test_a_producers_submit_without_requirements_is_held_to_the_declared_pool(autojump_clock, ers):
    """The worker declares ``gpu: 1`` on the mailbox; a producer that knows nothing of it
    submits 8 tasks without requirements; a consume loop with 4 handler slots runs them
    one at a time (without the mailbox's requirements it would run 4 at once)."""
    rs = ers
    gpu = await rs.pools.ensure("gpu", 1)
    declared = await rs.mailboxes.ensure("render", requirements={"pools": {"gpu": 1}})
    assert declared.info.requirements == {"pools": {"gpu": 1}}
    producer_view = await rs.mailboxes.ensure("render")  # a producer's ensure: no requirements
    run = await rs.scopes.create()
    tickets = [await producer_view.submit(i, scope=run) for i in range(8)]
    assert all(_stored(rs, tk) == {"pools": {"gpu": 1}} for tk in tickets)
    running = peak = 0

    async def handler(d):
        nonlocal running, peak
        assert [(g.pool, g.units) for g in d.grants] == [("gpu", 1)]
        running += 1
        peak = max(peak, running)
        await trio.sleep(1)
        running -= 1
        return d.input

    async with trio.open_nursery() as n:
        n.start_soon(lambda: rallypoint.consume(rs, declared, run, handler, concurrency=4, wait=1))
        infos = await rs.results(tickets, timeout=300)
        await run.cancel()
    assert [i.outcome for i in infos] == list(range(8))
    assert peak == 1
    assert (await gpu.status()).units_used == 0


async def test_admit_takes_the_declared_units_and_nothing_more(rs):
    """Without any timing: while a task of the mailbox holds the pool's one unit, the next
    one (submitted with no requirements) is not handed out; it is once the first ends."""
    pool = await rs.pools.ensure("mr-admit", 1)
    await rs.mailboxes.ensure("mr-admit", requirements={"pools": {"mr-admit": 1}})
    mbx = rs.mailbox("mr-admit")
    run = await rs.scopes.create()
    first = await mbx.submit("a", scope=run)
    second = await mbx.submit("b", scope=run)
    d1 = await mbx.admit(run)
    assert d1.task_id == first.id and [(g.pool, g.units) for g in d1.grants] == [("mr-admit", 1)]
    assert (await pool.status()).units_used == 1
    assert await mbx.admit(run) is None  # the second needs the unit the first holds
    await d1.complete("done")
    d2 = await mbx.admit(run)
    assert d2.task_id == second.id and len(d2.grants) == 1
    await d2.complete("done")
    assert (await pool.status()).units_used == 0
    await run.cancel()


async def test_budget_requirements_on_the_mailbox_reserve_for_each_delivery(rs):
    spend = await rs.budgets.ensure("mr-spend", limit=100)
    mbx = await rs.mailboxes.ensure("mr-spend", requirements={"budgets": {"mr-spend": 60}})
    assert mbx.info.requirements == {"budgets": {"mr-spend": 60}}
    run = await rs.scopes.create()
    await mbx.submit(1, scope=run)
    await mbx.submit(2, scope=run)
    d = await mbx.admit(run)
    assert len(d.reservations) == 1 and (await spend.status()).available_minor == 40
    assert await mbx.admit(run) is None  # 40 left: the second task's 60 does not fit
    await d.reject("no")  # voided: the money comes back
    d2 = await mbx.admit(run)
    assert d2 is not None and len(d2.reservations) == 1
    await d2.complete("ok")  # settled in full (the reservation was the most it may cost)
    st = await spend.status()
    assert (st.settled_minor, st.available_minor) == (60, 40)
    await run.cancel()


async def test_a_tasks_own_requirements_replace_the_mailboxs(rs):
    a = await rs.pools.ensure("mr-own-a", 1)
    b = await rs.pools.ensure("mr-own-b", 2)
    mbx = await rs.mailboxes.ensure("mr-own", requirements={"pools": {"mr-own-a": 1}})
    run = await rs.scopes.create()
    plain = await mbx.submit("plain", scope=run)
    own = await mbx.submit("own", scope=run, requirements={"pools": {"mr-own-b": 2}})
    empty = await mbx.submit("empty", scope=run, requirements={})  # none of its own: the defaults
    if hasattr(rs, "node"):
        assert _stored(rs, plain) == {"pools": {"mr-own-a": 1}}
        assert _stored(rs, own) == {"pools": {"mr-own-b": 2}}  # replaced, not merged
        assert _stored(rs, empty) == {"pools": {"mr-own-a": 1}}
    d1 = await mbx.admit(run)
    assert d1.task_id == plain.id and [(g.pool, g.units) for g in d1.grants] == [("mr-own-a", 1)]
    d2 = await mbx.admit(run)  # "a" is taken: "own" needs only "b", "empty" is skipped
    assert d2.task_id == own.id and [(g.pool, g.units) for g in d2.grants] == [("mr-own-b", 2)]
    assert ((await a.status()).units_used, (await b.status()).units_used) == (1, 2)
    assert await mbx.admit(run) is None
    await d1.complete("x")
    d3 = await mbx.admit(run)
    assert d3.task_id == empty.id and [(g.pool, g.units) for g in d3.grants] == [("mr-own-a", 1)]
    await d3.complete("x")
    await d2.complete("x")
    await run.cancel()


async def test_every_submit_path_gets_the_defaults(autojump_clock, ers):
    """submit_many items (one with its own requirements), a group member, a join-set
    child: each stored with the mailbox's requirements unless it carries its own."""
    rs = ers
    await rs.pools.ensure("mr-paths", 4)
    await rs.pools.ensure("mr-paths-own", 1)
    mbx = await rs.mailboxes.ensure("mr-paths", requirements={"pools": {"mr-paths": 2}})
    run = await rs.scopes.create()
    many = await mbx.submit_many([1, 2], scope=run)
    assert [_stored(rs, tk) for tk in many] == [{"pools": {"mr-paths": 2}}] * 2
    own = await mbx.submit_many([3], scope=run, requirements={"pools": {"mr-paths-own": 1}})
    assert _stored(rs, own[0]) == {"pools": {"mr-paths-own": 1}}
    group = await run.groups.create(mbx, "N_ACCEPTED", threshold=1)
    member = await group.submit({"m": 1}, key="m1")
    assert _stored(rs, member) == {"pools": {"mr-paths": 2}}
    own_member = await group.submit({"m": 2}, key="m2", requirements={"pools": {"mr-paths-own": 1}})
    assert _stored(rs, own_member) == {"pools": {"mr-paths-own": 1}}  # a member's own win too
    js = await run.join_sets.create("kids")
    child_id = await js.submit(mbx, {"c": 1})
    assert _stored(rs, rs.task(child_id)) == {"pools": {"mr-paths": 2}}
    own_child = await js.submit(mbx, {"c": 2}, requirements={"pools": {"mr-paths-own": 1}})
    assert _stored(rs, rs.task(own_child)) == {"pools": {"mr-paths-own": 1}}  # a child's own win too
    # and a group member is admitted with them (delivery.grants)
    d = await mbx.admit(group.scope_id)
    assert d.task_id == member.id and [(g.pool, g.units) for g in d.grants] == [("mr-paths", 2)]
    await d.complete("ok")
    await run.cancel()


# ------------------------------------------------------------------ declaring


async def test_an_ensure_with_requirements_replaces_one_without_leaves_and_empty_clears(autojump_clock, ers):
    rs = ers
    await rs.pools.ensure("mr-x", 2)
    await rs.pools.ensure("mr-y", 2)

    async def declared():
        return [e for e in (await rs.events.list(None, 1000)).events if e.type.startswith("mailbox.")]

    mbx = await rs.mailboxes.ensure("mr-decl", requirements={"pools": {"mr-x": 1}})
    run = await rs.scopes.create()
    before = await mbx.submit("before", scope=run)
    again = await rs.mailboxes.ensure("mr-decl", requirements={"pools": {"mr-x": 1}})  # unchanged
    assert again.info.requirements == {"pools": {"mr-x": 1}}
    n_events = len(await declared())
    changed = await rs.mailboxes.ensure("mr-decl", requirements={"pools": {"mr-y": 2}})  # a new slots=: no CONFLICT
    assert changed.info.requirements == {"pools": {"mr-y": 2}}
    assert len(await declared()) == n_events + 1  # one MailboxRequirementsSet; the identical one wrote nothing
    producer = await rs.mailboxes.ensure("mr-decl")  # absent: left as they are
    assert producer.info.requirements == {"pools": {"mr-y": 2}}
    assert (await rs.mailboxes.get("mr-decl")).info.requirements == {"pools": {"mr-y": 2}}
    after = await mbx.submit("after", scope=run)
    assert _stored(rs, before) == {"pools": {"mr-x": 1}}  # already queued: keeps what it was submitted with
    assert _stored(rs, after) == {"pools": {"mr-y": 2}}
    # an idempotent resubmission returns the task as it was submitted
    keyed = await mbx.submit("k", "key-1", scope=run)
    await rs.mailboxes.ensure("mr-decl", requirements={"pools": {"mr-x": 2}})
    assert (await mbx.submit("k", "key-1", scope=run)).id == keyed.id
    assert _stored(rs, keyed) == {"pools": {"mr-y": 2}}
    cleared = await rs.mailboxes.ensure("mr-decl", requirements={})
    assert cleared.info.requirements is None
    assert _stored(rs, await mbx.submit("none", scope=run)) == {}
    assert [(e.type, e.data.get("requirements")) for e in (await declared())[-3:]] == [
        ("mailbox.requirements_set", {"pools": {"mr-y": 2}}),
        ("mailbox.requirements_set", {"pools": {"mr-x": 2}}),
        ("mailbox.requirements_set", {}),
    ]
    # the other settings are still checked
    with pytest.raises(ConflictError):
        await rs.mailboxes.ensure("mr-decl", max_attempts=2, requirements={"pools": {"mr-x": 1}})
    assert (await rs.mailboxes.get("mr-decl")).info.requirements is None  # a refused ensure changed nothing
    await run.cancel()


async def test_declared_requirements_are_validated_like_a_tasks(rs):
    await rs.pools.ensure("mr-val", 2)
    await rs.budgets.ensure("mr-val-b", limit=10)
    mbx = await rs.mailboxes.ensure("mr-val", requirements={"pools": {"mr-val": 1}})
    run = await rs.scopes.create()
    cases = [
        ({"pools": {"no-such-pool": 1}}, NotFoundError),
        ({"budgets": {"no-such-budget": 1}}, NotFoundError),
        ({"pools": {"mr-val": 3}}, ValidationError),  # more than units_total: could never be admitted
        ({"pools": {"mr-val": 0}}, ValidationError),
        ({"budgets": {"mr-val-b": 11}}, ValidationError),  # more than the budget's limit
        ({"quotas": {"q": 1}}, ValidationError),  # quota requirements: refused, as on tasks
        ({"pools": {"mr-val": "two"}}, ValidationError),
    ]
    for req, err in cases:
        with pytest.raises(err) as on_task:
            await mbx.submit("x", scope=run, requirements=req)
        with pytest.raises(err) as on_mailbox:
            await rs.mailboxes.ensure("mr-val", requirements=req)
        assert on_mailbox.value.code == on_task.value.code
        assert on_mailbox.value.message == on_task.value.message, req  # the same error, word for word
        with pytest.raises(err):  # nor is a new mailbox made with them
            await rs.mailboxes.ensure("mr-val-new", requirements=req)
    assert (await rs.mailboxes.get("mr-val")).info.requirements == {"pools": {"mr-val": 1}}  # unchanged
    with pytest.raises(NotFoundError):
        await rs.mailboxes.get("mr-val-new")
    with pytest.raises(ValidationError) as ei:
        await rs.mailboxes.ensure("mr-val-inbox", mode="INBOX", requirements={"pools": {"mr-val": 1}})
    assert ei.value.details["field"] == "requirements"
    await run.cancel()


# ------------------------------------------------------------------ durability


async def _declare(rs) -> None:
    await rs.pools.ensure("gpu", 2)
    await rs.budgets.ensure("spend", limit=1000)
    await rs.mailboxes.ensure("render", requirements={"pools": {"gpu": 2}})
    await rs.mailboxes.ensure("render", requirements={"pools": {"gpu": 1}, "budgets": {"spend": 30}})  # replaced
    await rs.mailboxes.ensure("plain")


async def _check_declared(rs) -> None:
    assert (await rs.mailboxes.get("render")).info.requirements == {"pools": {"gpu": 1}, "budgets": {"spend": 30}}
    assert (await rs.mailboxes.get("plain")).info.requirements is None
    run = await rs.scopes.create()
    ticket = await rs.mailbox("render").submit("after restart", scope=run)  # a producer: no requirements
    assert _stored(rs, ticket) == {"pools": {"gpu": 1}, "budgets": {"spend": 30}}
    d = await rs.mailbox("render").admit(run)
    assert [(g.pool, g.units) for g in d.grants] == [("gpu", 1)] and len(d.reservations) == 1
    await d.complete("ok")
    await run.cancel()


async def test_declared_requirements_survive_a_clean_restart_and_a_crash(tmp_path):
    live, crashed = tmp_path / "live", tmp_path / "crashed"
    async with rallypoint.open_embedded(str(live), durability="fsync") as rs:
        await _declare(rs)
        j = rs.node.coordinator.journal
        await j.wait_durable(j.last_lsn)
        shutil.copytree(live, crashed)  # what a SIGKILL leaves: the journal, no final snapshot
    # a clean stop: from the snapshot
    async with rallypoint.open_embedded(str(live), durability="fsync") as rs:
        assert rs.node.recovery_info["replayed"] == 0
        await _check_declared(rs)
        await rs.mailboxes.ensure("render", requirements={})  # cleared: journaled, and replayed below
    async with rallypoint.open_embedded(str(live), durability="fsync") as rs:
        assert (await rs.mailboxes.get("render")).info.requirements is None
    # a crash: MailboxCreated and MailboxRequirementsSet replayed from the journal alone
    async with rallypoint.open_embedded(str(crashed), durability="fsync") as rs:
        assert rs.node.recovery_info["replayed"] > 0 and rs.node.recovery_info["snapshot_lsn"] == 0
        await _check_declared(rs)


def test_old_journals_and_snapshots_without_the_field_still_decode():
    """A MailboxCreated journaled, and a MailboxState snapshotted, before mailboxes had
    requirements (no such key): decoded with none."""
    old = {"r": "mailbox_created", "id": "mbx_1", "space": "default", "name": "jobs", "mode": "WORK",
           "max_attempts": 5, "backlog_limit": None, "at_ms": 1}
    (rec,) = decode_commit(msgspec.msgpack.encode([old]))
    assert type(rec) is MailboxCreated and rec.requirements is None
    state = {"id": "mbx_1", "space": "default", "name": "jobs", "mode": "WORK", "max_attempts": 5,
             "backlog_limit": None, "created_at_ms": 1}
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(state), type=MailboxState).requirements is None
    cleared = {"r": "mailbox_requirements_set", "id": "mbx_1", "at_ms": 2}
    (rec,) = decode_commit(msgspec.msgpack.encode([cleared]))
    assert type(rec) is MailboxRequirementsSet and rec.requirements is None


# ------------------------------------------------------------------ HTTP


async def test_http_put_by_name_stores_requirements_for_producer_only_submits(autojump_clock, ers):
    """runstate 0.3: the worker PUTs ``{maxAttempts, requirements}``; a producer PUTs
    ``{}`` and POSTs tasks without requirements, which are held to the declared pool."""
    rs = ers
    await rs.pools.ensure("gpu", 1)
    api = HttpApi(rs.node.service)
    transport = httpx.ASGITransport(app=api)
    async with httpx.AsyncClient(transport=transport, base_url="http://rp/v1/spaces/default") as c:
        worker = await c.put("/mailboxes/by-name/render",
                             json={"maxAttempts": 5, "requirements": {"pools": [{"name": "gpu", "units": 1}]}})
        assert worker.status_code == 200, worker.text
        assert worker.json()["requirements"] == {"pools": [{"name": "gpu", "units": 1}], "budgets": []}
        producer = await c.put("/mailboxes/by-name/render", json={})
        assert producer.status_code == 200 and producer.json()["id"] == worker.json()["id"]
        assert producer.json()["requirements"] == {"pools": [{"name": "gpu", "units": 1}], "budgets": []}
        run = (await c.put("/runs/producer", json={})).json()["id"]
        mbx = worker.json()["id"]
        tasks = []
        for n in range(2):
            r = await c.post("/tasks", json={"scopeId": run, "mailboxId": mbx, "taskKey": f"k{n}", "input": n})
            assert r.status_code == 200, r.text
            tasks.append(r.json()["taskId"])
        admit = {"scopeId": run, "mailboxId": mbx, "holder": "w", "holderSession": "s", "leaseSeconds": 30}
        first = await c.post("/tasks/admit", json=admit)
        assert first.status_code == 200 and first.json()["taskId"] == tasks[0]
        assert [g["units"] for g in first.json()["grants"]] == [1]
        assert (await c.post("/tasks/admit", json=admit)).status_code == 204  # the unit is held
        # a requirements-only PUT keeps the queue's settings (no CONFLICT on maxAttempts 5)
        other = await c.put("/mailboxes/by-name/render", json={"requirements": {}})
        assert other.status_code == 200 and other.json()["requirements"] is None
        assert other.json()["maxAttempts"] == 5
        # ... and makes a missing queue with its defaults and those requirements
        fresh = await c.put("/mailboxes/by-name/fresh", json={"requirements": {"pools": [{"name": "gpu"}]}})
        assert fresh.status_code == 200 and fresh.json()["maxAttempts"] == 5
        assert fresh.json()["requirements"]["pools"] == [{"name": "gpu", "units": 1}]
        budgets = await c.put("/mailboxes/by-name/fresh", json={"requirements": {"budgets": []}})
        assert budgets.json()["requirements"] is None  # given and empty: cleared
        # refused as on POST /tasks: quotas 400, an unknown pool 404; nothing stored
        quota = await c.put("/mailboxes/by-name/render",
                            json={"requirements": {"quotas": [{"name": "q", "units": 1}]}})
        assert quota.status_code == 400 and quota.json()["error"]["code"] == "VALIDATION_FAILED"
        unknown = await c.put("/mailboxes/by-name/render",
                              json={"requirements": {"pools": [{"name": "nope", "units": 1}]}})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "NOT_FOUND"
        on_task = await c.post("/tasks", json={"scopeId": run, "mailboxId": mbx, "taskKey": "k9", "input": 9,
                                               "requirements": {"pools": [{"name": "nope", "units": 1}]}})
        assert on_task.json()["error"]["message"] == unknown.json()["error"]["message"]
        # a group member over HTTP: its own requirements (0.3's gather sends them), else the queue's
        await c.put("/mailboxes/by-name/render", json={"requirements": {"pools": [{"name": "gpu", "units": 1}]}})
        await rs.pools.ensure("other", 3)
        g = await c.post("/task-groups", json={"mailboxId": mbx, "condition": "ALL_TERMINAL", "parentScopeId": run})
        assert g.status_code == 200, g.text
        gid = g.json()["id"]
        own = await c.post(f"/task-groups/{gid}/tasks", json={"taskKey": "g1", "input": 1, "requirements": {
            "pools": [{"name": "other", "units": 3}]}})
        dflt = await c.post(f"/task-groups/{gid}/tasks", json={"taskKey": "g2", "input": 2})
        assert own.status_code == 200 and dflt.status_code == 200, (own.text, dflt.text)
        assert _stored(rs, rs.task(own.json()["taskId"])) == {"pools": {"other": 3}}
        assert _stored(rs, rs.task(dflt.json()["taskId"])) == {"pools": {"gpu": 1}}
        await c.put("/mailboxes/by-name/render", json={"requirements": {}})
        listed = {m["name"]: m for m in (await c.get("/mailboxes")).json()["mailboxes"]}
        assert listed["render"]["requirements"] is None and listed["fresh"]["requirements"] is None
        posted = await c.post("/mailboxes", json={"name": "posted", "requirements": {
            "pools": [{"name": "gpu", "units": 1}], "budgets": []}})
        assert posted.status_code == 200 and posted.json()["requirements"]["pools"] == [{"name": "gpu", "units": 1}]
