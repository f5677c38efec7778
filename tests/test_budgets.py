"""Budgets (issue 15 item 4): integer minor units with currency and scale; reserve ->
settle (idempotent per usage key, capped at what is left) or void; settle-by marks a
reservation STALE without refunding it; INSUFFICIENT_BUDGET says what is left; the
cancellation row; reservations held for a delivery (the admission hook)."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
import trio

import rallypoint
from rallypoint import protocol as p
from rallypoint.clock import ms_to_datetime
from rallypoint.errors import (
    ConflictError,
    DeadlineExceededError,
    InsufficientBudgetError,
    LeaseLostError,
    NotFoundError,
    ScopeCancelledError,
    ValidationError,
)
from rallypoint.records import TaskDelivered
from rallypoint.service import Session


def coord(rs):
    return rs.node.coordinator


def now(rs):
    return ms_to_datetime(coord(rs).now_ms())


async def test_money_is_integer_minor_units():
    assert rallypoint.minor_units("5.00", 2) == 500
    assert rallypoint.minor_units("0.25", 2) == 25
    assert rallypoint.minor_units("7", 2) == 700 and rallypoint.minor_units(7, 2) == 700
    assert rallypoint.minor_units("1.50000", 2) == 150  # trailing zeros ignored
    assert rallypoint.minor_units(Decimal("0.1"), 3) == 100
    assert rallypoint.minor_units("12", 0) == 12
    for bad, scale in (("0.255", 2), (0.25, 2), ("-1", 2), ("1e3", 2), (".5", 2), ("1,000", 2), ("1.5", 0)):
        with pytest.raises(ValidationError):
            rallypoint.minor_units(bad, scale)
    assert rallypoint.format_minor(500, 2) == "5.00" and rallypoint.format_minor(5, 3) == "0.005"
    assert rallypoint.format_minor(12, 0) == "12"


async def test_ensure_validates_and_conflicts(ers):
    b = await ers.budgets.ensure("llm", limit=500, currency="EUR", scale=2)
    st = await b.status()
    assert (st.limit_minor, st.currency, st.scale, st.available_minor) == (500, "EUR", 2, 500)
    again = await ers.budgets.ensure("llm", limit=500, currency="EUR", scale=2)
    assert again.info.id == st.id
    for kw, field in (({"limit": 600, "currency": "EUR"}, "limit_minor"), ({"limit": 500, "currency": "USD"}, "currency"),
                      ({"limit": 500, "currency": "EUR", "scale": 3}, "scale")):
        with pytest.raises(ConflictError) as ei:
            await ers.budgets.ensure("llm", **kw)
        assert ei.value.details["field"] == field
    for kw in ({"limit": 0}, {"limit": 5, "currency": "usd"}, {"limit": 5, "scale": 10}, {"limit": 10**19}):
        with pytest.raises(ValidationError):
            await ers.budgets.ensure("bad", **kw)
    with pytest.raises(ValidationError) as ei:
        await ers.budgets.ensure("bad", limit=5.0)  # never floats
    assert "minor units" in ei.value.message
    with pytest.raises(NotFoundError):
        await ers.budget("missing").status()
    assert [x.name for x in await ers.budgets.list()] == ["llm"]


async def test_reserve_until_insufficient_which_says_what_is_left(ers):
    run = await ers.scopes.create()
    b = await ers.budgets.ensure("b", limit=1000)
    r1 = await b.reserve(600, scope=run, holder="agent-1")
    assert (r1.info.state, r1.info.remaining_minor, r1.info.holder) == ("ACTIVE", 600, "agent-1")
    with pytest.raises(InsufficientBudgetError) as ei:
        await b.reserve(401, scope=run)
    e = ei.value
    assert e.code == "INSUFFICIENT_BUDGET"
    assert e.details["available_minor"] == 400 and e.details["requested_minor"] == 401
    assert e.details["reserved_minor"] == 600 and e.details["currency"] == "USD" and e.details["scale"] == 2
    assert "4.00 USD left" in e.message
    r2 = await b.reserve(400, scope=run)  # exactly what is left fits
    st = await b.status(reservations=True)
    assert (st.reserved_minor, st.available_minor, st.open_reservations) == (1000, 0, 2)
    assert [r.id for r in st.reservations] == [r1.id, r2.id]
    with pytest.raises(ValidationError):
        await b.reserve(0, scope=run)
    with pytest.raises(ValidationError):
        await b.reserve(1.5, scope=run)


async def test_settle_charges_the_actual_cost_and_releases_the_rest(ers):
    run = await ers.scopes.create()
    b = await ers.budgets.ensure("b", limit=1000)
    r = await b.reserve(300, scope=run)
    s = await r.settle(120)
    assert (s.charged_minor, s.requested_minor, s.replayed, s.available_minor) == (120, 120, False, 880)
    assert (s.reservation.state, s.reservation.remaining_minor, s.reservation.settled_minor) == ("SETTLED", 0, 120)
    st = await b.status()
    assert (st.settled_minor, st.reserved_minor, st.available_minor, st.open_reservations) == (120, 0, 880, 0)


async def test_a_settle_above_the_reservation_is_capped_at_what_is_left(ers):
    run = await ers.scopes.create()
    b = await ers.budgets.ensure("cap", limit=500)
    other = await b.reserve(100, scope=run)  # someone else holds 100
    r = await b.reserve(50, scope=run)
    s = await r.settle(10_000)  # far above the reservation
    assert s.charged_minor == 50 + 350  # its own 50 + the 350 nobody holds
    assert s.reservation.overrun_minor == 10_000 - 400 and s.available_minor == 0
    st = await b.status()
    assert (st.settled_minor, st.reserved_minor, st.overrun_minor) == (400, 100, 9_600)
    assert st.settled_minor + st.reserved_minor == st.limit_minor  # never past the limit
    with pytest.raises(InsufficientBudgetError) as ei:
        await b.reserve(1, scope=run)
    assert ei.value.details["available_minor"] == 0
    s2 = await other.settle(100)  # the other holder's money was kept for it
    assert s2.charged_minor == 100 and (await b.status()).settled_minor == 500


async def test_settle_is_idempotent_per_usage_key(ers):
    run = await ers.scopes.create()
    b = await ers.budgets.ensure("idem", limit=1000)
    r = await b.reserve(300, scope=run)
    first = await r.settle(200, "call-1")
    again = await r.settle(200, "call-1")
    assert again.replayed and (again.charged_minor, again.requested_minor) == (200, 200)
    assert (await b.status()).settled_minor == 200  # charged once
    with pytest.raises(ConflictError) as ei:
        await r.settle(250, "call-1")  # same key, another amount
    assert ei.value.details["requested_minor"] == 200
    r2 = await b.reserve(100, scope=run)
    with pytest.raises(ConflictError):
        await r2.settle(200, "call-1")  # the key is the budget's, not the reservation's
    d1 = await r2.settle(10)  # default key settle:<id> ...
    d2 = await r2.settle(10)  # ... makes a re-sent settle harmless
    assert d2.replayed and d1.charged_minor == d2.charged_minor
    assert (await b.status()).settled_minor == 210
    assert first.reservation.id == r.id


async def test_partial_settlements_then_void_releases_the_rest(ers):
    run = await ers.scopes.create()
    b = await ers.budgets.ensure("partial", limit=1000)
    r = await b.reserve(500, scope=run)
    a = await r.settle(100, "step-1", final=False)
    assert (a.reservation.state, a.reservation.remaining_minor) == ("ACTIVE", 400)
    b2 = await r.settle(150, "step-2", final=False)
    assert (b2.reservation.remaining_minor, b2.reservation.settled_minor) == (250, 250)
    v = await r.void()
    assert (v.state, v.remaining_minor, v.settled_minor, v.close_reason) == ("VOIDED", 0, 250, "voided")
    st = await b.status()
    assert (st.settled_minor, st.reserved_minor, st.available_minor) == (250, 0, 750)
    assert (await r.void()).state == "VOIDED"  # idempotent
    late = await r.settle(900, "late-charge")  # a late charge: capped at what the budget has
    assert late.charged_minor == 750 and late.reservation.state == "VOIDED"
    assert (await b.status()).available_minor == 0
    # a partial settlement that uses up the reservation closes it
    b3 = await ers.budgets.ensure("partial2", limit=100)
    r3 = await b3.reserve(60, scope=run)
    s3 = await r3.settle(60, "all", final=False)
    assert s3.reservation.state == "SETTLED" and (await b3.status()).open_reservations == 0


async def test_void_releases_everything(ers):
    run = await ers.scopes.create()
    b = await ers.budgets.ensure("void", limit=100)
    r = await b.reserve(80, scope=run)
    v = await r.void()
    assert (v.state, v.settled_minor) == ("VOIDED", 0)
    assert (await b.status()).available_minor == 100
    assert (await b.reserve(100, scope=run)).info.state == "ACTIVE"


async def test_settle_by_marks_stale_without_refunding(autojump_clock, ers):
    run = await ers.scopes.create()
    b = await ers.budgets.ensure("stale", limit=1000)
    r = await b.reserve(400, scope=run, settle_within_seconds=60)
    at = await b.reserve(100, scope=run, settle_by=now(ers) + timedelta(seconds=90))
    assert r.info.settle_by == r.info.created_at + timedelta(seconds=60)
    await trio.sleep(59.9)
    assert (await r.status()).state == "ACTIVE"
    await trio.sleep(0.2)
    st = await r.status()
    assert (st.state, st.remaining_minor) == ("STALE", 400)  # marked, never refunded
    assert (await b.status()).available_minor == 500
    await trio.sleep(30)
    assert (await at.status()).state == "STALE"
    with pytest.raises(InsufficientBudgetError):
        await b.reserve(501, scope=run)
    s = await r.settle(300)  # a stale reservation still settles
    assert s.charged_minor == 300 and s.reservation.state == "SETTLED"
    assert (await b.status()).available_minor == 1000 - 300 - 100
    v = await at.void()
    assert v.state == "VOIDED"
    done = await b.reserve(10, scope=run, settle_within_seconds=5)
    await done.settle(10)
    await trio.sleep(10)
    assert (await done.status()).state == "SETTLED"  # settled before its settle-by: never STALE
    with pytest.raises(ValidationError):
        await b.reserve(10, scope=run, settle_by=now(ers) - timedelta(seconds=1))
    with pytest.raises(ValidationError):
        await b.reserve(10, scope=run, settle_by=now(ers) + timedelta(seconds=9), settle_within_seconds=9)


async def test_a_keyed_reserve_is_idempotent(ers):
    run = await ers.scopes.create()
    b = await ers.budgets.ensure("k", limit=100)
    a = await b.reserve(40, scope=run, key="job-1")
    c = await b.reserve(40, scope=run, key="job-1")
    assert a.id == c.id and (await b.status()).reserved_minor == 40
    with pytest.raises(ConflictError):
        await b.reserve(41, scope=run, key="job-1")


# ------------------------------------------------------------------ the cancellation row


async def test_reserve_is_refused_in_an_inactive_run_but_settle_and_void_stay_allowed(autojump_clock, ers):
    b = await ers.budgets.ensure("gate", limit=1000)
    cancelled = await ers.scopes.create()
    below = await (await cancelled.child()).child()
    held = await b.reserve(200, scope=below)
    held2 = await b.reserve(100, scope=below)
    await cancelled.cancel()
    timed = await ers.scopes.create(deadline=now(ers) + timedelta(seconds=5))
    held3 = await b.reserve(50, scope=timed)
    await trio.sleep(5)
    for run, err in ((cancelled, ScopeCancelledError), (below, ScopeCancelledError), (timed, DeadlineExceededError)):
        with pytest.raises(err):
            await b.reserve(1, scope=run)
    # the run's end leaves reservations as they are: money spent must still be recordable
    assert (await held.status()).state == "ACTIVE"
    s = await held.settle(150)
    assert s.charged_minor == 150 and s.reservation.state == "SETTLED"
    assert (await held2.void()).state == "VOIDED"
    assert (await held3.settle(50)).charged_minor == 50
    st = await b.status()
    assert (st.settled_minor, st.reserved_minor, st.available_minor) == (200, 0, 800)
    assert (await held.status()).settled_minor == 150  # readable after the end


# ------------------------------------------------------------------ held for a delivery


async def _leased(rs, run, mbx="work"):
    m = await rs.mailboxes.ensure(mbx, max_attempts=5)
    ticket = await m.submit({"n": 1}, scope=run)
    return m, ticket, await m.receive(run, lease_seconds=30, wait=0)


async def test_a_reservation_held_for_a_delivery_is_settled_in_full_when_the_task_succeeds(ers):
    run = await ers.scopes.create()
    b = await ers.budgets.ensure("d", limit=1000)
    _, ticket, d = await _leased(ers, run)
    r = await b.reserve(300, scope=run, delivery=d)
    assert r.info.task_id == ticket.id
    worker_settled = await b.reserve(200, scope=run, delivery=d)
    await worker_settled.settle(50)  # the worker knew the real cost of this one
    await d.complete({"ok": True})
    st = await r.status()
    assert (st.state, st.settled_minor, st.remaining_minor, st.close_reason) == ("SETTLED", 300, 0, "task_succeeded")
    assert (await worker_settled.status()).settled_minor == 50
    bs = await b.status()
    assert (bs.settled_minor, bs.reserved_minor) == (350, 0)


@pytest.mark.parametrize("end", ["retry", "reject", "cancel", "lease", "run"])
async def test_a_reservation_held_for_a_delivery_is_voided_when_it_ends_otherwise(autojump_clock, ers, end):
    run = await ers.scopes.create()
    b = await ers.budgets.ensure("d", limit=1000)
    m, ticket, d = await _leased(ers, run)
    r = await b.reserve(300, scope=run, delivery=d)
    await r.settle(100, "partial", final=False)
    if end == "retry":
        await d.retry("again")
    elif end == "reject":
        await d.reject("no")
    elif end == "cancel":
        await ticket.cancel()
    elif end == "lease":
        await trio.sleep(31)  # the lease runs out: the task goes back to the queue
    else:
        await run.cancel()
    st = await r.status()
    assert st.state == "VOIDED" and st.remaining_minor == 0 and st.settled_minor == 100
    assert st.close_reason.startswith("delivery_")
    bs = await b.status()
    assert (bs.settled_minor, bs.reserved_minor, bs.available_minor) == (100, 0, 900)
    if end in ("retry", "lease"):  # the next delivery holds nothing of the first one's
        d2 = await m.receive(run, wait=0)
        assert d2.token == d.token + 1
        await d2.complete()
        assert (await r.status()).state == "VOIDED" and (await b.status()).settled_minor == 100


async def test_a_reservation_for_a_delivery_needs_its_live_lease(autojump_clock, ers):
    run = await ers.scopes.create()
    b = await ers.budgets.ensure("d", limit=1000)
    m, ticket, d = await _leased(ers, run)
    await d.retry()
    with pytest.raises(LeaseLostError):
        await b.reserve(10, scope=run, delivery=d)  # the token is no longer the task's
    assert (await b.status()).reserved_minor == 0


async def test_prepare_reservations_is_all_or_nothing_and_commits_with_the_delivery(ers):
    """The admission hook: budget requirements of a task validated all or nothing, then
    taken in ONE commit with the delivery's TaskDelivered; the delivery's end closes
    them."""
    c = coord(ers)
    run = await ers.scopes.create()
    spend = await ers.budgets.ensure("spend", limit=1000)
    gpu = await ers.budgets.ensure("gpu-hours", limit=10, currency="XXX", scale=0)
    m = await ers.mailboxes.ensure("admit")
    ticket = await m.submit({"job": 1}, scope=run)
    budgets = c.budgets
    with pytest.raises(InsufficientBudgetError) as ei:  # gpu-hours cannot hold 11: nothing is taken
        budgets.prepare_reservations("default", run.id, [("spend", 500), ("gpu-hours", 6), ("gpu-hours", 5)])
    assert ei.value.details["budget"] == "gpu-hours" and ei.value.details["requested_minor"] == 11
    assert (await spend.status()).reserved_minor == 0
    t = c.queues.tasks[ticket.id]
    recs = budgets.prepare_reservations("default", run.id, [("spend", 500), ("gpu-hours", 6)],
                                        task_id=t.id, token=t.token + 1, holder="admission")
    lsn_before = c.journal.last_lsn
    c.commit([TaskDelivered(task_id=t.id, delivery_id=c.ids.new("dlv"), token=t.token + 1,
                            lease_expires_ms=c.mono_ms() + 30_000, at_ms=c.now_ms()), *recs])
    assert c.journal.last_lsn == lsn_before + 1  # one commit
    assert (await spend.status()).reserved_minor == 500 and (await gpu.status()).available_minor == 4
    c.decide(Session(), p.DeliveryComplete(task_id=t.id, token=t.token))
    assert (await spend.status()).settled_minor == 500 and (await gpu.status()).settled_minor == 6
    await run.cancel()
    with pytest.raises(ScopeCancelledError):
        budgets.prepare_reservations("default", run.id, [("spend", 1)])


# ------------------------------------------------------------------ both modes, blocking client


async def test_budget_basics_embedded_and_over_tcp(rs):
    run = await rs.scopes.create()
    name = f"both-{run.id[-6:]}"
    b = await rs.budgets.ensure(name, limit=rallypoint.minor_units("5.00", 2))
    r = await b.reserve(200, scope=run)
    s = await r.settle(900)
    assert s.charged_minor == 500 and s.reservation.overrun_minor == 400
    with pytest.raises(InsufficientBudgetError) as ei:
        await b.reserve(1, scope=run)
    assert ei.value.details["available_minor"] == 0
    assert (await r.settle(900)).replayed


def test_budget_with_the_blocking_client(daemon):
    with rallypoint.sync.connect(daemon.url) as rs:
        run = rs.scopes.create()
        b = rs.budgets.ensure("sync-budget", limit=100)
        r = b.reserve(60, scope=run)
        assert r.settle(20).charged_minor == 20
        assert b.status().available_minor == 80
        assert rs.budget("sync-budget").reservation(r.id).status().state == "SETTLED"


async def test_budget_requirements_implement_the_admission_protocol(ers):
    """The requirement protocol the admission kind calls (``REQUIREMENT_KINDS``):
    prepare at submit, fits/hold all or nothing within one step, records committed with
    the delivery, views for the worker, release when the delivery ends, and receivers
    woken when money comes back."""
    c = coord(ers)
    budgets = c.budgets
    run = await ers.scopes.create()
    spend = await ers.budgets.ensure("spend", limit=500)
    await ers.budgets.ensure("other", limit=100)
    m = await ers.mailboxes.ensure("needs-budget")
    t1 = c.queues.tasks[(await m.submit(1, scope=run)).id]
    t2 = c.queues.tasks[(await m.submit(2, scope=run)).id]
    for bad, err in (({"spend": 1, "other": 1, "x": 1}, ValidationError), ({"nope": 1}, NotFoundError),
                     ({"spend": 501}, ValidationError), ({"spend": 0}, ValidationError), ({"spend": 1.5}, ValidationError)):
        with pytest.raises(err):
            budgets.requirement_prepare("default", bad)
    req = budgets.requirement_prepare("default", {"spend": 300, spend.info.id: 100})
    assert req == {spend.info.id: 400}  # by id, summed
    budgets.requirement_track(t1, req)
    budgets.requirement_track(t2, req)
    pending: dict = {}
    assert budgets.requirement_fits(req, pending)
    budgets.requirement_hold(req, pending)
    assert not budgets.requirement_fits(req, pending)  # a second 400 does not fit on top, in the same step
    recs = budgets.requirement_records(t1, req, c.now_ms())
    c.commit([TaskDelivered(task_id=t1.id, delivery_id=c.ids.new("dlv"), token=t1.token + 1,
                            lease_expires_ms=c.mono_ms() + 30_000, at_ms=c.now_ms()), *recs])
    (rid,) = budgets.requirement_views(t1)["reservations"]
    assert (await spend.status()).available_minor == 100
    assert not budgets.requirement_fits(req, {})  # t2 must wait for the money
    woken = []
    real_notify = c.notify
    c.notify = lambda actor_id, key: (woken.append((actor_id, key)), real_notify(actor_id, key))
    try:
        c.decide(Session(), p.DeliveryReject(task_id=t1.id, token=t1.token))  # t1's delivery ends: voided
    finally:
        c.notify = real_notify
    r = await spend.reservation(rid).status()
    assert (r.state, r.close_reason, r.holder) == ("VOIDED", "delivery_failed", "admission")
    assert (run.id, ("recv", t2.mailbox_id)) in woken  # t2's receivers re-check: its budget came back
    assert budgets.requirement_fits(req, {})
    budgets.requirement_release(t1, req, c.now_ms(), "FAILED")  # a second release changes nothing
    assert (await spend.status()).available_minor == 500
    budgets.requirement_untrack(t1, req)
    budgets.requirement_untrack(t2, req)
    assert budgets.needs == {}


# ------------------------------------------------------------------ keys outlive retention (issue 34 item 6)


async def _until_purged(status) -> None:
    """Wait (server time) until ``status()`` answers NOT_FOUND: retention purged it."""
    for _ in range(600):
        try:
            await status()
        except NotFoundError:
            return
        await trio.sleep(1)
    raise AssertionError("not purged after 600 s of server time")


async def _settled_twice_attempts(b, r_other, run_other):
    """Every way of using the purged reservation's keys again: all CONFLICT."""
    with pytest.raises(ConflictError) as ei:
        await r_other.settle(60, "call-1")  # the usage key, on another reservation
    assert ei.value.details["field"] == "usage_key"
    with pytest.raises(ConflictError):
        await r_other.settle(70, "call-1")  # ... with another amount
    with pytest.raises(ConflictError) as ei:
        await b.reserve(100, scope=run_other, key="res-1")  # the reserve key, in another run
    assert ei.value.details["field"] == "key"


