"""Pools (runstate's permits; SPEC §8, kernel §10; issue 15 item 2): ``units_total``,
leased grants, release, expiry returns units, durable FIFO waiters with no starvation
of a large request by small ones, CAPACITY_UNAVAILABLE when not waiting,
VALIDATION_FAILED for units > total; the cancellation row; leases on server time."""

from __future__ import annotations

import functools
import shutil
from datetime import datetime, timezone

import pytest
import trio

import rallypoint
from rallypoint import protocol as p
from rallypoint.client import types as t
from rallypoint.clock import Clock
from rallypoint.errors import (
    CapacityUnavailableError,
    ConflictError,
    DeadlineExceededError,
    LeaseLostError,
    NotFoundError,
    ScopeCancelledError,
    UnavailableError,
    ValidationError,
    WaitTimeout,
)
from rallypoint.actors.common import MemoryJournal

from test_durability_restart import controlled_time


# ------------------------------------------------------------------ pools and grants


async def test_ensure_get_list(rs):
    pool = await rs.pools.ensure("gpu-a", units_total=4)
    assert pool.info.units_total == 4 and pool.info.units_free == 4
    assert (await rs.pools.ensure("gpu-a", 4)).info.id == pool.info.id  # idempotent
    with pytest.raises(ConflictError) as ei:
        await rs.pools.ensure("gpu-a", 8)
    assert ei.value.details == {"field": "units_total", "existing": 4}
    assert "gpu-a" in [x.name for x in await rs.pools.list()]
    with pytest.raises(NotFoundError):
        await rs.pool("no-such-pool").status()
    for bad in (0, -1, 1_000_001):
        with pytest.raises(ValidationError):
            await rs.pools.ensure("bad", bad)


async def test_acquire_release_and_capacity_unavailable(rs):
    pool = await rs.pools.ensure("acq", 4)
    run = await rs.scopes.create()
    g = await run.pools.acquire("acq", 3, lease_seconds=30, holder="w1")
    assert g.units == 3 and g.token > 0 and g.lease_expires_at is not None
    st = await pool.status()
    assert (st.units_used, st.units_free, st.active_grants) == (3, 1, 1)
    assert st.grants[0].holder == "w1" and st.grants[0].token == 0  # status never shows a token
    with pytest.raises(CapacityUnavailableError) as ei:
        await run.pools.acquire("acq", 2)
    assert ei.value.code == "CAPACITY_UNAVAILABLE" and ei.value.details["units_free"] == 1
    assert await pool.try_acquire(2, scope=run) is None
    one = await pool.acquire(1, scope=run)
    info = await g.release({"used": "3 GPUs"})
    assert info.state == "RELEASED" and info.end_reason == "released"
    assert (await g.release()).state == "RELEASED"  # twice is harmless
    await one.release()
    assert (await pool.status()).units_used == 0


async def test_units_outside_1_to_units_total_are_validation_failed(rs):
    await rs.pools.ensure("small", 2)
    run = await rs.scopes.create()
    with pytest.raises(ValidationError) as ei:
        await run.pools.acquire("small", 3, wait=60)  # could never be granted: not queued
    assert "exceeds" in ei.value.message and ei.value.details["units_total"] == 2
    with pytest.raises(ValidationError):
        await run.pools.acquire("small", 0)
    assert (await rs.pool("small").status()).waiting == 0


async def test_renew_and_stale_tokens(rs):
    await rs.pools.ensure("renew", 1)
    run = await rs.scopes.create()
    g = await run.pools.acquire("renew", 1, lease_seconds=10)
    before = g.lease_expires_at
    assert await g.renew(60) > before
    with pytest.raises(LeaseLostError) as ei:
        await rs._call(p.GrantRenew(grant_id=g.id, token=g.token + 1), t.GrantInfo)
    assert ei.value.code == "STALE_CLAIM"
    with pytest.raises(LeaseLostError):
        await rs._call(p.GrantRelease(grant_id=g.id, token=g.token + 1), t.GrantInfo)
    await g.release()
    with pytest.raises(LeaseLostError):
        await g.renew()


