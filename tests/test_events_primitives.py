"""Events and retention of the kinds that came with issue 15: claims, pools and their
grants, quotas, budgets, admission (work limits, requirements held by a delivery), once,
task subscriptions. Each emits its catalogue events in order; a run's end implies the
events of the waiters it cancels; retention deletes the finished grants, reservations,
waiters, onces and work limits of purged runs (and of purged tasks), and keeps the
named, space-wide entities (claims, pools, quotas, budgets) and everything live."""

from __future__ import annotations

import msgspec
import pytest
import trio

import rallypoint
from rallypoint import protocol as p
from rallypoint.actors.api import REPLY_TYPES
from rallypoint.errors import WaitTimeout
from rallypoint.service import Session

PRIMITIVE_PREFIXES = ("claim.", "pool.", "grant.", "quota.", "budget.", "work_limit.", "once.")


async def all_events(rs, types=None, scope=None):
    """Every event kept (pages of 1000)."""
    out, cursor = [], None
    while True:
        page = await rs.events.list(cursor, limit=1000, types=types, scope=scope)
        out += page.events
        if page.next_cursor == cursor or page.next_cursor >= page.newest:
            return out
        cursor = page.next_cursor


async def call(rs, op, space: str = "default"):
    raw = await rs.node.service.call(Session(space=space), op)
    return msgspec.msgpack.decode(raw, type=REPLY_TYPES[type(op)])


async def test_primitive_events_come_in_order_with_their_types(autojump_clock):
    async with rallypoint.open_embedded() as rs:
        run = await rs.scopes.create(name="prims")
        lease = await run.claims.acquire("invoice-1", lease_seconds=30, holder="w1")
        await lease.release("seen")
        once = await run.claims.acquire("mail-1")
        await once.complete({"sent": True})
        await rs.pools.ensure("gpu", 2)
        grant = await run.pools.acquire("gpu", 1, lease_seconds=30)
        await grant.release()
        q = await rs.quotas.ensure("calls", units_limit=5, window_seconds=60)
        await q.take(2, scope=run)
        b = await rs.budgets.ensure("spend", limit=1000)
        res = await b.reserve(300, scope=run)
        await res.settle(120, "u1")
        res2 = await b.reserve(50, scope=run)
        await res2.void()
        await run.work_limits.ensure("crawl", max_outstanding=3)
        o = await call(rs, p.OnceAcquire(scope_id=run.id, key="step-1", holder="h"))
        await call(rs, p.OnceComplete(scope_id=run.id, key="step-1", token=o.token,
                                      result=msgspec.Raw(msgspec.msgpack.encode("ok"))))
        # admission: a task that needs a unit of the pool and money; its delivery holds
        # them and gives them back when it completes
        mbx = await rs.mailboxes.ensure("gpu-work")
        await mbx.submit({"x": 1}, scope=run, requirements={"pools": {"gpu": 1}, "budgets": {"spend": 100}})
        d = await mbx.receive(run)
        await d.complete({"ok": True})

        evs = [e for e in await all_events(rs) if e.type.startswith(PRIMITIVE_PREFIXES)]
        assert [e.type for e in evs] == [
            "claim.acquired", "claim.released",
            "claim.acquired", "claim.completed",
            "pool.created", "grant.acquired", "grant.released",
            "quota.created", "quota.consumed",
            "budget.created", "budget.reserved", "budget.settled",
            "budget.reserved", "budget.voided",
            "work_limit.created",
            "once.acquired", "once.completed",
            # the delivery: grant and reservation with TaskDelivered; given back with TaskCompleted
            "grant.acquired", "budget.reserved", "budget.settled", "grant.released",
        ]
        by_type = {}
        for e in evs:
            by_type.setdefault(e.type, []).append(e)
        acq = by_type["claim.acquired"][0]
        assert (acq.kind, acq.run, acq.data["key"], acq.data["generation"], acq.data["holder"]) == \
               ("claim", run.id, "invoice-1", 1, "w1")
        assert by_type["claim.released"][0].data["reason"] == "released"
        g0 = by_type["grant.acquired"][0]
        assert (g0.kind, g0.id, g0.data["pool"], g0.data["units"]) == ("grant", grant.id, "gpu", 1)
        assert by_type["grant.acquired"][1].data["task"] == d.task_id
        assert by_type["grant.released"][1].data["reason"] == "delivery_ended"
        assert by_type["quota.consumed"][0].data["units"] == 2 and by_type["quota.consumed"][0].run == run.id
        settled = by_type["budget.settled"]
        assert (settled[0].data["charged_minor"], settled[0].data["usage_key"]) == (120, "u1")
        assert settled[1].data["charged_minor"] == 100 and settled[1].data["reservation"] == \
               by_type["budget.reserved"][2].data["reservation"]
        assert by_type["budget.voided"][0].data["released_minor"] == 50
        assert by_type["once.acquired"][0].data["key"] == "step-1"
        # filters: one aggregate, one prefix
        page = await rs.events.list(None, types=["budget.*"])
        assert {e.type.split(".")[0] for e in page.events} == {"budget"}
        page = await rs.events.list(None, aggregate=f"claim:{acq.id}")
        assert [e.type for e in page.events] == ["claim.acquired", "claim.released"]