async def test_a_usage_key_is_never_charged_twice_after_its_run_was_purged_nor_after_a_restart(
        tmp_path, autojump_clock):
    """The replayed report: a usage key settled for 60 on one run was refused on another
    while the first run was kept, then charged again once retention purged it (120
    settled). The keys a purged reservation used stay with its budget: in memory, through
    a snapshot and through a journal replay."""
    retain = 60.0
    data = str(tmp_path / "d")
    async with rallypoint.open_embedded(data, retain_finished=retain) as rs:
        b = await rs.budgets.ensure("usage", limit=1000)
        first_run = await rs.scopes.create()
        r1 = await b.reserve(100, scope=first_run, key="res-1")
        assert (await r1.settle(60, "call-1")).charged_minor == 60
        other_run = await rs.scopes.create()
        r2 = await b.reserve(100, scope=other_run)
        await _settled_twice_attempts(b, r2, other_run)  # while the first run is kept
        await first_run.cancel()
        await _settled_twice_attempts(b, r2, other_run)  # ended, not purged yet
        await _until_purged(rs.scope(first_run.id).status)
        with pytest.raises(NotFoundError):
            await r1.status()  # the reservation went with its run ...
        await _settled_twice_attempts(b, r2, other_run)  # ... its keys did not
        assert (await b.status()).settled_minor == 60
        coord = rs.node.coordinator
        assert coord.budgets.statistics()["purged_with_keys"] == 1
        await rs.node.snapshotter.snapshot()  # the kept keys are in the snapshot ...
    async with rallypoint.open_embedded(data, retain_finished=retain) as rs:
        b = await rs.budgets.get("usage")
        r2, other_run = b.reservation(r2.id), rs.scope(other_run.id)
        await _settled_twice_attempts(b, r2, other_run)
        # ... and a purge after the last snapshot replays to the same: a second run purged
        third = await rs.scopes.create()
        r3 = await b.reserve(10, scope=third)
        await r3.settle(5, "call-3")
        await third.cancel()
        await _until_purged(r3.status)

        async def no_snapshot():
            return None

        rs.node.snapshotter.snapshot = no_snapshot  # no clean-shutdown snapshot: replay the Purged record
    async with rallypoint.open_embedded(data, retain_finished=retain) as rs:
        assert rs.node.recovery_info["replayed"] > 0
        b = await rs.budgets.get("usage")
        r2 = b.reservation(r2.id)
        await _settled_twice_attempts(b, r2, rs.scope(other_run.id))
        with pytest.raises(ConflictError):
            await r2.settle(5, "call-3")
        assert (await b.status()).settled_minor == 65
        assert (await r2.settle(40, "call-new")).charged_minor == 40  # a new key still charges


