"""Restarts: a graceful stop snapshots so the next start replays nothing, and recovery
re-arms deadlines, leases and retry delays (what fell due while the node was down fires
at once; the rest fires on time). Time-dependent tests run embedded under trio's
MockClock, with one :class:`~rallypoint.clock.Clock` shared by the node before and after
the restart so wall time is continuous."""

from __future__ import annotations

import re
import shutil
from contextlib import asynccontextmanager

import pytest
import trio

import rallypoint
from rallypoint.clock import Clock, to_iso

from conftest import Daemon

# ------------------------------------------------------------------------ graceful stop


async def test_sigterm_snapshots_and_the_next_start_replays_nothing(tmp_path):
    d = str(tmp_path / "data")
    daemon = Daemon(d, "fsync").start()
    try:
        async with rallypoint.connect(daemon.url) as rs:
            run = await rs.scopes.create(name="kept")
            child = await run.child()
            mbx = await rs.mailboxes.ensure("jobs")
            t = await mbx.submit({"n": 1}, key="k1", scope=child)
            dl = await mbx.receive(run, wait=0)
            await dl.complete({"done": True})
            await mbx.submit({"n": 2}, scope=child)
    finally:
        rc = daemon.stop()
    err = daemon.stderr()
    assert rc == 0, err
    assert re.search(r"snapshot at LSN \d+: \d+ entities written", err), err
    assert "stopped cleanly" in err

    daemon = Daemon(d, "fsync").start()
    try:
        async with rallypoint.connect(daemon.url) as rs:
            assert (await rs.scope(run.id).status()).name == "kept"
            assert (await rs.scope(child.id).status()).tasks == {"SUCCEEDED": 1, "QUEUED": 1}
            info = await rs.task(t.id).status()
            assert info.state == "SUCCEEDED" and info.outcome == {"done": True}
    finally:
        rc = daemon.stop()
    err = daemon.stderr()
    assert rc == 0, err
    assert re.search(r"recovered \d+ entities from .*: snapshot LSN [1-9]\d*, 0 journal records replayed", err), err
    assert re.search(r"\b0 records replayed", err), err


async def test_a_clean_close_of_the_embedded_node_leaves_nothing_to_replay(tmp_path):
    d = str(tmp_path / "data")
    async with rallypoint.open_embedded(d, durability="fsync") as rs:
        run = await rs.scopes.create()
        mbx = await rs.mailboxes.ensure("m")
        for i in range(5):
            await mbx.submit(i, scope=run)
        await run.child()
        count = rs.node.coordinator.entity_count()
        assert rs.node.recovery_info["replayed"] == 0 and rs.node.recovery_info["snapshot_lsn"] == 0
    async with rallypoint.open_embedded(d, durability="fsync") as rs:
        info = rs.node.recovery_info
        assert info["replayed"] == 0
        assert info["snapshot_lsn"] > 0 and info["snapshot_entities"] == count
        assert rs.node.coordinator.entity_count() == count
        assert (await rs.scope(run.id).status()).tasks == {"QUEUED": 5}


# ------------------------------------------------------------------------ re-arming


class TimeControl:
    """Time under MockClock(autojump) that moves only when the test says so.

    Autojump advances the clock whenever every task is blocked -- including while a
    request waits for the journal's flusher thread to fsync, which would let leases and
    deadlines expire in the middle of a setup. A task that keeps checkpointing keeps the
    loop busy (frozen time); :meth:`advance_to` stops it, sleeps until ``t`` (autojump
    never jumps past the earliest sleeper, so time stops exactly at ``t``), freezes again.
    """

    def __init__(self, nursery) -> None:
        self._nursery = nursery
        self._scope: trio.CancelScope | None = None

    def freeze(self) -> None:
        self._scope = trio.CancelScope()
        self._nursery.start_soon(self._spin, self._scope)

    @staticmethod
    async def _spin(scope) -> None:
        with scope:
            while True:
                await trio.sleep(0)

    async def advance_to(self, t: float) -> None:
        self._scope.cancel()
        await trio.sleep_until(t)
        self.freeze()

    async def advance(self, seconds: float) -> None:
        await self.advance_to(trio.current_time() + seconds)


@asynccontextmanager
async def controlled_time():
    async with trio.open_nursery() as nursery:
        tc = TimeControl(nursery)
        tc.freeze()
        yield tc
        nursery.cancel_scope.cancel()


async def _setup_timed_work(rs, clock: Clock) -> dict:
    """A run with a 1 h deadline and 2 queued tasks; a task leased for 30 s; a task
    retried with a 600 s delay."""
    mbx = await rs.mailboxes.ensure("w", max_attempts=5)
    timed = await rs.scopes.create(name="timed", deadline=to_iso(clock.now_ms() + 3_600_000))
    queued = [await mbx.submit(i, scope=timed) for i in range(2)]
    run = await rs.scopes.create(name="plain")
    leased = await mbx.submit("lease", scope=run)
    d1 = await mbx.receive(run, lease_seconds=30, wait=0)
    assert d1.task_id == leased.id
    delayed = await mbx.submit("delay", scope=run)
    d2 = await mbx.receive(run, lease_seconds=30, wait=0)
    assert d2.task_id == delayed.id
    await d2.retry("later", delay=600)
    return {"mbx": mbx, "timed": timed, "queued": queued, "run": run, "leased": leased, "delayed": delayed}


