"""Retention (issue 16, item 3): finished runs -- with everything they own -- and finished
tasks of live runs are deleted ``--retain-finished`` after they ended, by a ``Purged``
record (replay and snapshots agree; a snapshot deletes the keys from LMDB); nothing a
live run can still reach is removed; purged ids answer NOT_FOUND with "purged"."""

from __future__ import annotations

import pytest
import trio

import rallypoint
from rallypoint import protocol as p
from rallypoint.client import types as t
from rallypoint.errors import NotFoundError, ScopeCancelledError

RETAIN = 60.0  # seconds


async def open_rs(**kw):
    return rallypoint.open_embedded(retain_finished=RETAIN, **kw)


async def _purged(call) -> str:
    with pytest.raises(NotFoundError) as ei:
        await call
    assert "purged" in ei.value.message, ei.value.message
    return ei.value.message


async def test_finished_runs_are_deleted_after_retention_and_live_ones_kept(autojump_clock):
    async with rallypoint.open_embedded(retain_finished=RETAIN) as rs:
        coord = rs.node.coordinator
        mbx = await rs.mailboxes.ensure("jobs")
        # A: a whole tree that gets cancelled
        a = await rs.scopes.create(name="a")
        a_child = await a.child(name="a-child")
        a_task = await mbx.submit({"a": 1}, scope=a_child)
        a_group = await a.groups.create(mbx, "ALL_TERMINAL")
        a_member = await a_group.submit({"m": 1})
        a_js = await a_child.join_sets.create("fan")
        await a_js.submit(mbx, {"j": 1})
        await a_js.submit_delay(3600)
        a_bar = await a_child.barriers.create(target=3)
        a_tmr = await a_child.timers.create(after_seconds=3600)
        # B: a live run that keeps working
        b = await rs.scopes.create(name="b")
        b_done = await mbx.submit({"b": "done"}, scope=b, key="b-done")
        d = await mbx.receive(b)
        assert d.task_id == b_done.id
        await d.complete({"ok": 1})
        b_waiting = await (await rs.mailboxes.ensure("idle")).submit({"b": "waiting"}, scope=b)
        b_child = await b.child(name="b-child")  # completed below: purged, B stays
        b_js = await b.join_sets.create("keep")  # a live run's join set: kept, with its children
        await b_js.submit(mbx, {"keep": 1})
        d = await mbx.receive(b)
        await d.complete({"kept": True})
        b_group = await b.groups.create(mbx, "N_ACCEPTED", threshold=1)
        m = await b_group.submit({"g": 1})
        d = await mbx.receive(b_group.scope_id)
        await d.complete(1)
        await b_group.accept(m.id)  # finalized: its gate run ended
        await b_child.complete()
        await a.cancel()
        entities_before = coord.entity_count()

        await trio.sleep(RETAIN - 5)  # not yet
        assert coord.retention.purged["entities"] == 0
        await a.status()
        await rs.task(b_done.id).status()

        await trio.sleep(10)  # past the retention (and a tick)
        for call in (a.status(), a_child.status(), rs.task(a_task.id).status(), a_group.status(),
                     rs.task(a_member.id).status(), a_bar.status(), a_tmr.status(), a_js.status(),
                     b_child.status(), rs.task(b_done.id).status(), b_group.status(), rs.scope(b_group.scope_id).status(),
                     rs.task(m.id).status()):
            await _purged(call)
        # the live run and what it can still reach are kept
        st = await b.status()
        assert st.stored_state == "ACTIVE" and st.children == 2  # (it counts the children it made: b-child, the gate)
        assert (await rs.task(b_waiting.id).status()).state == "QUEUED"
        assert (await b_js.status()).state == "OPEN"
        child_id, value = await b_js.join_next(timeout=5)  # its finished child is still there
        assert value == {"kept": True}
        assert (await mbx.status()).name == "jobs"  # mailboxes are never purged
        # a key is remembered only while its task is: the same key makes a new task now
        again = await mbx.submit({"b": "done"}, scope=b, key="b-done")
        assert again.id != b_done.id
        runs = {r.id for r in await rs.scopes.list(roots_only=True)}
        assert b.id in runs and a.id not in runs
        # A: 2 runs, the gate, 2 tasks, the group, its member, the join set, its child, barrier, timer;
        # B: b-child, the finished task, the group, its gate run, its member
        purged = coord.retention.purged
        assert purged["entities"] == 15 and purged["records"] >= 1
        assert coord.entity_count() == entities_before - 15 + 1  # (+ the task made again)
        # one retention.purged event per Purged record
        evs = (await rs.events.list(types="retention.purged", limit=100)).events
        assert sum(e.data["entities"] for e in evs) == purged["entities"]