async def test_a_run_end_implies_the_events_of_the_waiters_it_cancels(autojump_clock):
    async with rallypoint.open_embedded() as rs:
        owner = await rs.scopes.create(name="owner")
        waiter_run = await rs.scopes.create(name="waiter")
        await owner.claims.acquire("k", lease_seconds=600)
        await rs.pools.ensure("one", 1)
        await owner.pools.acquire("one", 1, lease_seconds=600)
        q = await rs.quotas.ensure("q", units_limit=1, window_seconds=3600)
        await q.take(1, scope=owner)
        errors = []

        async def wait_for(coro):
            try:
                await coro
            except Exception as e:  # the run's end answers them SCOPE_CANCELLED
                errors.append(type(e).__name__)

        async with trio.open_nursery() as n:
            n.start_soon(wait_for, waiter_run.claims.acquire("k", wait=3600))
            n.start_soon(wait_for, waiter_run.pools.acquire("one", 1, wait=3600))
            n.start_soon(wait_for, q.take(1, scope=waiter_run, wait=3600))
            await trio.sleep(5)
            await waiter_run.cancel(reason="enough")
        assert sorted(errors) == ["ScopeCancelledError"] * 3
        evs = await all_events(rs, types=["claim.*", "pool.*", "quota.*"])
        waiting = [e.type for e in evs if e.type.endswith(".waiting")]
        assert sorted(waiting) == ["claim.waiting", "pool.waiting", "quota.waiting"]
        ended = {e.type: e for e in evs if e.type.endswith(".wait_ended")}
        assert set(ended) == {"claim.wait_ended", "pool.wait_ended", "quota.wait_ended"}
        assert ended["claim.wait_ended"].data["reason"] == "cancelled"
        assert ended["pool.wait_ended"].data["reason"] == "cancelled"
        assert ended["quota.wait_ended"].data["state"] == "CANCELLED"
        assert ended["quota.wait_ended"].run == waiter_run.id
        # in the cancel's commit: after the run's own scope.cancelled
        cancel = [e for e in await all_events(rs, types=["scope.cancelled"]) if e.id == waiter_run.id][0]
        assert all(e.seq > cancel.seq for e in ended.values())


async def test_replay_after_restart_derives_the_same_primitive_events(tmp_path, autojump_clock):
    data = str(tmp_path / "d")
    async with rallypoint.open_embedded(data_dir=data) as rs:
        run = await rs.scopes.create()
        await (await run.claims.acquire("k")).release()
        b = await rs.budgets.ensure("b", limit=100)
        await (await b.reserve(10, scope=run)).settle(5, "u")
        before = [(e.seq, e.type, e.id, e.data) for e in await all_events(rs)]
        await trio.sleep(0)
    async with rallypoint.open_embedded(data_dir=data) as rs:
        after = [(e.seq, e.type, e.id, e.data) for e in await all_events(rs)]
    assert after == before and any(t == "budget.settled" for _, t, _, _ in after)


RETAIN = 60.0


