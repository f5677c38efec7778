"""Recovery of quotas, budgets and messages under MockClock (embedded, one Clock shared
by the node before and after the restart): what fell due while the node was down --
window roll-overs, waiter TTLs, settle-by instants -- happens at start-up in due order,
each judged at its own instant; message leases are extended by the downtime. Both a
clean stop (snapshot) and a crash (the journal only) are restarted from."""

from __future__ import annotations

import shutil

import pytest

import rallypoint
from rallypoint.clock import Clock, ms_to_datetime

from test_durability_restart import controlled_time


async def _setup(rs, tc) -> dict:
    """Quota ``q``: 1 unit per 10 s window; 1 taken 1 s into a window, then four waiters
    (TTL 30, 5, 60, 15 s). Budget ``b``: a reservation with a 20 s settle-by and one
    partly settled. INBOX ``in``: a message leased for 30 s and one queued."""
    c = rs.node.coordinator
    run = await rs.scopes.create()
    q = await rs.quotas.ensure("q", units_limit=1, window_seconds=10)
    st = await q.status()
    await tc.advance((st.window_end - ms_to_datetime(c.now_ms())).total_seconds() + 1)
    window0 = (await q.status()).window_start
    await q.take(scope=run)
    w = {}
    for name, ttl in (("long", 30), ("short", 5), ("third", 60), ("fourth", 15)):
        w[name] = (await q.enqueue(scope=run, ttl=ttl)).id
    b = await rs.budgets.ensure("b", limit=1000)
    stale = await b.reserve(300, scope=run, settle_within_seconds=20)
    part = await b.reserve(200, scope=run)
    await part.settle(50, "u1", final=False)
    inbox = await rs.mailboxes.ensure("in", mode="INBOX")
    leased = await inbox.send("leased", scope=run)
    queued = await inbox.send("queued", scope=run)
    d = await inbox.receive(run, lease_seconds=30, wait=0)
    assert d.message_id == leased.id
    return {"run": run.id, "window0": window0, "w": w, "stale": stale.id, "part": part.id, "leased": leased.id,
            "queued": queued.id, "token": d.token}


async def _check(rs, s, tc) -> None:
    from datetime import timedelta

    q = rs.quota("q")
    infos = {k: await q.waiter(wid).status() for k, wid in s["w"].items()}
    w0 = s["window0"]
    ten = timedelta(seconds=10)
    # due order, each judged at its instant: the boundary at +9 s grants "long" (its TTL
    # is later); "short" expired at +5 s before any boundary; "third" gets the next
    # window (+19 s); "fourth" (TTL +15 s) expired before its turn
    def near(a, b) -> bool:  # server time shown as wall time: the restart may shift it by a ms
        return abs((a - b).total_seconds()) <= 0.002

    assert infos["long"].state == "GRANTED"
    assert near(infos["long"].window_start, w0 + ten) and near(infos["long"].ended_at, w0 + ten)
    assert (infos["short"].state, infos["short"].end_reason) == ("EXPIRED", "ttl")
    assert near(infos["short"].ended_at, infos["short"].created_at + timedelta(seconds=5))
    assert infos["third"].state == "GRANTED" and near(infos["third"].window_start, w0 + 2 * ten)
    assert (infos["fourth"].state, infos["fourth"].end_reason) == ("EXPIRED", "ttl")
    assert len({infos["long"].consumption_id, infos["third"].consumption_id}) == 2
    st = await q.status()
    assert (st.consumed_total, st.waiting) == (3, 0)  # 1 + 2 grants: nothing granted twice

    b = rs.budget("b")
    stale = await b.reservation(s["stale"]).status()
    assert (stale.state, stale.remaining_minor) == ("STALE", 300)  # marked at settle-by, not refunded
    part = await b.reservation(s["part"]).status()
    assert (part.state, part.remaining_minor, part.settled_minor) == ("ACTIVE", 150, 50)
    again = await b.reservation(s["part"]).settle(50, "u1", final=False)
    assert again.replayed  # the usage key survived: not charged twice
    bs = await b.status()
    assert (bs.settled_minor, bs.reserved_minor, bs.available_minor) == (50, 450, 500)

    # the message lease was extended by the downtime: still held, and its token settles it
    info = await rs.message(s["leased"]).status()
    assert info.state == "RUNNING"
    assert rs.node.recovery_info["leases_extended_ms"] > 0
    from rallypoint import protocol as p
    from rallypoint.client import types as t

    done = await rs._call(p.DeliveryComplete(task_id=s["leased"], token=s["token"]), t.TaskInfo)
    assert done.state == "ACKED"
    d = await rs.mailbox("in").receive(rs.scope(s["run"]), wait=0)
    assert d.message_id == s["queued"] and d.attempt == 1


