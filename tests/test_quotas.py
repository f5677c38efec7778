"""Quotas (allowances, issue 15 item 3): fixed windows aligned to their length, takes,
durable FIFO waiters with a TTL served by the quota's actor when the window rolls, the
consumption id of a grant (units never taken twice), cooldowns, the cancellation row.
Time-dependent tests run embedded under MockClock (autojump)."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

import pytest
import trio

import rallypoint
from rallypoint import protocol as p
from rallypoint.clock import ms_to_datetime
from rallypoint.service import Session
from rallypoint.errors import (
    AllowanceCooldownError,
    AllowanceExhaustedError,
    ConflictError,
    DeadlineExceededError,
    NotFoundError,
    ScopeCancelledError,
    ValidationError,
    WaitTimeout,
)


def coord(rs):
    return rs.node.coordinator


def now(rs) -> datetime:
    return ms_to_datetime(coord(rs).now_ms())


async def sleep_to_window_start(rs, q, offset: float = 0.0) -> None:
    """Sleep to ``offset`` seconds into the next window of ``q``."""
    st = await q.status()
    await trio.sleep((st.window_end - now(rs)).total_seconds() + offset)


async def sleep_to_ms_into_next_window(rs, q, ms: int) -> None:
    """Sleep to exactly ``ms`` of server time into the next window of ``q`` (plus 0.1 ms,
    so the step's server time reads that millisecond, not the one before)."""
    clock = coord(rs).clock
    st = await q.status()
    boundary = clock.wall_to_mono(int(round(st.window_end.timestamp() * 1000)))
    await trio.sleep_until(clock.trio_time_at_mono(boundary + ms) + 0.0001)


async def test_windows_are_fixed_and_aligned_to_their_length(autojump_clock, ers):
    run = await ers.scopes.create()
    q = await ers.quotas.ensure("api", units_limit=3, window_seconds=10)
    st = await q.status()
    mono = coord(ers).mono_ms()
    assert (st.window_end - st.window_start) == timedelta(seconds=10)
    start_ms = int(st.window_start.timestamp() * 1000)
    assert start_ms % 10_000 == 0  # aligned to the window length (server time = wall time here)
    assert start_ms <= coord(ers).clock.mono_to_wall(mono) < start_ms + 10_000
    await sleep_to_window_start(ers, q, 0.5)
    # not a token bucket: the whole limit at once, at the start of a window ...
    grants = [await q.take(scope=run) for _ in range(3)]
    assert [g.remaining for g in grants] == [2, 1, 0]
    assert len({g.consumption_id for g in grants}) == 3 and all(g.state == "GRANTED" for g in grants)
    assert grants[0].window_start == (await q.status()).window_start
    # ... and nothing comes back within the window (no refill), whatever time passes
    await trio.sleep(9.0)
    with pytest.raises(AllowanceExhaustedError) as ei:
        await q.take(scope=run)
    e = ei.value
    assert e.code == "ALLOWANCE_EXHAUSTED" and e.retry_after == pytest.approx(0.5, abs=0.01)
    assert e.details["remaining"] == 0 and e.details["waiting"] == 0 and e.details["units"] == 1
    await trio.sleep(0.5)  # the window rolls: all 3 again
    st = await q.status()
    assert (st.used, st.remaining) == (0, 3)
    assert (await q.take(3, scope=run)).remaining == 0
    assert (await q.status()).consumed_total == 6


async def test_a_take_larger_than_the_limit_is_a_validation_error(ers):
    run = await ers.scopes.create()
    q = await ers.quotas.ensure("small", units_limit=2, window_seconds=60)
    for units in (3, 0):
        with pytest.raises(ValidationError) as ei:
            await q.take(units, scope=run)
        assert ei.value.details["field"] == "units"
    with pytest.raises(ValidationError):
        await q.enqueue(3, scope=run, ttl=10)
    assert (await q.status()).used == 0


async def test_ensure_is_idempotent_and_conflicts_on_other_settings(ers):
    a = await ers.quotas.ensure("q", units_limit=5, window_seconds=60)
    b = await ers.quotas.ensure("q", units_limit=5, window_seconds=60)
    assert a.info.id == b.info.id
    with pytest.raises(ConflictError) as ei:
        await ers.quotas.ensure("q", units_limit=6, window_seconds=60)
    assert ei.value.details == {"field": "units_limit", "existing": 5}
    with pytest.raises(ConflictError):
        await ers.quotas.ensure("q", units_limit=5, window_seconds=30)
    for bad in ({"units_limit": 0, "window_seconds": 60}, {"units_limit": 1, "window_seconds": 0.5},
                {"units_limit": 1, "window_seconds": 86401}):
        with pytest.raises(ValidationError):
            await ers.quotas.ensure("other", **bad)
    with pytest.raises(NotFoundError):
        await ers.quota("missing").status()
    assert [x.name for x in await ers.quotas.list()] == ["q"]
    assert (await ers.quotas.get(a.info.id)).name == "q"  # by id too


async def test_a_waiter_is_granted_by_the_quota_when_the_window_rolls_with_nobody_asking(autojump_clock, ers):
    run = await ers.scopes.create()
    q = await ers.quotas.ensure("roll", units_limit=2, window_seconds=10)
    await q.take(2, scope=run)
    w = await q.enqueue(2, scope=run, ttl=60)
    assert w.info.state == "WAITING" and w.info.consumption_id is None
    st = await q.status()
    assert st.waiting == 1
    await trio.sleep((st.window_end - now(ers)).total_seconds() - 0.01)
    assert (await w.status()).state == "WAITING"
    await trio.sleep(0.02)  # nobody asks: the serve activity at the boundary granted it
    info = await w.status()
    assert info.state == "GRANTED" and info.consumption_id.startswith("qcn_")
    assert info.window_start == st.window_end and info.ended_at == st.window_end
    st2 = await q.status()
    assert (st2.used, st2.waiting, st2.consumed_total) == (2, 0, 4)
    # the grant is not taken twice: reading it again, waiting on it again, changes nothing
    again = await w.wait(timeout=5)
    assert again.consumption_id == info.consumption_id
    assert (await q.status()).used == 2


async def test_take_with_wait_returns_the_grant_and_its_consumption_id(autojump_clock, ers):
    run = await ers.scopes.create()
    q = await ers.quotas.ensure("w", units_limit=1, window_seconds=5)
    await q.take(scope=run)
    t0 = trio.current_time()
    g = await q.take(scope=run, wait=30)
    st = await q.status()
    assert g.state == "GRANTED" and g.waiter_id.startswith("qwt_") and g.consumption_id.startswith("qcn_")
    assert trio.current_time() - t0 <= 5.0 and g.window_start == st.window_start
    assert (st.used, st.consumed_total, st.waiting) == (1, 2, 0)
    w = await q.waiter(g.waiter_id).status()
    assert (w.state, w.consumption_id) == ("GRANTED", g.consumption_id)


async def test_take_with_wait_times_out_cancels_its_waiter_and_takes_nothing(autojump_clock, ers):
    run = await ers.scopes.create()
    q = await ers.quotas.ensure("slow", units_limit=1, window_seconds=3600)
    await sleep_to_window_start(ers, q, 1)
    await q.take(scope=run)
    t0 = trio.current_time()
    with pytest.raises(WaitTimeout):
        await q.take(scope=run, wait=90)  # longer than one server-side wait (60 s)
    assert trio.current_time() - t0 == pytest.approx(90, abs=0.1)
    st = await q.status(waiters=True)
    assert (st.waiting, st.used, st.waiters) == (0, 1, [])
    await trio.sleep(3600)  # the window rolls: nothing is granted to the cancelled waiter
    assert (await q.status()).consumed_total == 1


async def test_a_keyed_take_is_recorded_once_and_returned_again(autojump_clock, ers):
    run = await ers.scopes.create()
    q = await ers.quotas.ensure("keyed", units_limit=5, window_seconds=60)
    c = coord(ers)
    s = Session()
    a = c.decide(s, p.QuotaTake(quota="keyed", scope_id=run.id, units=2, key="job-7"))
    b = c.decide(s, p.QuotaTake(quota="keyed", scope_id=run.id, units=2, key="job-7"))
    assert a.state == b.state == "GRANTED" and a.consumption_id == b.consumption_id and a.waiter_id == b.waiter_id
    assert (await q.status()).used == 2  # taken once
    with pytest.raises(ConflictError):
        c.decide(s, p.QuotaTake(quota="keyed", scope_id=run.id, units=3, key="job-7"))


async def test_direct_takes_never_jump_the_line(autojump_clock, ers):
    run = await ers.scopes.create()
    q = await ers.quotas.ensure("fifo", units_limit=3, window_seconds=10)
    await sleep_to_window_start(ers, q, 0.1)
    await q.take(2, scope=run)
    big = await q.enqueue(3, scope=run, ttl=300)  # 1 unit left: the big one waits
    assert big.info.state == "WAITING"
    with pytest.raises(AllowanceExhaustedError) as ei:
        await q.take(1, scope=run)  # 1 unit is left, but a waiter is ahead
    assert ei.value.details["waiting"] == 1 and ei.value.details["remaining"] == 1
    assert "queued ahead" in ei.value.message
    small = await q.enqueue(1, scope=run, ttl=300)  # a small waiter queues behind, not ahead
    assert small.info.state == "WAITING"
    await sleep_to_window_start(ers, q, 0.1)
    assert (await big.status()).state == "GRANTED"
    assert (await small.status()).state == "WAITING"  # 3 of 3 went to the big one
    await sleep_to_window_start(ers, q, 0.1)
    assert (await small.status()).state == "GRANTED"


async def test_a_large_waiter_is_not_starved_by_a_stream_of_small_takes(autojump_clock, ers):
    run = await ers.scopes.create()
    q = await ers.quotas.ensure("starve", units_limit=4, window_seconds=1)
    await sleep_to_window_start(ers, q, 0.05)
    await q.take(1, scope=run)
    big = await q.enqueue(4, scope=run, ttl=30)
    small_granted_before_big = 0
    for _ in range(40):  # small takers hammer the quota every 50 ms for 2 s
        try:
            await q.take(1, scope=run)
            if (await big.status()).state == "WAITING":
                small_granted_before_big += 1
        except AllowanceExhaustedError:
            pass
        await trio.sleep(0.05)
    info = await big.status()
    assert info.state == "GRANTED" and small_granted_before_big == 0
    assert info.window_start == ms_to_datetime(int(info.created_at.timestamp() * 1000) // 1000 * 1000 + 1000)


async def test_fifo_fairness_with_mixed_sizes(autojump_clock, ers):
    rng = random.Random(7)
    run = await ers.scopes.create()
    limit = 5
    q = await ers.quotas.ensure("mixed", units_limit=limit, window_seconds=2)
    await sleep_to_window_start(ers, q, 0.1)
    await q.take(limit, scope=run)
    waiters = []
    for _ in range(30):
        waiters.append(await q.enqueue(rng.randint(1, limit), scope=run, ttl=600))
    await trio.sleep(120)
    infos = [await w.status() for w in waiters]
    assert all(i.state == "GRANTED" for i in infos)
    windows = [i.window_start for i in infos]
    assert windows == sorted(windows)  # granted in line order
    per_window: dict = {}
    for i in infos:
        per_window[i.window_start] = per_window.get(i.window_start, 0) + i.units
    assert max(per_window.values()) <= limit
    # strict FIFO: each window stops at the first waiter that does not fit
    ordered = sorted(per_window)
    for k, wstart in enumerate(ordered[:-1]):
        first_next = next(i for i in infos if i.window_start == ordered[k + 1])
        assert per_window[wstart] + first_next.units > limit
    assert len({i.consumption_id for i in infos}) == 30
    assert (await q.status()).consumed_total == limit + sum(i.units for i in infos)


async def test_a_waiter_expires_after_its_ttl_and_the_line_moves_up_at_once(autojump_clock, ers):
    run = await ers.scopes.create()
    q = await ers.quotas.ensure("ttl", units_limit=3, window_seconds=3600)
    await sleep_to_window_start(ers, q, 1)
    await q.take(1, scope=run)  # 2 left
    head = await q.enqueue(3, scope=run, ttl=5)  # does not fit: waits, blocking the line
    behind = await q.enqueue(2, scope=run, ttl=600)
    assert behind.info.state == "WAITING"
    await trio.sleep(5.001)
    h = await head.status()
    assert (h.state, h.end_reason, h.consumption_id) == ("EXPIRED", "ttl", None)
    b = await behind.status()  # served in the same step as the expiry, in this window
    assert b.state == "GRANTED" and b.ended_at == h.ended_at
    assert (await q.status()).used == 3


async def test_cancel_a_waiter_serves_the_line_and_a_granted_one_stands(autojump_clock, ers):
    run = await ers.scopes.create()
    q = await ers.quotas.ensure("cancel", units_limit=2, window_seconds=3600)
    await sleep_to_window_start(ers, q, 1)
    await q.take(1, scope=run)
    head = await q.enqueue(2, scope=run, ttl=600)
    behind = await q.enqueue(1, scope=run, ttl=600)
    c = await head.cancel()
    assert (c.state, c.end_reason) == ("CANCELLED", "cancelled")
    assert (await behind.status()).state == "GRANTED"
    again = await behind.cancel()  # granted: the cancel changes nothing
    assert again.state == "GRANTED"
    assert (await q.status()).used == 2
    assert (await head.cancel()).state == "CANCELLED"  # idempotent


async def test_cooldown_refuses_every_run_and_waiters_are_served_when_it_ends(autojump_clock, ers):
    run = await ers.scopes.create()
    other = await ers.scopes.create()
    q = await ers.quotas.ensure("provider", units_limit=10, window_seconds=3600)
    await sleep_to_window_start(ers, q, 1)
    st = await q.cooldown(30, reason="429 from provider")
    assert st.cooldown_reason == "429 from provider" and st.cooldown_until is not None
    for r in (run, other):  # the whole space, not one run
        with pytest.raises(AllowanceCooldownError) as ei:
            await q.take(scope=r)
        assert ei.value.code == "ALLOWANCE_COOLDOWN" and ei.value.retry_after == pytest.approx(30, abs=0.01)
        assert isinstance(ei.value, AllowanceExhaustedError)
    first = await q.enqueue(1, scope=other, ttl=600)  # registering is allowed: it waits
    w = await q.enqueue(4, scope=run, ttl=600)
    assert first.info.state == w.info.state == "WAITING"
    await first.cancel()  # the line moves up, but nothing is granted during the cooldown
    assert (await w.status()).state == "WAITING"
    st5 = await q.cooldown(5, reason="shorter")  # does not shorten the running one, nor change its reason
    assert (st5.cooldown_until, st5.cooldown_reason) == (st.cooldown_until, "429 from provider")
    await trio.sleep(29.9)
    assert (await w.status()).state == "WAITING"
    await trio.sleep(0.2)
    info = await w.status()  # served at the cooldown's end, in the same window
    assert info.state == "GRANTED" and info.ended_at == st.cooldown_until
    assert (await q.take(scope=other)).remaining == 5
    assert (await q.status()).cooldown_until is None


# ------------------------------------------------------------------ the cancellation row


async def test_takes_are_refused_in_an_inactive_run_below_it_and_past_a_deadline(autojump_clock, ers):
    q = await ers.quotas.ensure("gate", units_limit=100, window_seconds=60)
    cancelled = await ers.scopes.create()
    below = await (await cancelled.child()).child()
    await cancelled.cancel()
    timed = await ers.scopes.create(deadline=now(ers) + timedelta(seconds=10))
    await trio.sleep(10)
    for run, err, reason in ((cancelled, ScopeCancelledError, "cancelled"), (below, ScopeCancelledError, "cancelled"),
                             (timed, DeadlineExceededError, "deadline")):
        with pytest.raises(err) as ei:
            await q.take(scope=run)
        assert ei.value.details["reason"] == reason
        with pytest.raises(err):
            await q.enqueue(scope=run, ttl=10)
        with pytest.raises(err):
            await q.take(scope=run, wait=5)
    st = await q.status()
    assert (st.used, st.waiting) == (0, 0)


async def test_a_runs_end_answers_its_waiters_at_once_and_the_line_moves_up(autojump_clock, ers):
    q = await ers.quotas.ensure("cascade", units_limit=2, window_seconds=3600)
    await sleep_to_window_start(ers, q, 1)
    root = await ers.scopes.create()
    doomed = await root.child()
    survivor = await ers.scopes.create()
    await q.take(1, scope=survivor)
    granted_before = await q.take(1, scope=doomed)  # a grant its run's end does not undo
    queued = await q.enqueue(2, scope=doomed, ttl=7200)
    behind = await q.enqueue(1, scope=survivor, ttl=7200)
    got = {}

    async def taker():
        try:
            await q.take(2, scope=doomed, wait=600)
        except ScopeCancelledError as e:
            got["error"], got["at"] = e, trio.current_time()

    async with trio.open_nursery() as n:
        n.start_soon(taker)
        await trio.testing.wait_all_tasks_blocked()
        assert (await q.status()).waiting == 3
        t0 = trio.current_time()
        await root.cancel()  # the doomed run's ancestor
    assert got["at"] == t0  # answered at once, no time passed
    e = got["error"]
    assert e.details["reason"] == "cancelled" and e.details["scope_id"] == root.id and "waiter_id" in e.details
    info = await queued.status()
    assert (info.state, info.end_reason) == ("CANCELLED", "run_cancelled")
    st = await q.status()
    assert st.waiting == 1  # only the survivor's
    assert (await behind.status()).state == "WAITING"  # 2 of 2 used this window: waits for the roll ...
    await sleep_to_window_start(ers, q, 0.001)
    assert (await behind.status()).state == "GRANTED"  # ... and is not blocked by the cancelled head
    assert granted_before.state == "GRANTED"
    assert (await q.status()).consumed_total == 3  # 1 + 1 before, 1 after: the doomed waiters took nothing


async def test_the_head_cancelled_by_its_run_lets_the_next_waiter_in_at_once(autojump_clock, ers):
    q = await ers.quotas.ensure("head", units_limit=3, window_seconds=3600)
    await sleep_to_window_start(ers, q, 1)
    doomed = await ers.scopes.create()
    survivor = await ers.scopes.create()
    await q.take(1, scope=survivor)
    head = await q.enqueue(3, scope=doomed, ttl=600)  # blocks the line (2 left)
    behind = await q.enqueue(2, scope=survivor, ttl=600)
    assert (await behind.status()).state == "WAITING"
    await doomed.cancel()
    assert (await head.status()).end_reason == "run_cancelled"
    info = await behind.status()  # served right after the cancel, in this window
    assert info.state == "GRANTED" and info.window_start == (await q.status()).window_start


async def test_a_deadline_cancels_waiters_with_deadline_exceeded(autojump_clock, ers):
    q = await ers.quotas.ensure("dl", units_limit=1, window_seconds=3600)
    await sleep_to_window_start(ers, q, 1)
    run = await ers.scopes.create(deadline=now(ers) + timedelta(seconds=20))
    await q.take(scope=run)
    with pytest.raises(DeadlineExceededError) as ei:
        await q.take(scope=run, wait=600)
    assert ei.value.details["reason"] == "deadline"
    st = await q.status(waiters=True)
    assert (st.waiting, st.waiters) == (0, [])
    # results stay readable after the run ended
    listed = coord(ers).quotas.waiters
    (wid,) = [k for k, v in listed.items() if v.scope_id == run.id]
    info = await q.waiter(wid).status()
    assert (info.state, info.end_reason) == ("CANCELLED", "deadline")


async def test_waiter_ops_after_the_run_ended(autojump_clock, ers):
    q = await ers.quotas.ensure("after", units_limit=1, window_seconds=3600)
    run = await ers.scopes.create()
    g = await q.take(scope=run, wait=1)
    await run.cancel()
    info = await q.waiter(g.waiter_id).status()  # readable
    assert info.state == "GRANTED" and info.consumption_id == g.consumption_id
    assert (await q.waiter(g.waiter_id).cancel()).state == "GRANTED"  # cancel: allowed, changes nothing
    await q.cooldown(1)  # names no run: allowed whatever the runs do


# ------------------------------------------------------------------ both modes, blocking client


async def test_quota_basics_embedded_and_over_tcp(rs):
    run = await rs.scopes.create()
    name = f"both-{run.id[-6:]}"
    q = await rs.quotas.ensure(name, units_limit=2, window_seconds=3600)
    st = await q.status()
    if (st.window_end - datetime.now(timezone.utc)).total_seconds() < 5:
        await trio.sleep(6)
    g = await q.take(2, scope=run)
    assert g.state == "GRANTED" and g.remaining == 0
    with pytest.raises(AllowanceExhaustedError) as ei:
        await q.take(scope=run)
    assert ei.value.retry_after > 0
    w = await q.enqueue(1, scope=run, ttl=30)
    assert w.info.state == "WAITING" and (await w.cancel()).state == "CANCELLED"
    with pytest.raises(WaitTimeout):
        await q.take(scope=run, wait=0.3)
    st = await q.status()
    assert (st.used, st.waiting) == (2, 0)
    assert name in [x.name for x in await rs.quotas.list()]


def test_quota_with_the_blocking_client(daemon):
    with rallypoint.sync.connect(daemon.url) as rs:
        run = rs.scopes.create()
        q = rs.quotas.ensure("sync-quota", units_limit=5, window_seconds=3600)
        g = q.take(2, scope=run)
        assert g.state == "GRANTED"
        w = q.enqueue(1, scope=run, ttl=10)
        assert w.status().state in ("GRANTED", "WAITING")
        assert q.status().used >= 2


async def test_a_take_at_the_boundary_is_judged_after_the_waiters_are_served(autojump_clock, ers):
    """Judged at request time: a take that arrives after the window rolled finds the
    waiters already served (the due serve fires before its batch), whichever ran
    first."""
    run = await ers.scopes.create()
    q = await ers.quotas.ensure("boundary", units_limit=1, window_seconds=10)
    await sleep_to_window_start(ers, q, 1)
    await q.take(scope=run)
    w = await q.enqueue(scope=run, ttl=60)
    st = await q.status()
    autojump_clock.jump((st.window_end - now(ers)).total_seconds())  # no task has run since
    with pytest.raises(AllowanceExhaustedError):
        await q.take(scope=run)  # the unit of the new window went to the waiter, in line
    assert (await w.status()).state == "GRANTED"


async def test_a_wait_that_ends_exactly_on_the_window_roll_is_granted(autojump_clock, ers):
    """Issue 34 item 7: ``take(wait=retry_after)`` -- the waiter's TTL, the request's
    server-side wait and the window's roll are the same instant. A wait's deadline sees
    what fell due at or before it: the roll grants the waiter before its TTL and the
    request's wait end (they fire after it, whatever the order they were armed in)."""
    run = await ers.scopes.create()
    q = await ers.quotas.ensure("roll", units_limit=1, window_seconds=10)
    await sleep_to_ms_into_next_window(ers, q, 2000)  # retry_after is a whole 8.0 s
    first = await q.take(scope=run)
    with pytest.raises(AllowanceExhaustedError) as ei:
        await q.take(scope=run)
    wait = ei.value.retry_after
    assert wait == 8.0
    t0 = trio.current_time()
    g = await q.take(scope=run, wait=wait)
    assert g.state == "GRANTED" and g.consumption_id != first.consumption_id
    assert trio.current_time() - t0 == pytest.approx(wait, abs=0.01)
    st = await q.status()
    assert (st.used, st.consumed_total, st.waiting) == (1, 2, 0)
    assert st.window_start == g.window_start and g.window_start > first.window_start


async def test_an_enqueued_waiter_whose_ttl_is_the_roll_is_granted(autojump_clock, ers):
    """The same tie without a parked request: the TTL expiry, armed before the serve,
    still fires after it (the heap orders wait ends last at an instant)."""
    run = await ers.scopes.create()
    q = await ers.quotas.ensure("roll-ttl", units_limit=1, window_seconds=10)
    await sleep_to_ms_into_next_window(ers, q, 3000)
    await q.take(scope=run)
    w = await q.enqueue(scope=run, ttl=7)  # expires at the roll
    await trio.sleep(7.5)
    st = await w.status()
    assert (st.state, st.end_reason) == ("GRANTED", None) and st.consumption_id is not None


async def test_quotas_budgets_and_messages_are_per_space():
    """Another space's quota, waiter, budget, reservation or message answers NOT_FOUND,
    by name and by id; the same names are separate entities."""
    from rallypoint.actors import Coordinator

    c = Coordinator()
    a, b = Session(space="a"), Session(space="b")
    run_a = c.decide(a, p.ScopeCreate())
    run_b = c.decide(b, p.ScopeCreate())
    qa = c.decide(a, p.QuotaEnsure(name="shared", units_limit=1, window_ms=3_600_000))
    ba = c.decide(a, p.BudgetEnsure(name="shared", limit_minor=10))
    c.decide(a, p.MailboxEnsure(name="in", mode="INBOX"))
    w = c.decide(a, p.QuotaTake(quota="shared", scope_id=run_a.id, ttl_ms=60_000))
    r = c.decide(a, p.BudgetReserve(budget="shared", scope_id=run_a.id, amount_minor=5))
    m = c.decide(a, p.MessageSend(mailbox="in", scope_id=run_a.id))
    for op in (p.QuotaGet(quota="shared"), p.QuotaGet(quota=qa.id), p.QuotaWaiterWait(waiter_id=w.waiter_id),
               p.QuotaWaiterCancel(waiter_id=w.waiter_id), p.BudgetGet(budget="shared"), p.BudgetGet(budget=ba.id),
               p.ReservationGet(reservation_id=r.id), p.BudgetVoid(reservation_id=r.id),
               p.MessageStatus(message_id=m.id), p.QuotaTake(quota=qa.id, scope_id=run_b.id)):
        with pytest.raises(NotFoundError):
            c.decide(b, op)
    qb = c.decide(b, p.QuotaEnsure(name="shared", units_limit=5, window_ms=60_000))
    assert qb.id != qa.id and [x.name for x in c.decide(b, p.QuotaList()).quotas] == ["shared"]
    assert c.decide(a, p.QuotaGet(quota="shared")).units_limit == 1
