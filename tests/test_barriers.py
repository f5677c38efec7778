"""Barriers (SPEC §6): release on ``target`` distinct keys, epochs, cancellation; three
arrivals from three processes against a real daemon."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest
import trio

from rallypoint import protocol as p
from rallypoint.client import types as t
from rallypoint.errors import (
    BarrierCancelledError,
    BarrierReleasedError,
    ConflictError,
    ScopeCancelledError,
    ValidationError,
    WaitTimeout,
)

from conftest import parked_waits, until_sync, wait_parked_remote

ARRIVE_AND_WAIT = textwrap.dedent(
    """
    import json, sys
    import trio
    import rallypoint

    async def main(url, run_id, barrier_id, key):
        async with rallypoint.connect(url) as rs:
            b = rs.scope(run_id).barriers.get(barrier_id)
            await b.arrive(key)
            st = await b.wait(timeout=30)
            print(json.dumps({"key": key, "state": st.state, "arrivals": st.arrivals, "epoch": st.epoch}), flush=True)

    trio.run(main, *sys.argv[1:5])
    """
)


def test_three_arrivals_from_three_processes_release_every_waiter(daemon):
    import rallypoint.sync

    with rallypoint.sync.connect(daemon.url) as rs:
        run = rs.scopes.create()
        b = run.barriers.create(3)

        def parked() -> int:
            return rs.status().actors.get("barriers", {}).get("waiters", 0)

        base = parked()

        def spawn(key):
            return subprocess.Popen(
                [sys.executable, "-c", ARRIVE_AND_WAIT, daemon.url, run.id, b.id, key],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )

        procs = [spawn("p1"), spawn("p2")]
        try:
            deadline = time.monotonic() + 20
            while b.status().arrivals < 2:
                assert time.monotonic() < deadline, [pr.stderr.read() for pr in procs if pr.poll() is not None]
                time.sleep(0.02)
            until_sync(lambda: parked() >= base + 2, what="both waits parked on the server")
            assert b.status().state == "WAITING"
            assert [pr.poll() for pr in procs] == [None, None]  # both still waiting
            procs.append(spawn("p3"))
            outs = []
            for pr in procs:
                out, err = pr.communicate(timeout=30)
                assert pr.returncode == 0, err
                outs.append(json.loads(out))
        finally:
            for pr in procs:
                if pr.poll() is None:
                    pr.kill()
        assert sorted(o["key"] for o in outs) == ["p1", "p2", "p3"]
        assert all((o["state"], o["arrivals"], o["epoch"]) == ("RELEASED", 3, 1) for o in outs)
        st = b.status()
        assert (st.state, sorted(st.keys)) == ("RELEASED", ["p1", "p2", "p3"])


async def test_duplicate_keys_count_once(rs):
    run = await rs.scopes.create()
    b = await run.barriers.create(3)
    for key in ("a", "a", "b", "a", "b"):
        st = await b.arrive(key)
    assert (st.state, st.arrivals, st.keys) == ("WAITING", 2, ["a", "b"])
    with pytest.raises(WaitTimeout):
        await b.wait(timeout=0.1)
    st = await b.arrive("c")
    assert (st.state, st.arrivals, st.keys) == ("RELEASED", 3, ["a", "b", "c"])
    assert st.released_at is not None


async def test_arriving_after_release_is_barrier_released(rs):
    run = await rs.scopes.create()
    b = await run.barriers.create(1)
    assert (await b.arrive("first")).state == "RELEASED"
    with pytest.raises(BarrierReleasedError) as ei:
        await b.arrive("late")
    assert ei.value.code == "BARRIER_RELEASED"
    st = await b.arrive("first")  # the same key again: idempotent within the epoch
    assert (st.state, st.arrivals) == ("RELEASED", 1)


async def test_wait_returns_at_once_when_released(rs):
    run = await rs.scopes.create()
    b = await run.barriers.create(2)
    got = []
    base = await parked_waits(rs)
    async with trio.open_nursery() as n:

        async def waiter():
            got.append(await b.wait(timeout=10))

        n.start_soon(waiter)
        n.start_soon(waiter)
        await b.arrive("x")
        await wait_parked_remote(rs, 2, base=base)  # both wait on the server
        assert got == []
        await b.arrive("y")
    assert [g.state for g in got] == ["RELEASED", "RELEASED"]
    st = await b.wait(timeout=0)  # already released: no wait
    assert st.state == "RELEASED"


async def test_epochs(rs):
    run = await rs.scopes.create()
    b = await run.barriers.create(2)
    await b.arrive("a")
    with pytest.raises(ConflictError):
        await b.next_epoch()  # WAITING
    await b.arrive("b")
    st = await b.next_epoch()
    assert (st.state, st.epoch, st.arrivals, st.keys, st.released_at) == ("WAITING", 2, 0, [], None)
    st = await b.arrive("a")  # a key of epoch 1 counts again in epoch 2
    assert (st.epoch, st.arrivals, st.state) == (2, 1, "WAITING")
    with pytest.raises(WaitTimeout):
        await b.wait(timeout=0.1)
    st = await b.arrive("z")
    assert (st.epoch, st.state, st.keys) == (2, "RELEASED", ["a", "z"])
    assert (await b.next_epoch()).epoch == 3


async def test_waiter_pinned_to_an_epoch_returns_when_the_epoch_advances(autojump_clock, ers):
    run = await ers.scopes.create()
    b = await run.barriers.create(2)
    await b.arrive("a")
    got = []
    async with trio.open_nursery() as n:

        async def waiter():
            got.append(await b.wait(timeout=100))

        n.start_soon(waiter)
        await trio.sleep(1)
        # release and reuse in one batch of the barrier's inbox: the waiter is only
        # re-checked after the batch, once epoch 2 is WAITING
        replies = await ers._transport.call_many([
            p.BarrierArrive(barrier_id=b.id, key="b"), p.BarrierNextEpochOp(barrier_id=b.id)])
        assert all(isinstance(r, bytes) for r in replies), replies
        assert (await b.status()).state == "WAITING"
    assert (got[0].epoch, got[0].state) == (2, "WAITING")  # not fooled by the reuse
    # on the wire: a wait pinned to a past epoch returns at once
    t0 = trio.current_time()
    st = await ers._call(p.BarrierWait(barrier_id=b.id, wait_ms=30_000, epoch=1), t.BarrierStatus)
    assert st.epoch == 2 and trio.current_time() == t0
    st = await ers._call(p.BarrierWait(barrier_id=b.id, wait_ms=5_000, epoch=2), t.BarrierStatus)
    assert (st.epoch, st.state) == (2, "WAITING") and trio.current_time() - t0 == pytest.approx(5, abs=0.01)


async def test_run_cancel_wakes_waiters_at_once_with_barrier_cancelled(autojump_clock, ers):
    run = await ers.scopes.create()
    child = await run.child()
    b = await run.barriers.create(3)
    bc = await child.barriers.create(2)
    released = await run.barriers.create(1)
    await released.arrive("x")
    await b.arrive("a")
    errors = []
    async with trio.open_nursery() as n:

        async def waiter(bar):
            with pytest.raises(BarrierCancelledError) as ei:
                await bar.wait(timeout=3600)
            errors.append((ei.value.code, trio.current_time()))

        for bar in (b, b, bc):
            n.start_soon(waiter, bar)
        await trio.sleep(10)
        t_cancel = trio.current_time()
        await run.cancel()
    assert [c for c, _ in errors] == ["BARRIER_CANCELLED"] * 3
    assert all(at == t_cancel for _, at in errors)  # at once, not at a timeout
    assert (await b.status()).state == "CANCELLED"
    assert (await bc.status()).state == "CANCELLED"
    assert (await released.status()).state == "RELEASED"  # already released: stays
    with pytest.raises(BarrierCancelledError):
        await b.wait(timeout=5)
    with pytest.raises(ScopeCancelledError):  # SPEC §2: arrivals on an inactive run
        await b.arrive("late")
    with pytest.raises(ScopeCancelledError):
        await run.barriers.create(2)


async def test_status_and_validation(rs):
    run = await rs.scopes.create()
    b = await run.barriers.create(2)
    assert b.id.startswith("bar_")
    st = await run.barriers.get(b.id).status()
    assert (st.id, st.scope_id, st.state, st.target, st.arrivals, st.epoch, st.keys) == (
        b.id, run.id, "WAITING", 2, 0, 1, [])
    assert st.created_at is not None and st.released_at is None
    for bad in (0, -1):
        with pytest.raises(ValidationError):
            await run.barriers.create(bad)
    with pytest.raises(ValidationError):
        await b.arrive("")


# ---------------------------------------------------------------------------- reuse (issue 42, item 3)
async def test_a_reused_barrier_does_not_lose_an_arrival_whose_wait_comes_after_next_epoch(rs):
    # target 3; A arrives and waits; B arrives; C arrives (epoch 1 released); A's wait
    # returns and A calls next_epoch(); only then does B call wait(timeout=20): it used
    # to pin epoch 2 and time out ("0/3 arrivals") though its own epoch was released
    run = await rs.scopes.create()
    b = await run.barriers.create(3)
    a_h, b_h, c_h = (run.barriers.get(b.id) for _ in range(3))
    base = await parked_waits(rs)
    async with trio.open_nursery() as n:
        got = {}

        async def a():
            await a_h.arrive("A")
            got["A"] = await a_h.wait(timeout=20)

        n.start_soon(a)
        await wait_parked_remote(rs, 1, base=base)
        assert (await b_h.arrive("B")).epoch == 1
        await c_h.arrive("C")
    assert got["A"].state == "RELEASED" and got["A"].epoch == 1
    assert (await a_h.next_epoch()).epoch == 2
    st = await b_h.wait(timeout=20)  # B's own arrival's epoch: released, now past
    assert st.epoch == 2 and b_h.arrived_epoch == 1
    # the epoch can be named explicitly too, and a wait for the current epoch still waits
    assert (await c_h.wait(timeout=5, epoch=1)).epoch == 2
    with pytest.raises(WaitTimeout):
        await run.barriers.get(b.id).wait(timeout=0.1)


async def test_an_early_arrival_for_the_next_epoch_is_held_and_counted_when_it_begins(rs):
    # an arrival for the next round that lands before next_epoch() used to be taken as a
    # repeat of the old round's arrival and not counted
    run = await rs.scopes.create()
    b = await run.barriers.create(2)
    await b.arrive("A", epoch=1)
    await b.arrive("B", epoch=1)
    st = await b.arrive("A", epoch=2)  # early: epoch 1 is RELEASED, epoch 2 not begun
    assert (st.epoch, st.state, st.keys, st.next_keys) == (1, "RELEASED", ["A", "B"], ["A"])
    assert (await b.arrive("A", epoch=2)).next_keys == ["A"]  # idempotent
    st = await b.next_epoch()
    assert (st.epoch, st.state, st.keys, st.next_keys) == (2, "WAITING", ["A"], [])
    st = await b.arrive("B", epoch=2)
    assert (st.epoch, st.state, st.keys) == (2, "RELEASED", ["A", "B"])
    # every key early: the next epoch is released as it begins
    await b.arrive("A", epoch=3)
    await b.arrive("B", epoch=3)
    st = await b.next_epoch()
    assert (st.epoch, st.state, st.keys) == (3, "RELEASED", ["A", "B"]) and st.released_at is not None
    assert (await b.wait(timeout=1, epoch=3)).state == "RELEASED"


async def test_an_arrival_for_an_epoch_that_is_over_or_not_next_is_refused(rs):
    run = await rs.scopes.create()
    b = await run.barriers.create(1)
    await b.arrive("A")
    await b.next_epoch()  # epoch 2, WAITING
    with pytest.raises(BarrierReleasedError, match="epoch 1 .* is over"):
        await b.arrive("A", epoch=1)
    with pytest.raises(ConflictError, match="WAITING in epoch 2"):
        await b.arrive("A", epoch=3)  # the next epoch, but the current one still waits
    await b.arrive("A", epoch=2)
    with pytest.raises(ConflictError):
        await b.arrive("A", epoch=4)  # not the next one
    with pytest.raises(ValidationError):
        await b.arrive("A", epoch=0)
    assert (await b.status()).next_keys == []


async def test_early_arrivals_survive_a_restart(tmp_path):
    import rallypoint

    async with rallypoint.open_embedded(str(tmp_path), durability="fsync") as rs:
        run = await rs.scopes.create()
        b = await run.barriers.create(2)
        await b.arrive("A")
        await b.arrive("B")
        await b.arrive("B", epoch=2)
        bid, rid = b.id, run.id
    async with rallypoint.open_embedded(str(tmp_path), durability="fsync") as rs:
        b = rs.scope(rid).barriers.get(bid)
        st = await b.status()
        assert (st.epoch, st.state, st.next_keys) == (1, "RELEASED", ["B"])
        st = await b.next_epoch()
        assert (st.epoch, st.keys) == (2, ["B"])