async def test_a_run_whose_task_is_a_member_of_a_live_group_waits_for_that_group(autojump_clock):
    async with rallypoint.open_embedded(retain_finished=RETAIN) as rs:
        mbx = await rs.mailboxes.ensure("jobs")
        p_run = await rs.scopes.create(name="p")
        group = await p_run.groups.create(mbx, "N_ACCEPTED", threshold=1)
        r = await rs.scopes.create(name="r")
        x = await mbx.submit({"x": 1}, scope=r)
        await group.join_task(x)
        await r.cancel()  # x is cancelled; the group (open, unsealed) is undecided
        await trio.sleep(RETAIN * 3)
        assert (await r.status()).stored_state == "CANCELLED"  # kept: the group's view reads x
        st = await group.status()
        assert st.members[0].task_id == x.id and st.members[0].task_state == "CANCELLED"
        await group.close()  # FAILURE threshold_unreachable: the gate run ends
        await trio.sleep(RETAIN + 5)
        await _purged(group.status())
        await _purged(rs.task(x.id).status())  # (the group took its member)
        await trio.sleep(RETAIN + 5)  # a run held back is looked at again a retention window later
        await _purged(r.status())
        assert (await p_run.status()).stored_state == "ACTIVE"


async def test_a_purge_is_a_record_replay_and_the_snapshot_agree(tmp_path, autojump_clock):
    data = str(tmp_path / "d")
    async with rallypoint.open_embedded(data, retain_finished=RETAIN) as rs:
        mbx = await rs.mailboxes.ensure("jobs")
        keep = await rs.scopes.create(name="keep")
        gone = await rs.scopes.create(name="gone")
        kid = await gone.child()
        t = await mbx.submit({"t": 1}, scope=kid)
        await rs.node.snapshotter.snapshot()  # the doomed entities are in LMDB
        store = rs.node.snapshotter.store
        assert store.get(kid.id.encode()) is not None and store.get(t.id.encode()) is not None
        await gone.cancel()
        await trio.sleep(RETAIN + 5)
        await _purged(gone.status())
        count = rs.node.coordinator.entity_count()
        await rs.node.snapshotter.snapshot()
        for eid in (gone.id, kid.id, t.id):  # deleted from the store
            assert store.get(eid.encode()) is None
        assert store.entity_count() == count
        assert store.get(keep.id.encode()) is not None

    # replay the journal (a Purged record after the last snapshot) and compare
    async with rallypoint.open_embedded(data, retain_finished=RETAIN) as rs:
        async def no_snapshot():
            return None

        # no periodic snapshot (every 60 s: it would race the purge at RETAIN) and no
        # clean-shutdown snapshot: the Purged record is replayed
        rs.node.snapshotter.snapshot = no_snapshot
        gone2 = await rs.scopes.create(name="gone2")
        await gone2.cancel()
        await trio.sleep(RETAIN + 5)
        await _purged(gone2.status())
        count = rs.node.coordinator.entity_count()
    async with rallypoint.open_embedded(data, retain_finished=RETAIN) as rs:
        assert rs.node.recovery_info["replayed"] > 0
        assert rs.node.coordinator.entity_count() == count
        await _purged(rs.scope(gone2.id).status())
        assert (await rs.scope(keep.id).status()).stored_state == "ACTIVE"


async def test_retention_zero_keeps_everything(autojump_clock):
    async with rallypoint.open_embedded(retain_finished=0) as rs:
        run = await rs.scopes.create(name="forever")
        await run.cancel()
        await trio.sleep(RETAIN * 10)
        assert (await run.status()).stored_state == "CANCELLED"
        assert rs.node.coordinator.retention.purged["entities"] == 0


async def test_a_big_finished_run_is_emptied_over_several_records(autojump_clock, monkeypatch):
    from rallypoint.actors import retention

    monkeypatch.setattr(retention, "MAX_PER_RECORD", 50)
    async with rallypoint.open_embedded(retain_finished=RETAIN) as rs:
        mbx = await rs.mailboxes.ensure("jobs")
        run = await rs.scopes.create(name="big")
        await mbx.submit_many([{"i": i} for i in range(180)], scope=run)
        await run.cancel()
        await trio.sleep(RETAIN + 10)
        await _purged(run.status())
        assert rs.node.coordinator.retention.purged["records"] >= 4
        assert rs.node.coordinator.queues.tasks == {}