async def test_a_resent_acquire_with_the_same_request_id_returns_the_same_grant(rs):
    await rs.pools.ensure("dedup", 2)
    run = await rs.scopes.create()
    op = p.PoolAcquire(pool="dedup", scope_id=run.id, units=2, request_id="r-1")
    a = await rs._call(op, t._PoolAcquireReply)
    b = await rs._call(op, t._PoolAcquireReply)
    assert a.grant.id == b.grant.id and a.grant.token == b.grant.token
    assert (await rs.pool("dedup").status()).units_used == 2  # granted once


# ------------------------------------------------------------------ time


async def test_an_expired_grant_returns_its_units_to_the_first_waiter(autojump_clock, ers):
    pool = await ers.pools.ensure("exp", 2)
    run = await ers.scopes.create()
    g = await run.pools.acquire("exp", 2, lease_seconds=5)  # its holder dies: never renewed
    t0 = trio.current_time()
    waiter = await run.pools.acquire("exp", 2, wait=60)
    assert 4.9 <= trio.current_time() - t0 <= 5.1
    assert (await g.status()).state == "EXPIRED"
    with pytest.raises(LeaseLostError):
        await g.renew()
    with pytest.raises(LeaseLostError):
        await ers._call(p.GrantRelease(grant_id=g.id, token=g.token), t.GrantInfo)
    assert (await pool.status()).units_used == 2 and waiter.units == 2


async def test_a_waiter_whose_time_ends_as_a_grant_runs_out_gets_the_units(autojump_clock, ers):
    """Issue 34 item 7, for pools: the grant's expiry and the waiter's time limit (and its
    request's wait) are one instant; the units coming back fall due at it, so the waiter
    is granted them, not told TIMEOUT."""
    pool = await ers.pools.ensure("tie", 1)
    run = await ers.scopes.create()
    await run.pools.acquire("tie", 1, lease_seconds=30)
    t0 = trio.current_time()
    got = await ers._call(p.PoolAcquire(pool="tie", scope_id=run.id, units=1, lease_ms=30_000, wait_ms=30_000,
                                        request_id="tie-waiter"), t._PoolAcquireReply)
    assert got.status == "ACQUIRED" and got.grant.units == 1 and got.request_id == "tie-waiter"
    assert trio.current_time() - t0 == pytest.approx(30, abs=0.01)
    st = await pool.status()
    assert (st.units_used, st.waiting) == (1, 0)


async def test_a_lease_is_judged_at_request_time(autojump_clock, ers):
    await ers.pools.ensure("rt", 1)
    run = await ers.scopes.create()
    g = await run.pools.acquire("rt", 1, lease_seconds=5)
    await trio.sleep(4)
    autojump_clock.jump(1.5)  # past the expiry, no task ran since (and no stall: < 2 s)
    with pytest.raises(LeaseLostError):
        await g.renew()
    assert (await ers.pool("rt").status()).units_used == 0


async def test_hold_keeps_the_grant_alive_and_releases_it(autojump_clock, ers):
    pool = await ers.pools.ensure("hold", 1)
    run = await ers.scopes.create()
    async with pool.hold(1, scope=run, lease_seconds=6) as g:
        await trio.sleep(120)
        assert (await g.status()).state == "ACTIVE"
    assert (await g.status()).state == "RELEASED"


# ------------------------------------------------------------------ FIFO, no starvation


async def test_a_large_request_is_not_starved_by_a_stream_of_small_ones(autojump_clock, ers):
    """Pool of 4, 3 held. A request for 4 waits; then small 1-unit requests keep
    coming: none is granted before the large one (no barging, even though 1 unit is
    free), they queue behind it, and the large one is served as soon as 4 are free."""
    pool = await ers.pools.ensure("fair", 4)
    run = await ers.scopes.create()
    held = [await pool.acquire(1, scope=run, lease_seconds=600) for _ in range(3)]
    order: list[str] = []
    grant_ids: dict[str, str] = {}

    async def want(name, units):
        g = await pool.acquire(units, scope=run, wait=3600, lease_seconds=600)
        order.append(name)
        grant_ids[name] = g.id  # ids are made in grant order
        await trio.sleep(10)
        await g.release()

    async with trio.open_nursery() as n:
        n.start_soon(want, "big", 4)
        await trio.sleep(1)
        for i in range(5):
            with pytest.raises(CapacityUnavailableError) as ei:  # 1 unit free, but someone waits
                await pool.acquire(1, scope=run)
            assert "in line first" in ei.value.message
            n.start_soon(want, f"small-{i}", 1)
            await trio.sleep(1)
            await held[0].renew(600)  # the holders stay
        st = await pool.status()
        assert [w.units for w in st.waiters] == [4, 1, 1, 1, 1, 1] and st.units_free == 1
        assert order == []
        for g in held:
            await g.release()
            await trio.sleep(0.1)
        await trio.sleep(0.1)
        assert order == ["big"]  # served first, alone
    assert sorted(grant_ids, key=grant_ids.get) == ["big", "small-0", "small-1", "small-2", "small-3", "small-4"]
    assert order[0] == "big"


