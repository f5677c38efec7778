"""Time, handled exactly (issue "The design card's shape", part Time):

- every time-based state is judged against the clock at request time, not only when
  its activity fires;
- after a restart, what fell due while the daemon was down fires in due order, an
  enclosing run's deadline first;
- ordering never depends on the wall clock (FIFO by sequence; durations on server
  time, which a wall clock set back does not stretch);
- time the server could not hear -- a restart, an event-loop stall -- is given back to
  lease holders.

Virtual time (MockClock) for the embedded cases; a real daemon paused with SIGSTOP for
the stall.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from datetime import datetime, timezone

import pytest
import trio

import rallypoint
from rallypoint.clock import Clock
from rallypoint import protocol as p
from rallypoint.client import types as t
from rallypoint.errors import ChildError, LeaseLostError

from conftest import Daemon
from test_durability_restart import controlled_time


def at(clock: Clock, seconds: float) -> datetime:
    """The wall instant ``seconds`` after now on ``clock``."""
    return datetime.fromtimestamp(clock.now() + seconds, tz=timezone.utc)


# ------------------------------------------------------------------ request time


async def test_a_complete_after_the_tasks_deadline_is_refused_before_its_activity_fires(autojump_clock, ers):
    coord = ers.node.coordinator
    mbx = await ers.mailboxes.ensure("late")
    run = await ers.scopes.create()
    t = await mbx.submit({"x": 1}, scope=run, deadline=at(coord.clock, 10))
    d = await mbx.receive(run, lease_seconds=60, wait=0)
    spare = await mbx.submit({"x": 2}, scope=run, deadline=at(coord.clock, 10))
    autojump_clock.jump(10.5)  # past both deadlines; no task has run since
    with pytest.raises(LeaseLostError) as ei:
        await d.complete({"too": "late"})
    assert "EXPIRED" in ei.value.message
    assert (await t.status()).state == "EXPIRED"
    assert await mbx.receive(run, wait=0) is None  # the expired task is not handed out
    info = await spare.status()
    assert info.state == "EXPIRED" and info.outcome_reason == "deadline"


# ------------------------------------------------------------------ restarts


@pytest.mark.parametrize("crash", [False, True], ids=["clean", "crash"])
async def test_what_fell_due_while_down_fires_in_due_order(tmp_path, autojump_clock, crash):
    """The daemon is stopped from t=0 to t=10 s, then started:

    1. run R (deadline t+3) with timer T (t+5): T ends CANCELLED, never FIRED;
    2. the same with a join-set delay (t+5): the delay ends cancelled;
    3. a join set with a task child (own deadline t+1) and a delay child (t+2): the
       completions are recorded task (expired) first, then the delay;
    4. a task with deadline t+1 in run R2 (deadline t+3): EXPIRED, not CANCELLED.
    """
    live, crashed = tmp_path / "live", tmp_path / "crashed"
    clock = Clock()
    async with controlled_time() as tc:
        async with rallypoint.open_embedded(str(live), durability="fsync", clock=clock) as rs:
            mbx = await rs.mailboxes.ensure("w")
            r1 = await rs.scopes.create(name="r1", deadline=at(clock, 3))
            timer = await r1.timers.create(after_seconds=5)
            js1 = await r1.join_sets.create()
            delay1 = await js1.submit_delay(5)
            plain = await rs.scopes.create(name="plain")
            js3 = await plain.join_sets.create()
            task3 = await js3.submit(mbx, {"n": 3}, deadline=at(clock, 1))
            delay3 = await js3.submit_delay(2)
            r2 = await rs.scopes.create(name="r2", deadline=at(clock, 3))
            task4 = await mbx.submit({"n": 4}, scope=r2, deadline=at(clock, 1))
            if crash:
                j = rs.node.coordinator.journal
                await j.wait_durable(j.last_lsn)
                shutil.copytree(live, crashed)  # what a SIGKILL leaves: the journal, no final snapshot
        await tc.advance(10)  # down from t=0 to t=10
        d = crashed if crash else live
        async with rallypoint.open_embedded(str(d), durability="fsync", clock=clock) as rs:
            if crash:
                assert rs.node.recovery_info["replayed"] > 0
            await tc.advance(0.001)  # one pass of the activity heap
            st = await rs.scope(r1.id).timers.get(timer.id).status()
            assert st.state == "CANCELLED" and st.fired_at is None, st  # 1.
            js1r = rs.scope(r1.id).join_sets.by_id(js1.id)
            with pytest.raises(ChildError) as ei:  # 2.
                await js1r.join_next(index=0)
            assert ei.value.child_id == delay1 and ei.value.failure_kind == "cancelled"
            js3r = rs.scope(plain.id).join_sets.by_id(js3.id)  # 3.
            with pytest.raises(ChildError) as ei:
                await js3r.join_next(timeout=5)
            assert ei.value.child_id == task3 and ei.value.failure_kind == "expired"
            child, value = await js3r.join_next(timeout=5)
            assert child == delay3 and value is None
            info = await rs.task(task4.id).status()  # 4.
            assert info.state == "EXPIRED" and info.outcome_reason == "deadline", info


async def test_a_wall_clock_set_back_does_not_reorder_tasks_or_stretch_durations(tmp_path, autojump_clock):
    """Restarted with the system clock set back an hour: tasks still come out in
    submission order; a 30 s lease whose worker died lasts 30 s; a 60 s timer fires
    after 60 s -- not 3,630 s and 3,660 s."""
    d = str(tmp_path / "data")
    async with controlled_time() as tc:
        clock = Clock()
        async with rallypoint.open_embedded(d, durability="fsync", clock=clock) as rs:
            mbx = await rs.mailboxes.ensure("w")
            run = await rs.scopes.create()
            first = await mbx.submit("first", scope=run)
            second = await mbx.submit("second", scope=run)
            held = await mbx.receive(run, lease_seconds=30, wait=0)  # its worker then dies
            assert held.task_id == first.id
            timer = await run.timers.create(after_seconds=60)
        set_back = Clock(wall_start=time.time() - 3600)  # the system clock, an hour behind
        async with rallypoint.open_embedded(d, durability="fsync", clock=set_back) as rs:
            t0 = trio.current_time()
            mbx, run = rs.mailbox("w"), rs.scope(run.id)
            third = await mbx.submit("third", scope=run)  # its wall-clock id is an hour "older"
            got = [(await mbx.receive(run, wait=0, lease_seconds=600)).task_id for _ in range(2)]
            assert got == [second.id, third.id]  # FIFO by submission
            await tc.advance_to(t0 + 31)
            info = await rs.task(first.id).status()
            assert info.state == "QUEUED" and info.attempt == 2, info  # the 30 s lease lasted 30 s
            await tc.advance_to(t0 + 61)
            assert (await run.timers.get(timer.id).status()).state == "FIRED"  # after 60 s


async def test_a_restart_gives_leases_back_the_downtime(tmp_path, autojump_clock):
    d = str(tmp_path / "data")
    async with controlled_time() as tc:
        clock = Clock()
        async with rallypoint.open_embedded(d, durability="fsync", clock=clock) as rs:
            mbx = await rs.mailboxes.ensure("w")
            run = await rs.scopes.create()
            await mbx.submit("x", scope=run)
            held = await mbx.receive(run, lease_seconds=30, wait=0)
        await tc.advance(120)  # down for two minutes: longer than the lease
        async with rallypoint.open_embedded(d, durability="fsync", clock=clock) as rs:
            assert rs.node.recovery_info["leases_extended_ms"] == pytest.approx(120_000, abs=5)
            # the holder's renewal after the restart is still in time
            lease = await rs._call(
                p.DeliveryRenew(task_id=held.task_id, token=held.token, lease_ms=30_000),
                t._LeaseReply,
            )
            assert lease.token == held.token


async def test_a_restart_gives_back_the_drain_and_the_start_up_too(tmp_path, autojump_clock):
    # Issue 31 item 5: the server stops hearing renewals when its drain begins
    # (Node.stop_hearing, at SIGTERM), not at its last heartbeat after the final
    # snapshot; and it hears again only once it serves, after recovery and start-up.
    # Given a 30 s lease, a 20 s drain, 5 s down and 12 s of recovery and start-up
    # (slow, on a loaded machine), a renewal 2 s after the restart is in time: leases
    # are extended by the 37 s in which no renewal could be heard.
    from rallypoint.client.api import Client
    from rallypoint.client.embedded import EmbeddedTransport
    from rallypoint.node import recovered, serving

    d = str(tmp_path / "data")
    async with controlled_time() as tc:
        clock = Clock()
        async with rallypoint.open_embedded(d, durability="fsync", clock=clock) as rs:
            mbx = await rs.mailboxes.ensure("w")
            run = await rs.scopes.create()
            await mbx.submit("x", scope=run)
            held = await mbx.receive(run, lease_seconds=30, wait=0)
            rs.node.stop_hearing()  # SIGTERM: the listeners close, the drain begins
            await tc.advance(20)  # a long drain (in-flight requests finishing)
        await tc.advance(5)  # down
        async with recovered(d, "fsync", clock=clock, interval_ms=10) as recovery:
            await tc.advance(12)  # recovery, imports, binding: no renewal is heard yet
            async with serving(recovery, snapshot_every_records=100_000, snapshot_every_s=60) as node:
                assert node.recovery_info["leases_extended_ms"] == pytest.approx(37_000, abs=5)
                await tc.advance(2)  # 39 s after the lease was granted: its 30 s ran out long ago
                rs = Client(EmbeddedTransport(node.service))
                lease = await rs._call(p.DeliveryRenew(task_id=held.task_id, token=held.token, lease_ms=30_000),
                                       t._LeaseReply)
                assert lease.token == held.token
                info = await rs.task(held.task_id).status()
                assert (info.state, info.attempt) == ("RUNNING", 1)
                await rs._transport.aclose()
        # the mark is gone once the node serves again: a later restart counts from its own
        from rallypoint.persistence.clockfile import ClockFile

        assert ClockFile(d).read_full()[2] is None


def test_the_clock_file_keeps_its_old_layout_readable():
    # The deaf mark is a block after the original 24 bytes: a reader of those (an older
    # rallypoint) reads the same pair, and an older file reads as "hearing".
    import struct
    import tempfile
    import zlib

    from rallypoint.persistence.clockfile import ClockFile

    with tempfile.TemporaryDirectory() as d:
        cf = ClockFile(d)
        cf.write(1000, 2000, deaf_since_ms=900)
        assert cf.read() == (1000, 2000) and cf.read_full() == (1000, 2000, 900)
        with open(os.path.join(d, "CLOCK"), "rb") as f:
            head = f.read(24)
        magic, mono, wall, crc = struct.unpack(">4sqqI", head)
        assert (magic, mono, wall) == (b"RPCK", 1000, 2000) and crc == zlib.crc32(head[:20])
        with open(os.path.join(d, "CLOCK"), "r+b") as f:
            f.truncate(24)  # as an older rallypoint wrote it
        assert ClockFile(d).read_full() == (1000, 2000, None)
        cf.write(1100, 2100)
        assert cf.read_full() == (1100, 2100, None)
        cf.close()


# ------------------------------------------------------------------ stalls


async def test_a_renewal_sent_in_time_survives_an_event_loop_stall(autojump_clock, ers):
    coord = ers.node.coordinator
    mbx = await ers.mailboxes.ensure("stall")
    run = await ers.scopes.create()
    await mbx.submit("x", scope=run)
    d = await mbx.receive(run, lease_seconds=5, wait=0)
    await trio.sleep(1)  # the holder renews every ~1.7 s; the loop freezes first
    autojump_clock.jump(9)  # a 9 s stall: no task runs, time passes
    await d.renew(5)  # sent in time (before the freeze); must not be "lease lost"
    assert coord.stalls == 1
    info = await ers.task(d.task_id).status()
    assert info.state == "RUNNING" and info.attempt == 1
    # without a stall, silence loses the lease as before
    await trio.sleep(6)
    with pytest.raises(LeaseLostError):
        await d.renew(5)


def test_a_real_daemon_paused_with_sigstop_keeps_a_lease_renewed_in_time(tmp_path):
    d = Daemon(str(tmp_path / "data"), "fsync").start()
    try:
        async def main():
            # (reconnecting: a client leaves a connection silent for 6 s -- the liveness check,
            # with one address too -- and sends the renewal again once the daemon answers)
            async with rallypoint.connect(d.url) as rs:
                mbx = await rs.mailboxes.ensure("sigstop")
                run = await rs.scopes.create()
                await mbx.submit("x", scope=run)
                dl = await mbx.receive(run, lease_seconds=5, wait=0)
                await trio.sleep(1)
                os.kill(d.proc.pid, signal.SIGSTOP)  # the daemon freezes for 7 s
                try:
                    async with trio.open_nursery() as n:
                        n.start_soon(dl.renew, 5)  # sent in time; waits in the socket
                        await trio.sleep(7)
                        os.kill(d.proc.pid, signal.SIGCONT)
                finally:
                    os.kill(d.proc.pid, signal.SIGCONT)
                info = await rs.task(dl.task_id).status()
                assert info.state == "RUNNING" and info.attempt == 1
                await dl.complete("done")
                assert (await rs.task(dl.task_id).status()).state == "SUCCEEDED"

        trio.run(main)
    finally:
        assert d.stop() == 0
    assert "stalled" in d.stderr()


# ------------------------------------------------------------------ the step's instant
async def test_a_pinned_clock_reads_the_pinned_instant_until_unpinned(autojump_clock):
    clock = Clock()
    mono, wall = clock.mono_ms(), clock.now_ms()
    clock.pin(trio.current_time())
    autojump_clock.jump(5.0)  # time passes during the step
    assert (clock.mono_ms(), clock.now_ms()) == (mono, wall)
    assert clock.now() == pytest.approx(wall / 1000, abs=0.002)
    clock.unpin()
    assert clock.mono_ms() - mono == pytest.approx(5000, abs=2)
    assert clock.now_ms() - wall == pytest.approx(5000, abs=2)


async def test_one_command_batch_reads_one_instant(autojump_clock, monkeypatch):
    """The coordinator pins the clock for each command batch: a step that takes time
    still gives every task, delivery and id of it one instant, and the clock reads live
    again after it (``Coordinator.before_batch``/``after_batch``)."""
    from rallypoint.ids import id_time_ms

    async with rallypoint.open_embedded(None) as rs:
        coord = rs.node.coordinator

        class SlowIds:  # each id of the step costs 20 ms of (virtual) time
            def __init__(self, ids):
                self._ids = ids

            def new(self, prefix):
                autojump_clock.jump(0.02)
                return self._ids.new(prefix)

        monkeypatch.setattr(coord, "ids", SlowIds(coord.ids))
        run = await rs.scopes.create(name="one-instant")
        mbx = await rs.mailboxes.ensure("one-instant")
        tickets = await mbx.submit_many([{"n": i} for i in range(5)], scope=run)
        assert len({id_time_ms(tk.id) for tk in tickets}) == 1
        infos = [await rs.task(tk.id).status() for tk in tickets]
        assert len({i.created_at for i in infos}) == 1
        assert coord.clock._pinned is None  # unpinned after the batch
        before = coord.clock.mono_ms()
        autojump_clock.jump(1.0)
        assert coord.clock.mono_ms() - before == pytest.approx(1000, abs=2)


def test_the_daemon_freezes_start_up_and_makes_full_collections_rarer():
    import gc

    from rallypoint.cli import DAEMON_GC_THRESHOLDS, tune_gc

    old = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold() == DAEMON_GC_THRESHOLDS
        assert DAEMON_GC_THRESHOLDS[2] > 10  # full collections rarer than CPython's default
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*old)