async def test_an_unknown_recent_id_says_nothing_about_purging():
    async with rallypoint.open_embedded(retain_finished=RETAIN) as rs:
        with pytest.raises(NotFoundError) as ei:
            await rs.scope(rs.node.coordinator.ids.new("scp")).status()
        assert "purged" not in ei.value.message


# ------------------------------------------------------------------ a purged run is ended (issue 34 item 1)


async def _refused_as_purged(call) -> None:
    with pytest.raises(ScopeCancelledError) as ei:
        await call
    assert ei.value.details["reason"] == "purged", ei.value


async def test_a_purged_run_is_ended_never_active_for_the_leases_it_still_holds(autojump_clock):
    """A cancelled run's claim lease, pool grant and once are live leases it still holds:
    retention keeps them while the run goes. Renewing them (and completing the claim)
    was refused while the run was kept; after the purge a missing
    run read as active, so the claim ended COMPLETED "from a cancelled run". Refused
    alike, before and after; release stays allowed."""
    async with rallypoint.open_embedded(retain_finished=RETAIN) as rs:
        run = await rs.scopes.create(name="doomed")
        lease = await run.claims.acquire("report", lease_seconds=600)
        await rs.pools.ensure("gpu", 2)
        grant = await run.pools.acquire("gpu", 1, lease_seconds=600)
        once = await rs._call(p.OnceAcquire(scope_id=run.id, key="o", lease_ms=600_000), p.OnceView)
        await run.cancel()
        for renew in (lease.renew(), grant.renew()):
            with pytest.raises(ScopeCancelledError):
                await renew
        await trio.sleep(RETAIN + 5)
        await _purged(run.status())
        assert (await rs.claims.status("report")).state == "HELD"  # a live lease: kept
        await _refused_as_purged(rs._call(p.ClaimRenew(key="report", token=lease.token, lease_ms=30_000),
                                          t._ClaimLeaseReply))
        await _refused_as_purged(rs._call(p.ClaimComplete(key="report", token=lease.token), t.ClaimInfo))
        await _refused_as_purged(rs._call(p.GrantRenew(grant_id=grant.id, token=grant.token, lease_ms=30_000),
                                          t.GrantInfo))
        await _purged(rs._call(p.OnceRenew(scope_id=run.id, key="o", token=once.token, lease_ms=30_000),
                               p.OnceView))  # (routed by its run: NOT_FOUND, purged)
        st = await rs.claims.status("report")
        assert (st.state, st.result) == ("HELD", None)  # never COMPLETED from a cancelled run
        assert (await lease.release()).state == "FREE"  # release stays allowed
        assert (await grant.release()).state == "RELEASED"


def test_a_purged_run_stays_ended_across_a_sigkill(tmp_path):
    """The same refusals from a daemon restarted by SIGKILL after the purge: the
    journal's Purged record replays, and the missing run is ended there too."""
    import signal

    from conftest import Daemon

    data = str(tmp_path / "data")
    args = (data, "fsync", ["--retain-finished", "1s"])

    async def before(url):
        async with rallypoint.connect(url) as rs:
            run = await rs.scopes.create(name="doomed")
            lease = await run.claims.acquire("k9", lease_seconds=600)
            await rs.pools.ensure("k9-pool", 1)
            grant = await run.pools.acquire("k9-pool", 1, lease_seconds=600)
            await run.cancel()
            with trio.fail_after(30):
                while True:  # until the retention tick purged it (ticks every second)
                    try:
                        await run.status()
                    except NotFoundError:
                        break
                    await trio.sleep(0.05)
            return lease.token, grant.id, grant.token

    async def after(url, token, grant_id, grant_token):
        async with rallypoint.connect(url) as rs:
            await _refused_as_purged(rs._call(p.ClaimRenew(key="k9", token=token, lease_ms=30_000),
                                              t._ClaimLeaseReply))
            await _refused_as_purged(rs._call(p.ClaimComplete(key="k9", token=token), t.ClaimInfo))
            await _refused_as_purged(rs._call(p.GrantRenew(grant_id=grant_id, token=grant_token, lease_ms=30_000),
                                              t.GrantInfo))
            assert (await rs.claims.status("k9")).state == "HELD"

    d = Daemon(*args).start()
    try:
        token, grant_id, grant_token = trio.run(before, d.url)
        assert d.stop(signal.SIGKILL) == -signal.SIGKILL
        d = Daemon(*args).start()
        trio.run(after, d.url, token, grant_id, grant_token)
    finally:
        d.kill()