async def test_what_fell_due_while_down_happens_at_start_up_in_due_order(tmp_path, autojump_clock):
    d = str(tmp_path / "data")
    clock = Clock()
    async with controlled_time() as tc:
        async with rallypoint.open_embedded(d, durability="fsync", clock=clock) as rs:
            s = await _setup(rs, tc)
        await tc.advance(120)  # down for two minutes: two window boundaries, every TTL
        async with rallypoint.open_embedded(d, durability="fsync", clock=clock) as rs:
            assert rs.node.recovery_info["replayed"] == 0  # from the snapshot
            await tc.advance(0.001)
            await _check(rs, s, tc)


async def test_the_same_after_a_crash(tmp_path, autojump_clock):
    live, crashed = tmp_path / "live", tmp_path / "crashed"
    clock = Clock()
    async with controlled_time() as tc:
        async with rallypoint.open_embedded(str(live), durability="fsync", clock=clock) as rs:
            s = await _setup(rs, tc)
            j = rs.node.coordinator.journal
            await j.wait_durable(j.last_lsn)
            shutil.copytree(live, crashed)  # what a SIGKILL leaves: the journal, no final snapshot
        await tc.advance(120)
        async with rallypoint.open_embedded(str(crashed), durability="fsync", clock=clock) as rs:
            assert rs.node.recovery_info["replayed"] > 0 and rs.node.recovery_info["snapshot_lsn"] == 0
            await tc.advance(0.001)
            await _check(rs, s, tc)


async def test_waiters_resume_on_time_after_a_short_restart(tmp_path, autojump_clock):
    """Down for less than a window: nothing is due at start-up; the waiting waiter is
    granted at the boundary, on time, by the re-armed serve."""
    d = str(tmp_path / "data")
    clock = Clock()
    async with controlled_time() as tc:
        async with rallypoint.open_embedded(d, durability="fsync", clock=clock) as rs:
            run = await rs.scopes.create()
            q = await rs.quotas.ensure("q", units_limit=2, window_seconds=60)
            st = await q.status()
            await tc.advance((st.window_end - ms_to_datetime(rs.node.coordinator.now_ms())).total_seconds() + 1)
            await q.take(2, scope=run)
            wid = (await q.enqueue(2, scope=run, ttl=600)).id
            boundary = (await q.status()).window_end
        await tc.advance(10)
        async with rallypoint.open_embedded(d, durability="fsync", clock=clock) as rs:
            q = rs.quota("q")
            await tc.advance(0.001)
            assert (await q.waiter(wid).status()).state == "WAITING"
            assert (await q.status()).used == 2  # the window's used units survived
            with pytest.raises(rallypoint.AllowanceExhaustedError):
                await q.take(scope=rs.scope(run.id))
            left = (boundary - ms_to_datetime(rs.node.coordinator.now_ms())).total_seconds()
            await tc.advance(left - 0.01)
            assert (await q.waiter(wid).status()).state == "WAITING"
            await tc.advance(0.02)
            info = await q.waiter(wid).status()
            assert info.state == "GRANTED" and abs((info.window_start - boundary).total_seconds()) <= 0.002