async def test_waiters_behind_the_head_are_served_in_order_as_units_come_back(autojump_clock, ers):
    pool = await ers.pools.ensure("order", 3)
    run = await ers.scopes.create()
    g = await pool.acquire(3, scope=run, lease_seconds=600)
    got: list[tuple[str, int]] = []

    async def want(name, units):
        gr = await pool.acquire(units, scope=run, wait=600, lease_seconds=600)
        got.append((name, units))
        await trio.sleep(100)
        await gr.release()

    async with trio.open_nursery() as n:
        for name, units in (("a", 1), ("b", 2), ("c", 1)):
            n.start_soon(want, name, units)
            await trio.sleep(0.1)
        await g.release()
        await trio.sleep(1)
        assert sorted(got) == [("a", 1), ("b", 2)]  # a and b fit together; c (1) waits behind b
        assert (await pool.status()).units_free == 0
    assert got[2] == ("c", 1)


async def test_a_waiter_out_of_time_leaves_the_queue_and_unblocks_those_behind(autojump_clock, ers):
    pool = await ers.pools.ensure("ttl", 2)
    run = await ers.scopes.create()
    g = await pool.acquire(1, scope=run, lease_seconds=600)
    small = []

    async def small_waiter():
        small.append(await pool.acquire(1, scope=run, wait=600))

    async with trio.open_nursery() as n:
        async def big():
            with pytest.raises(WaitTimeout):
                await pool.acquire(2, scope=run, wait=30)
        n.start_soon(big)
        await trio.sleep(1)
        n.start_soon(small_waiter)  # 1 unit is free, but big waits first
        await trio.sleep(1)
        assert not small
        await trio.sleep(30)
        assert len(small) == 1  # big gave up at t=30: small was served in the same step
    assert (await pool.status()).waiting == 0
    await g.release()


async def test_a_cancelled_acquire_withdraws_its_waiter(autojump_clock, ers):
    pool = await ers.pools.ensure("wd", 1)
    run = await ers.scopes.create()
    g = await pool.acquire(1, scope=run, lease_seconds=600)
    with trio.move_on_after(5):
        await pool.acquire(1, scope=run, wait=600)
    assert (await pool.status()).waiting == 0
    await g.release()
    assert (await pool.status()).units_used == 0  # nobody was given units no one holds


# ------------------------------------------------------------------ cancellation row


async def test_cancellation_row(autojump_clock, ers):
    """Pool waiters live in the pool's actor (root nursery), not under their run: the
    run's end answers them explicitly, at once, and serves those behind. Acquires are
    refused, renewals refused, release allowed, grants readable."""
    pool = await ers.pools.ensure("cancel", 2)
    doomed = await ers.scopes.create(name="doomed")
    child = await doomed.child()
    alive = await ers.scopes.create(name="alive")
    g = await pool.acquire(2, scope=doomed, lease_seconds=600)
    answers: dict[str, object] = {}

    async def want(run, name, units):
        try:
            if name == "alive-small":
                answers[name] = await pool.acquire(units, scope=run, wait=600, lease_seconds=600)
            else:  # the raw request: its first answer, with no SDK re-send or withdrawal
                answers[name] = await ers._call(p.PoolAcquire(pool="cancel", scope_id=run.id, units=units,
                                                              wait_ms=600_000, request_id=name), t._PoolAcquireReply)
        except Exception as e:  # noqa: BLE001
            answers[name] = e

    async with trio.open_nursery() as n:
        n.start_soon(want, doomed, "doomed-big", 2)
        await trio.sleep(0.1)
        n.start_soon(want, child, "child-small", 1)
        await trio.sleep(0.1)
        n.start_soon(want, alive, "alive-small", 1)
        await trio.sleep(0.1)
        assert [w.units for w in (await pool.status()).waiters] == [2, 1, 1]
        t0 = trio.current_time()
        await doomed.cancel()
        for _ in range(1000):
            if len(answers) >= 2:
                break
            await trio.sleep(0)
        assert len(answers) == 2 and trio.current_time() == t0  # at once
        assert isinstance(answers["doomed-big"], ScopeCancelledError)
        assert isinstance(answers["child-small"], ScopeCancelledError)
        st = await pool.status()
        assert [w.scope_id for w in st.waiters] == [alive.id]  # only the active run's waiter is left
        with pytest.raises(ScopeCancelledError):
            await pool.acquire(1, scope=doomed)
        with pytest.raises(ScopeCancelledError):
            await g.renew()
        assert g.lost
        info = await g.release()  # release stays allowed: the active run's waiter gets a unit
        assert info.state == "RELEASED"
    got = answers["alive-small"]
    assert got.units == 1 and (await got.status()).scope_id == alive.id
    assert (await g.status()).end_reason == "released"  # readable afterwards