async def test_retention_purges_finished_primitive_records_of_purged_runs_and_tasks(autojump_clock):
    async with rallypoint.open_embedded(retain_finished=RETAIN) as rs:
        coord = rs.node.coordinator
        await rs.pools.ensure("gpu", 4)
        b = await rs.budgets.ensure("spend", limit=10_000)
        q = await rs.quotas.ensure("q", units_limit=100, window_seconds=3600)
        mbx = await rs.mailboxes.ensure("work")
        # A: ends; everything it made is finished
        a = await rs.scopes.create(name="a")
        await (await a.claims.acquire("a-claim")).release()
        await (await a.pools.acquire("gpu", 1)).release()
        await (await b.reserve(100, scope=a)).settle(40, "a-u")
        await q.take(1, scope=a, wait=10)  # a waiter entity, granted at once
        await a.work_limits.ensure("a-limit", 5)
        o = await call(rs, p.OnceAcquire(scope_id=a.id, key="a-once"))
        await call(rs, p.OnceComplete(scope_id=a.id, key="a-once", token=o.token))
        # B: lives on; one finished task with requirements (purged alone), one open
        # reservation and one active grant (kept)
        bb = await rs.scopes.create(name="b")
        await mbx.submit(1, scope=bb, requirements={"pools": {"gpu": 1}, "budgets": {"spend": 50}})
        d = await mbx.receive(bb)
        await d.complete("done")
        open_res = await b.reserve(30, scope=bb)
        live_grant = await bb.pools.acquire("gpu", 1, lease_seconds=600)
        await bb.work_limits.ensure("b-limit", 5)
        await a.cancel()
        counts = {k: len(v) for k, v in (("grants", coord.pools.grants), ("reservations", coord.budgets.reservations),
                                         ("waiters", coord.quotas.waiters), ("onces", coord.onces.table),
                                         ("limits", coord.admission.table))}
        assert counts == {"grants": 3, "reservations": 3, "waiters": 1, "onces": 1, "limits": 2}
        await trio.sleep(RETAIN + 5)
        # A's records are gone, and the finished task of B with what its delivery held
        assert set(coord.pools.grants) == {live_grant.id}
        assert set(coord.budgets.reservations) == {open_res.id}
        assert not coord.quotas.waiters and not coord.onces.table
        assert [w.name for w in coord.admission.table.values()] == ["b-limit"]
        # named, space-wide entities stay; a claim of a purged run still works (its
        # generation goes on) from a live run
        assert len(coord.claims.table) == 1 and len(coord.pools.table) == 1
        lease = await bb.claims.acquire("a-claim")
        assert lease.generation == 2
        await lease.release()
        assert (await b.status()).settled_minor == 40 + 50
        assert (await q.status()).consumed_total == 1
        assert a.id not in coord.runs.table and bb.id in coord.runs.table
        purged = await all_events(rs, types=["retention.purged"])
        assert purged and sum(e.data["entities"] for e in purged) >= 8


async def test_idempotency_answers_past_their_ttl_are_forgotten_without_new_requests(autojump_clock):
    async with rallypoint.open_embedded() as rs:
        coord = rs.node.coordinator
        coord.idempotency.ttl_ms = 10_000
        for i in range(3):
            await rs.node.service.call(Session(local=True),  # (the HTTP layer's own step: LOCAL)
                                       p.IdempotencyRecord(key=f"k{i}", fingerprint="f", status=200, body=b"{}"))
        assert len(coord.idempotency.table) == 3
        await trio.sleep(5)
        assert len(coord.idempotency.table) == 3
        await trio.sleep(10)
        assert len(coord.idempotency.table) == 0
        raw = await rs.node.service.call(Session(local=True), p.IdempotencyLookup(key="k0", fingerprint="f"))
        assert not msgspec.msgpack.decode(raw, type=REPLY_TYPES[p.IdempotencyLookup]).found


async def test_wait_timeouts_do_not_leak_events_out_of_order(autojump_clock):
    """A quota waiter that runs out of time: quota.waiting, then quota.wait_ended EXPIRED."""
    async with rallypoint.open_embedded() as rs:
        run = await rs.scopes.create()
        q = await rs.quotas.ensure("tight", units_limit=1, window_seconds=3600)
        await q.take(1, scope=run)
        with pytest.raises(WaitTimeout):
            await q.take(1, scope=run, wait=5)
        evs = [e for e in await all_events(rs, types=["quota.*"])]
        assert [e.type for e in evs] == ["quota.created", "quota.consumed", "quota.waiting", "quota.wait_ended"]
        assert evs[-1].data["state"] in ("EXPIRED", "CANCELLED")


async def test_retention_of_primitive_records_after_a_restart(tmp_path, autojump_clock):
    """The retention indexes are rebuilt from a snapshot (and the journal tail): what a
    run made before a restart is purged with it after the run ends, and stays purged
    after another restart."""
    data = str(tmp_path / "d")
    async with rallypoint.open_embedded(data_dir=data, retain_finished=RETAIN) as rs:
        await rs.pools.ensure("gpu", 2)
        b = await rs.budgets.ensure("spend", limit=1000)
        a = await rs.scopes.create(name="a")
        await (await a.pools.acquire("gpu", 1)).release()
        await rs.node.snapshotter.snapshot()
        await (await b.reserve(10, scope=a)).void()  # in the journal tail
        await a.work_limits.ensure("lim", 2)
    async with rallypoint.open_embedded(data_dir=data, retain_finished=RETAIN) as rs:
        coord = rs.node.coordinator
        assert len(coord.pools.grants) == 1 and len(coord.budgets.reservations) == 1
        await rs.scope(a.id).complete()
        await trio.sleep(RETAIN + 5)
        assert not coord.pools.grants and not coord.budgets.reservations and not coord.admission.table
        assert a.id not in coord.runs.table
    async with rallypoint.open_embedded(data_dir=data, retain_finished=RETAIN) as rs:
        coord = rs.node.coordinator
        assert not coord.pools.grants and not coord.budgets.reservations and not coord.admission.table
        assert len(coord.pools.table) == 1 and len(coord.budgets.table) == 1