async def test_a_usage_key_stays_spent_across_a_purge_and_a_sigkill(tmp_path):
    """The kill -9 form: a real daemon purges the first run (``--retain-finished 1s``),
    is killed, restarts on its data dir; the usage key is still refused on another run."""
    import signal
    import socket

    from conftest import Daemon

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = (str(tmp_path / "data"), "fsync", ["--listen", f"127.0.0.1:{port}", "--retain-finished", "1s"])
    d = Daemon(*args).start()
    try:
        async with rallypoint.connect(d.url) as rs:
            b = await rs.budgets.ensure("usage-kill", limit=1000)
            first_run = await rs.scopes.create()
            r1 = await b.reserve(100, scope=first_run, key="res-1")
            await r1.settle(60, "call-1")
            other_run = await rs.scopes.create()
            r2 = await b.reserve(100, scope=other_run)
            await first_run.cancel()
            with trio.fail_after(30):
                while True:  # until retention purged it (a tick every second)
                    try:
                        await r1.status()
                    except NotFoundError:
                        break
                    await trio.sleep(0.2)
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        d = Daemon(*args).start()
        async with rallypoint.connect(d.url) as rs:
            b = await rs.budgets.get("usage-kill")
            await _settled_twice_attempts(b, b.reservation(r2.id), rs.scope(other_run.id))
            assert (await b.status()).settled_minor == 60
    finally:
        d.kill()