async def test_a_waiter_whose_run_passes_its_deadline_gets_deadline_exceeded(autojump_clock, ers):
    clock = ers.node.coordinator.clock
    pool = await ers.pools.ensure("dl", 1)
    holder_run = await ers.scopes.create()
    g = await pool.acquire(1, scope=holder_run, lease_seconds=600)
    run = await ers.scopes.create(deadline=datetime.fromtimestamp(clock.now() + 10, tz=timezone.utc))
    t0 = trio.current_time()
    with pytest.raises(DeadlineExceededError):
        await pool.acquire(1, scope=run, wait=600)
    assert 9.9 <= trio.current_time() - t0 <= 10.1
    assert (await pool.status()).waiting == 0
    with pytest.raises(DeadlineExceededError):
        await pool.acquire(1, scope=run)
    await g.release()


# ------------------------------------------------------------------ restarts


@pytest.mark.parametrize("crash", [False, True], ids=["clean", "crash"])
async def test_grants_and_the_queue_survive_a_restart(tmp_path, autojump_clock, crash):
    live, crashed = tmp_path / "live", tmp_path / "crashed"
    clock = Clock()
    async with controlled_time() as tc:
        async with rallypoint.open_embedded(str(live), durability="fsync", clock=clock) as rs:
            run = await rs.scopes.create()
            pool = await rs.pools.ensure("gpu", 3)
            g2 = await pool.acquire(2, scope=run, lease_seconds=30)
            g1 = await pool.acquire(1, scope=run, lease_seconds=30)
            async with trio.open_nursery() as n:  # two queued waiters whose requests dropped
                for rid, units in (("big", 3), ("small", 1)):
                    n.start_soon(functools.partial(
                        rs._call, p.PoolAcquire(pool="gpu", scope_id=run.id, units=units, wait_ms=3_600_000,
                                                request_id=rid), t._PoolAcquireReply))
                    while len((await pool.status()).waiters) < (1 if rid == "big" else 2):
                        await trio.sleep(0)
                n.cancel_scope.cancel()
            if crash:
                j = rs.node.coordinator.journal
                await j.wait_durable(j.last_lsn)
                shutil.copytree(live, crashed)
        await tc.advance(120)  # down longer than the leases: they get the downtime back
        async with rallypoint.open_embedded(str(crashed if crash else live), durability="fsync", clock=clock) as rs:
            pool = rs.pool("gpu")
            st = await pool.status()
            assert (st.units_used, [w.units for w in st.waiters]) == (3, [3, 1])
            await rs._call(p.GrantRenew(grant_id=g1.id, token=g1.token, lease_ms=30_000), t.GrantInfo)
            await rs._call(p.GrantRelease(grant_id=g1.id, token=g1.token), t.GrantInfo)
            st = await pool.status()  # 1 unit free: small must not pass big
            assert (st.units_used, [w.units for w in st.waiters]) == (2, [3, 1])
            await rs._call(p.GrantRelease(grant_id=g2.id, token=g2.token), t.GrantInfo)
            st = await pool.status()
            assert (st.units_used, [w.units for w in st.waiters]) == (3, [1])  # big served, never 4
            big = await rs._call(p.PoolAcquire(pool="gpu", scope_id=run.id, units=3, wait_ms=3_600_000,
                                               request_id="big"), t._PoolAcquireReply)
            assert big.status == "ACQUIRED" and big.grant.units == 3


