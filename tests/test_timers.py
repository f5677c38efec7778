"""Durable timers (SPEC §7): fire on the server at the right instant (MockClock), ack,
cancel, run cancellation, validation; a timer due while the daemon was down fires at
start-up."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest
import trio

import rallypoint
from rallypoint.errors import ConflictError, ScopeCancelledError, TimerCancelledError, ValidationError, WaitTimeout

from conftest import Daemon



def in_(seconds: float) -> datetime:
    return datetime.now(timezone.utc) + timedelta(seconds=seconds)


async def test_hour_long_timer_fires_at_its_instant_without_a_waiter(autojump_clock, ers):
    run = await ers.scopes.create()
    tm = await run.timers.create(after_seconds=3600)
    st = await tm.status()
    assert tm.id.startswith("tmr_") and st.state == "ARMED" and st.fired_at is None
    assert (st.fire_at - st.created_at) == timedelta(seconds=3600)
    await trio.sleep(3599.9)
    assert (await tm.status()).state == "ARMED"
    await trio.sleep(0.2)
    st = await tm.status()  # nobody waited: it fired on the server
    assert st.state == "FIRED"
    assert abs((st.fired_at - st.fire_at).total_seconds()) <= 0.001
    fired_at = await tm.wait()  # waits for nothing, acknowledges
    assert fired_at == st.fired_at
    st = await tm.status()
    assert st.state == "ACKED" and st.acked_at is not None
    await trio.sleep(5)
    again = await tm.wait(timeout=1)  # a second ack is a no-op
    st2 = await tm.status()
    assert again == fired_at and (st2.state, st2.acked_at) == ("ACKED", st.acked_at)


async def test_wait_blocks_until_the_fire_and_acks(autojump_clock, ers):
    run = await ers.scopes.create()
    # 120 s from the server's instant now (its wall clock runs on the MockClock): the
    # machine's clock has moved on by the real time the test took so far
    now = datetime.fromtimestamp(ers.node.coordinator.clock.now(), timezone.utc)
    tm = await run.timers.create(at=now + timedelta(seconds=120))
    t0 = trio.current_time()
    with pytest.raises(WaitTimeout):
        await tm.wait(timeout=60)
    assert (await tm.status()).state == "ARMED"  # a wait that times out changes nothing
    fired_at = await tm.wait()
    assert trio.current_time() - t0 == pytest.approx(120, abs=0.01)
    st = await run.timers.get(tm.id).status()
    assert (st.state, st.fired_at) == ("ACKED", fired_at)
    assert abs((st.fired_at - st.fire_at).total_seconds()) <= 0.001


async def test_cancel_before_fire(autojump_clock, ers):
    run = await ers.scopes.create()
    tm = await run.timers.create(after_seconds=60)
    st = await tm.cancel()
    assert st.state == "CANCELLED"
    assert (await tm.cancel()).state == "CANCELLED"  # again: no-op
    with pytest.raises(TimerCancelledError) as ei:
        await tm.wait(timeout=5)
    assert ei.value.details["reason"] == "cancelled" and "timer.cancel()" in ei.value.message
    await trio.sleep(120)
    st = await tm.status()
    assert (st.state, st.fired_at) == ("CANCELLED", None)  # never fires


async def test_cancel_wakes_a_waiter_with_timer_cancelled(autojump_clock, ers):
    run = await ers.scopes.create()
    tm = await run.timers.create(after_seconds=60)
    async with trio.open_nursery() as n:

        async def waiter():
            with pytest.raises(TimerCancelledError):
                await tm.wait()

        n.start_soon(waiter)
        await trio.sleep(1)
        await tm.cancel()
    assert trio.current_time() < 30


async def test_cancel_after_fire_is_conflict(autojump_clock, ers):
    run = await ers.scopes.create()
    fired = await run.timers.create(after_seconds=1)
    acked = await run.timers.create(after_seconds=1)
    await trio.sleep(2)
    await acked.wait()
    for tm, state in ((fired, "FIRED"), (acked, "ACKED")):
        with pytest.raises(ConflictError) as ei:
            await tm.cancel()
        assert ei.value.code == "CONFLICT"
        assert (await tm.status()).state == state


async def test_run_cancel_cancels_armed_timers(autojump_clock, ers):
    run = await ers.scopes.create()
    child = await run.child()
    armed = await run.timers.create(after_seconds=100)
    armed_child = await child.timers.create(after_seconds=100)
    fired = await run.timers.create(after_seconds=1)
    await trio.sleep(2)
    async with trio.open_nursery() as n:

        async def waiter():
            # the run's end answers the wait with the timer's cancellation code
            with pytest.raises(TimerCancelledError) as ei:
                await armed.wait()
            assert ei.value.details["reason"] == "run_cancelled", ei.value.details

        n.start_soon(waiter)
        await trio.sleep(1)
        await run.cancel()
    assert (await armed.status()).state == "CANCELLED"
    assert (await armed_child.status()).state == "CANCELLED"
    assert (await fired.status()).state == "FIRED"  # already fired: stays, can be acked
    assert await fired.wait() == (await fired.status()).fired_at
    await trio.sleep(200)
    assert (await armed.status()).fired_at is None
    with pytest.raises(ScopeCancelledError):
        await run.timers.create(after_seconds=1)


async def test_exactly_one_of_at_and_after_seconds(rs):
    run = await rs.scopes.create()
    for kwargs in ({}, {"at": in_(10), "after_seconds": 10}):
        with pytest.raises(ValidationError) as ei:
            await run.timers.create(**kwargs)
        assert ei.value.code == "VALIDATION_FAILED"
    for bad in ({"after_seconds": -1}, {"at": "not a time"}, {"at": datetime(2030, 1, 1)}):
        with pytest.raises(ValidationError):
            await run.timers.create(**bad)


async def test_a_timer_in_the_past_fires_at_once(rs):
    run = await rs.scopes.create()
    tm = await run.timers.create(at=in_(-5))
    with trio.fail_after(5):
        fired_at = await tm.wait()
    assert fired_at >= (await tm.status()).fire_at


def test_timer_due_while_the_daemon_was_down_fires_at_start_up(tmp_path):
    import rallypoint.sync

    data = str(tmp_path / "data")
    d = Daemon(data, "fsync").start()
    try:
        with rallypoint.sync.connect(d.url) as rs:
            run = rs.scopes.create()
            # (2 s: time enough to kill the daemon first on a loaded machine; `later` is
            # due well after the restart, which may take seconds there)
            later = run.timers.create(after_seconds=8.0)
            due = run.timers.create(after_seconds=2.0)
            run_id, due_id, later_id = run.id, due.id, later.id
            due_at = due.fire_at  # (from the create's answer)
        d.kill()  # SIGKILL before it fires
        assert datetime.now(timezone.utc) < due_at, "the daemon was killed after the timer's instant"
        while datetime.now(timezone.utc) < due_at + timedelta(milliseconds=100):  # it falls due while down
            time.sleep(0.05)
        restarted = datetime.now(timezone.utc)
        d = Daemon(data, "fsync").start()
        with rallypoint.sync.connect(d.url) as rs:
            tm = rs.scope(run_id).timers.get(due_id)
            deadline = time.monotonic() + 5
            while (st := tm.status()).state != "FIRED":
                assert time.monotonic() < deadline, st
                time.sleep(0.02)
            assert st.fired_at > st.fire_at and st.fired_at >= restarted - timedelta(milliseconds=50)
            assert tm.wait(timeout=1) == st.fired_at
            lt = rs.scope(run_id).timers.get(later_id)
            lst = lt.status()
            assert lst.state == "ARMED" or lst.fired_at >= lst.fire_at, lst  # re-armed, not fired early
            fired_at = lt.wait(timeout=10)
            st = lt.status()
            assert st.state == "ACKED" and 0 <= (fired_at - st.fire_at).total_seconds() < 0.5
    finally:
        d.kill()