async def test_replaying_the_journal_rebuilds_the_same_state(tmp_path, autojump_clock):
    """Random quota, budget and message traffic (takes, waiters, cancels, cooldowns, a
    run's end, reservations, settlements, voids, delivery-bound ones, sends, receives,
    retries) then a crash copy: the state recovered from the journal alone equals the
    live state, entity by entity (every apply is deterministic, no clock reads)."""
    import random

    import msgspec

    rng = random.Random(11)
    live, crashed = tmp_path / "live", tmp_path / "crashed"
    clock = Clock()
    enc = msgspec.msgpack.Encoder()
    prefixes = ("quo", "qwt", "bdg", "rsv", "msg", "tsk")

    def tables(c):
        return {pf: {k: enc.encode(v) for k, v in c.entity_tables()[pf][0].items()} for pf in prefixes}

    async with controlled_time() as tc:
        async with rallypoint.open_embedded(str(live), durability="fsync", clock=clock) as rs:
            runs = [await rs.scopes.create() for _ in range(3)]
            q = await rs.quotas.ensure("q", units_limit=4, window_seconds=3)
            b = await rs.budgets.ensure("b", limit=8_000)
            inbox = await rs.mailboxes.ensure("in", mode="INBOX", max_attempts=3)
            waiters, holds, deliveries = [], [], []
            for step in range(300):
                run = rng.choice(runs[:2]) if step < 200 else runs[1]
                x = rng.random()
                try:
                    if x < 0.2:
                        await q.take(rng.randint(1, 2), scope=run)
                    elif x < 0.3:
                        waiters.append(await q.enqueue(rng.randint(1, 4), scope=run, ttl=rng.choice([1, 5, 30])))
                    elif x < 0.35 and waiters:
                        await rng.choice(waiters).cancel()
                    elif x < 0.37:
                        await q.cooldown(rng.choice([0.5, 2]))
                    elif x < 0.5:
                        holds.append(await b.reserve(rng.randint(1, 200), scope=run,
                                                     settle_within_seconds=rng.choice([None, 1, 60])))
                    elif x < 0.6 and holds:
                        await rng.choice(holds).settle(rng.randint(0, 300), f"u{rng.randint(0, 40)}",
                                                       final=rng.random() < 0.5)
                    elif x < 0.65 and holds:
                        await rng.choice(holds).void()
                    elif x < 0.8:
                        await inbox.send({"n": step}, scope=run, key=rng.choice([None, f"k{rng.randint(0, 20)}"]))
                    elif x < 0.9:
                        d = await inbox.receive(run, lease_seconds=5, wait=0)
                        if d is not None:
                            deliveries.append(d)
                            if rng.random() < 0.5:
                                await b.reserve(rng.randint(1, 50), scope=run, delivery=d)
                    elif deliveries:
                        d = deliveries.pop(rng.randrange(len(deliveries)))
                        await rng.choice([d.complete, d.retry, d.reject])()
                except rallypoint.RallypointError:
                    pass
                if step == 200:
                    await runs[0].cancel()
                await tc.advance(rng.choice([0, 0, 0.05, 0.2, 0.5]))  # ~45 s in all: no periodic snapshot
            c = rs.node.coordinator
            j = c.journal
            await j.wait_durable(j.last_lsn)
            want = tables(c)
            shutil.copytree(live, crashed)
        async with rallypoint.open_embedded(str(crashed), durability="fsync", clock=clock) as rs:
            info = rs.node.recovery_info
            assert info["replayed"] > 200 and info["snapshot_lsn"] == 0
            c2 = rs.node.coordinator
            for t in c2.queues.tasks.values():  # recovery gave held leases the downtime back, by design
                if t.state == "RUNNING":
                    t.lease_expires_ms -= info["leases_extended_ms"]
            got = tables(c2)
    for pf in prefixes:
        assert got[pf].keys() == want[pf].keys(), pf
        diff = [k for k in want[pf] if got[pf][k] != want[pf][k]]
        def delta(k):
            a, b_ = msgspec.msgpack.decode(want[pf][k]), msgspec.msgpack.decode(got[pf][k])
            return {f: (a.get(f), b_.get(f)) for f in set(a) | set(b_) if a.get(f) != b_.get(f)}

        assert not diff, (pf, [delta(k) for k in diff[:3]])
    assert len(want["qwt"]) > 10 and len(want["rsv"]) > 10 and len(want["msg"]) > 10
    states = {pf: {msgspec.msgpack.decode(v)["state"] if "state" in msgspec.msgpack.decode(v) else "-"
                   for v in want[pf].values()} for pf in ("qwt", "rsv", "msg")}
    assert states["qwt"] >= {"GRANTED", "EXPIRED", "CANCELLED"}, states
    assert states["rsv"] >= {"STALE", "SETTLED", "VOIDED"} and states["msg"] >= {"ACKED", "FAILED", "CANCELLED"}, states