async def test_what_fell_due_while_the_node_was_down_fires_at_once(tmp_path, autojump_clock):
    d = str(tmp_path / "data")
    clock = Clock()
    async with controlled_time() as tc:
        async with rallypoint.open_embedded(d, durability="fsync", clock=clock) as rs:
            w = await _setup_timed_work(rs, clock)
        await tc.advance(2 * 3600)  # the node is down for two hours
        async with rallypoint.open_embedded(d, durability="fsync", clock=clock) as rs:
            await tc.advance(0.001)  # one pass of the activity heap
            await _check_all_fired(rs, w, tc)


async def _check_all_fired(rs, w, tc: "TimeControl") -> None:
    assert rs.node.recovery_info["replayed"] == 0  # the clean close left a snapshot
    st = await rs.scope(w["timed"].id).status()
    assert st.stored_state == "ACTIVE" and st.effective == "INACTIVE" and st.inactive_reason == "deadline"
    for q in w["queued"]:
        info = await rs.task(q.id).status()
        assert info.state == "CANCELLED" and info.outcome_reason == "deadline", info
    # The lease is not lost to the two hours the server could not hear its holder: it
    # was extended by the downtime, so it still has its 30 s ...
    assert rs.node.recovery_info["leases_extended_ms"] == pytest.approx(2 * 3600 * 1000, abs=5)
    info = await rs.task(w["leased"].id).status()
    assert info.state == "RUNNING" and info.attempt == 1, info
    info = await rs.task(w["delayed"].id).status()  # the retry delay, server time: passed
    assert info.state == "QUEUED" and info.attempt == 2, info
    mbx, run = rs.mailbox("w"), rs.scope(w["run"].id)  # handles of THIS node
    assert (await mbx.receive(run, wait=0)).task_id == w["delayed"].id
    await tc.advance(31)  # ... and then expires: back to the queue for takeover
    info = await rs.task(w["leased"].id).status()
    assert info.state == "QUEUED" and info.attempt == 2, info
    assert (await mbx.receive(run, wait=0)).task_id == w["leased"].id


async def test_deadlines_leases_and_delays_fire_on_time_after_a_crash(tmp_path, autojump_clock):
    live, crashed = tmp_path / "live", tmp_path / "crashed"
    clock = Clock()
    async with controlled_time() as tc:
        async with rallypoint.open_embedded(str(live), durability="fsync", clock=clock) as rs:
            w = await _setup_timed_work(rs, clock)
            j = rs.node.coordinator.journal
            await j.wait_durable(j.last_lsn)
            shutil.copytree(live, crashed)  # what a SIGKILL leaves: journal, no final snapshot
            t0 = trio.current_time()
        async with rallypoint.open_embedded(str(crashed), durability="fsync", clock=clock) as rs:
            await _check_fires_on_time(rs, w, tc, t0)


async def _check_fires_on_time(rs, w, tc: TimeControl, t0: float) -> None:
    assert rs.node.recovery_info["replayed"] > 0 and rs.node.recovery_info["snapshot_lsn"] == 0
    mbx, run = rs.mailbox("w"), rs.scope(w["run"].id)  # handles of THIS node
    await tc.advance(0.001)
    # Nothing is due yet: the lease holds, the delay holds, the deadline holds.
    assert (await rs.task(w["leased"].id).status()).state == "RUNNING"
    assert await mbx.receive(run, wait=0) is None
    assert (await rs.scope(w["timed"].id).status()).effective == "ACTIVE"

    await tc.advance_to(t0 + 31)  # the 30 s lease expired: back to the queue, attempt 2
    info = await rs.task(w["leased"].id).status()
    assert info.state == "QUEUED" and info.attempt == 2, info
    again = await mbx.receive(run, lease_seconds=600, wait=0)
    assert again.task_id == w["leased"].id and again.attempt == 2 and again.token == 2
    assert await mbx.receive(run, wait=0) is None  # the 600 s delay still holds

    await tc.advance_to(t0 + 601)  # the retry delay passed
    d = await mbx.receive(run, lease_seconds=600, wait=0)
    assert d is not None and d.task_id == w["delayed"].id and d.attempt == 2
    assert (await rs.scope(w["timed"].id).status()).effective == "ACTIVE"

    await tc.advance_to(t0 + 3601)  # the run's deadline passed: its queued work is cancelled
    st = await rs.scope(w["timed"].id).status()
    assert st.effective == "INACTIVE" and st.inactive_reason == "deadline"
    assert st.tasks == {"CANCELLED": 2}
    for q in w["queued"]:
        assert (await rs.task(q.id).status()).outcome_reason == "deadline"