async def test_a_renewal_sent_in_time_survives_an_event_loop_stall(autojump_clock, ers):
    await ers.pools.ensure("stall", 1)
    run = await ers.scopes.create()
    g = await run.pools.acquire("stall", 1, lease_seconds=5)
    await trio.sleep(1)
    autojump_clock.jump(9)  # a 9 s stall
    await g.renew()
    assert (await g.status()).state == "ACTIVE" and ers.node.coordinator.stalls == 1


async def test_pools_and_grants_are_invisible_across_spaces():
    from rallypoint.actors import Coordinator
    from rallypoint.service import Session

    coord = Coordinator()
    a, b = Session(space="a"), Session(space="b")
    ra = coord.decide(a, p.ScopeCreate()).id
    rb = coord.decide(b, p.ScopeCreate()).id
    coord.decide(a, p.PoolEnsure(name="gpu", units_total=1))
    coord.decide(b, p.PoolEnsure(name="gpu", units_total=5))  # names are per space
    ga = coord.decide(a, p.PoolAcquire(pool="gpu", scope_id=ra)).grant
    assert coord.decide(b, p.PoolAcquire(pool="gpu", scope_id=rb, units=5)).status == "ACQUIRED"
    with pytest.raises(NotFoundError):
        coord.decide(b, p.GrantStatus(grant_id=ga.id))
    with pytest.raises(NotFoundError):
        coord.decide(b, p.GrantRelease(grant_id=ga.id, token=ga.token))
    assert [x.units_total for x in coord.decide(b, p.PoolList()).pools] == [5]


class _RefusingJournal(MemoryJournal):
    """Memory durability whose disk 'fills up' on demand: ``check_writable`` refuses
    (UNAVAILABLE, before anything is applied) once ``refuse_from`` commits were taken."""

    refuse_from: int | None = None

    def check_writable(self) -> None:
        if self.refuse_from is not None and self.last_lsn >= self.refuse_from:
            raise UnavailableError("disk full", retry_after=0.05)


async def test_a_handoff_refused_by_a_full_disk_happens_once_the_journal_takes_it():
    """A release is journaled; the grant (or lease) for the waiter that follows it, in
    the next commit, is refused (disk full): it is made by an activity as soon as the
    journal takes commits again -- the waiter is not left behind free units."""
    from rallypoint.actors import Coordinator
    from rallypoint.service import Session

    journal = _RefusingJournal()
    coord = Coordinator(journal=journal)
    s = Session()
    run = coord.decide(s, p.ScopeCreate()).id
    coord.decide(s, p.PoolEnsure(name="full", units_total=1))
    g = coord.decide(s, p.PoolAcquire(pool="full", scope_id=run, lease_ms=60_000)).grant
    coord.decide(s, p.PoolAcquire(pool="full", scope_id=run, wait_ms=60_000, request_id="w"))  # parks
    c1 = coord.decide(s, p.ClaimAcquire(scope_id=run, key="k", lease_ms=60_000))
    coord.decide(s, p.ClaimAcquire(scope_id=run, key="k", wait_ms=60_000, request_id="cw"))  # parks
    journal.refuse_from = journal.last_lsn + 1  # the release goes in, the next commit is refused
    assert coord.decide(s, p.GrantRelease(grant_id=g.id, token=g.token)).state == "RELEASED"
    assert coord.pools.table[coord.pools.by_name[("default", "full")]].waiters  # not served yet
    journal.refuse_from = journal.last_lsn + 1
    assert coord.decide(s, p.ClaimRelease(key="k", token=c1.token)).state == "FREE"
    journal.refuse_from = None  # space again
    await trio.sleep(0.1)
    coord.before_batch()
    pool = coord.decide(s, p.PoolGet(name="full"))
    assert (pool.units_used, pool.waiting) == (1, 0) and pool.grants[0].id == coord.pools.by_request[(pool.id, "w")]
    claim = coord.decide(s, p.ClaimStatus(key="k"))
    assert (claim.state, claim.generation, claim.waiters) == ("HELD", 2, [])
