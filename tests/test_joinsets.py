"""Join sets (SPEC §5, after Obelisk; reference/obelisk-join-sets.md §3-§4, §13), through
the SDK, embedded and over TCP; virtual-time cases under MockClock; restarts of a real
daemon (SIGKILL, fsync data dir) and replay of a whole history from the journal."""

from __future__ import annotations

import shutil

import pytest
import trio

import rallypoint

from rallypoint.actors import Coordinator

from rallypoint.client.api import Client
from rallypoint.client.embedded import EmbeddedTransport
from rallypoint.errors import (
    ChildError,
    ConflictError,
    JoinSetExhaustedError,
    LeaseLostError,
    NotFoundError,
    ScopeCancelledError,
    ValidationError,
    WaitTimeout,
)
from rallypoint.node import recover_coordinator
from rallypoint.service import Service

from conftest import Daemon, parked_waits, wait_parked_remote
from _joinset_util import child_error, in_, raw_record, take  # noqa: F401


MBX = "js-work"



# ------------------------------------------------------------------- completion order


async def test_results_come_in_completion_order_not_submission_order(rs):
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(MBX)
    js = await run.join_sets.create()
    a = await js.submit(mbx, "a")
    b = await js.submit(mbx, "b")
    c = await js.submit(mbx, "c")
    da, db, dc = await take(mbx, run, 3)
    assert [d.task_id for d in (da, db, dc)] == [a, b, c]
    await dc.complete("C")
    await da.complete("A")
    await db.complete("B")
    assert await js.join_next(timeout=5) == (c, "C")
    assert js.last_id == c
    assert await js.join_next(timeout=5) == (a, "A")
    assert await js.join_next(timeout=5) == (b, "B")
    st = await js.status()
    assert (st.submitted, st.finished, st.consumed) == (3, 3, 3)


async def test_join_next_blocks_until_a_child_finishes(rs):
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(MBX)
    js = await run.join_sets.create()
    a = await js.submit(mbx, 1)
    with pytest.raises(WaitTimeout):
        await js.join_next(timeout=0.1)
    assert (await js.status()).consumed == 0  # a wait that times out changes nothing
    (d,) = await take(mbx, run, 1)
    got = []
    base = await parked_waits(rs)
    async with trio.open_nursery() as n:

        async def waiter():
            got.append(await js.join_next(timeout=10))

        n.start_soon(waiter)
        await wait_parked_remote(rs, 1, base=base)  # join_next waits on the server
        assert got == []
        await d.complete({"v": 1})
    assert got == [(a, {"v": 1})]


async def test_task_finishing_before_the_delay_beats_it(autojump_clock, ers):
    # S13: task T submitted first, delay D (10 s); T completes first.
    run = await ers.scopes.create()
    mbx = await ers.mailboxes.ensure(MBX)
    js = await run.join_sets.create()
    tsk = await js.submit(mbx, "t")
    dly = await js.submit_delay(10)
    (d,) = await take(mbx, run, 1)
    await trio.sleep(9)
    await d.complete("ok")
    assert await js.join_next() == (tsk, "ok")
    t0 = trio.current_time()
    assert await js.join_next() == (dly, None)  # a delay's result is None
    assert 0.9 < trio.current_time() - t0 < 1.1


async def test_delay_firing_before_the_task_beats_it(autojump_clock, ers):
    run = await ers.scopes.create()
    mbx = await ers.mailboxes.ensure(MBX)
    js = await run.join_sets.create()
    tsk = await js.submit(mbx, "t")
    dly = await js.submit_delay(10)
    (d,) = await take(mbx, run, 1)
    t0 = trio.current_time()
    assert await js.join_next() == (dly, None)
    assert 9.99 < trio.current_time() - t0 < 10.1
    await d.complete("late")
    assert await js.join_next() == (tsk, "late")


async def test_shorter_delay_wins_whatever_the_submission_order(autojump_clock, ers):
    # S12: L (10 s) submitted first, S (10 ms) second; S comes first; close cancels L.
    run = await ers.scopes.create()
    js = await run.join_sets.create()
    long_ = await js.submit_delay(10)
    short = await js.submit_delay(0.01)
    at = await js.submit_delay(at=in_(5))
    assert await js.join_next() == (short, None)
    assert await js.join_next() == (at, None)
    st = await js.close()
    assert (st.state, st.consumed) == ("CLOSED", 3)
    e = await child_error(js.join_next(index=2))
    assert (e.child_id, e.failure_kind, e.value) == (long_, "cancelled", None)


# ------------------------------------------------------------------- exhaustion


async def test_empty_set_is_exhausted_at_once(rs):
    run = await rs.scopes.create()
    js = await run.join_sets.create()
    with trio.fail_after(5):
        with pytest.raises(JoinSetExhaustedError) as ei:
            await js.join_next()  # no timeout: would hang forever if it waited
    assert ei.value.code == "JOIN_SET_EXHAUSTED"
    with pytest.raises(JoinSetExhaustedError):
        await js.join_next_try()  # S09: the probe reports exhaustion, not "pending"


async def test_exhausted_after_every_record_was_consumed(rs):
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(MBX)
    js = await run.join_sets.create()
    a = await js.submit(mbx, 1)
    (d,) = await take(mbx, run, 1)
    await d.reject("no")
    e = await child_error(js.join_next(timeout=5))  # a failure still counts as consumed
    assert e.child_id == a
    with trio.fail_after(5):
        with pytest.raises(JoinSetExhaustedError):
            await js.join_next()
        with pytest.raises(JoinSetExhaustedError):
            await js.join_next_try()
    assert (await js.status()).consumed == 1


# ------------------------------------------------------------------- failures


async def test_rejected_child_raises_child_error_with_value_and_kind(rs):
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(MBX)
    js = await run.join_sets.create()
    a = await js.submit(mbx, 1)
    (d,) = await take(mbx, run, 1)
    await d.reject({"why": "bad input", "n": 3})
    e = await child_error(js.join_next(timeout=5))
    assert e.code == "CHILD_FAILED"
    assert (e.child_id, e.failure_kind, e.value) == (a, "failed", {"why": "bad input", "n": 3})
    assert js.last_id == a
    assert (await js.status()).consumed == 1


async def test_child_failing_after_its_last_retry_is_failed_with_the_last_error(rs):
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure("js-two-attempts", max_attempts=2)
    js = await run.join_sets.create()
    a = await js.submit(mbx, 1)
    (d,) = await take(mbx, run, 1)
    await d.retry("first")
    assert await js.join_next_try() is None  # one retry left: not finished
    (d,) = await take(mbx, run, 1)
    assert d.attempt == 2
    await d.retry("second")
    e = await child_error(js.join_next(timeout=5))
    assert (e.child_id, e.failure_kind, e.value) == (a, "failed", "second")


async def test_cancelled_child_raises_child_error_cancelled(rs):
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(MBX)
    js = await run.join_sets.create()
    a = await js.submit(mbx, 1)
    await rs.task(a).cancel()
    e = await child_error(js.join_next(timeout=5))
    assert (e.child_id, e.failure_kind, e.value) == (a, "cancelled", None)


async def test_child_past_its_deadline_is_expired(autojump_clock, ers):
    run = await ers.scopes.create()
    mbx = await ers.mailboxes.ensure(MBX)
    js = await run.join_sets.create()
    a = await js.submit(mbx, 1, deadline=in_(30))
    t0 = trio.current_time()
    e = await child_error(js.join_next())
    assert 29.9 < trio.current_time() - t0 < 30.1
    assert (e.child_id, e.failure_kind, e.value) == (a, "expired", None)


async def test_child_whose_last_lease_expired_is_timed_out(autojump_clock, ers):
    run = await ers.scopes.create()
    mbx = await ers.mailboxes.ensure("js-one-attempt", max_attempts=1)
    js = await run.join_sets.create()
    a = await js.submit(mbx, 1)
    d = await mbx.receive(run, lease_seconds=5, wait=0)
    assert d.task_id == a
    e = await child_error(js.join_next())  # the worker vanished: the lease runs out
    assert (e.child_id, e.failure_kind, e.value) == (a, "timed_out", None)
    with pytest.raises(LeaseLostError):
        await d.complete("too late")


async def test_lease_expiry_with_attempts_left_is_not_a_completion(autojump_clock, ers):
    run = await ers.scopes.create()
    mbx = await ers.mailboxes.ensure("js-two-attempts", max_attempts=2)
    js = await run.join_sets.create()
    a = await js.submit(mbx, 1)
    await mbx.receive(run, lease_seconds=5, wait=0)
    await trio.sleep(6)
    assert await js.join_next_try() is None  # back in the queue, attempt 2
    d = await mbx.receive(run, wait=0)
    assert d.attempt == 2
    await d.complete("second time")
    assert await js.join_next() == (a, "second time")


# ------------------------------------------------------------------- probe


async def test_join_next_try_is_none_while_pending_and_never_stale(rs):
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(MBX)
    js = await run.join_sets.create()
    a = await js.submit(mbx, 1)
    b = await js.submit(mbx, 2)
    assert await js.join_next_try() is None
    assert await js.join_next_try() is None
    assert (await js.status()).consumed == 0  # a pending probe consumes nothing
    da, db = await take(mbx, run, 2)
    await db.complete("B")
    assert await js.join_next_try() == (b, "B")  # the record written just before
    assert await js.join_next_try() is None
    await da.complete("A")
    assert await js.join_next_try() == (a, "A")
    with pytest.raises(JoinSetExhaustedError):
        await js.join_next_try()


async def test_probe_and_join_next_share_one_count(rs):
    # Obelisk §10.1: exhaustion must count probe consumptions too.
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(MBX)
    js = await run.join_sets.create()
    a = await js.submit(mbx, 1)
    (d,) = await take(mbx, run, 1)
    await d.complete("x")
    assert await js.join_next_try() == (a, "x")
    with trio.fail_after(5):
        with pytest.raises(JoinSetExhaustedError):
            await js.join_next()


# ------------------------------------------------------------------- close


async def test_close_with_mixed_children(rs):
    """Unconsumed members: a finished task, queued and running cancellable tasks, delays,
    a running non-cancellable task. Close cancels in reverse submission order, waits for
    the non-cancellable one, never raises, consumes everything."""
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(MBX)
    js = await run.join_sets.create()
    done = await js.submit(mbx, "done")
    q1 = await js.submit(mbx, "queued-1")
    d1 = await js.submit_delay(100)
    nc = await js.submit(mbx, "non-cancellable", cancellable=False)
    run1 = await js.submit(mbx, "running-1")
    d2 = await js.submit_delay(at=in_(200))
    q2 = await js.submit(mbx, "queued-2")
    # lease: done, nc, run1 (in submission order; the rest stay queued)
    dl_done = await mbx.receive(run, wait=5)
    assert dl_done.task_id == done
    dl_q1 = await mbx.receive(run, wait=5)
    assert dl_q1.task_id == q1
    await dl_q1.retry(delay=3600)  # queued again, not eligible for an hour
    dl_nc = await mbx.receive(run, wait=5)
    dl_run1 = await mbx.receive(run, wait=5)
    assert (dl_nc.task_id, dl_run1.task_id) == (nc, run1)
    await dl_done.complete("D")

    result = {}
    base = await parked_waits(rs)
    async with trio.open_nursery() as n:

        async def closer():
            result["st"] = await js.close(timeout=20)

        n.start_soon(closer)
        await wait_parked_remote(rs, 1, base=base)  # the close waits on the server
        st = await js.status()
        assert "st" not in result and st.state == "CLOSING"  # waits for the non-cancellable
        assert st.finished == 6 and st.consumed == 6
        assert (await rs.task(nc).status()).state == "RUNNING"
        with pytest.raises(LeaseLostError):
            await dl_run1.complete("too late")  # cancelled under its worker
        with pytest.raises(ConflictError):
            await js.submit(mbx, "more")  # closed to new children
        await dl_nc.complete("N")
    st = result["st"]
    assert (st.state, st.submitted, st.finished, st.consumed) == ("CLOSED", 7, 7, 7)
    # records: the finished one, then cancellations in reverse submission order, then nc
    order = []
    for k in range(7):
        try:
            cid, val = await js.join_next(index=k)
            order.append((cid, "ok", val))
        except ChildError as e:
            order.append((e.child_id, e.failure_kind, e.value))
    assert order == [
        (done, "ok", "D"),
        (q2, "cancelled", None),
        (d2, "cancelled", None),
        (run1, "cancelled", None),
        (d1, "cancelled", None),
        (q1, "cancelled", None),
        (nc, "ok", "N"),
    ]
    for k in range(7):
        assert (await raw_record(rs, js, k)).closing is True  # all seven were closing consumes
    for tid, state in ((done, "SUCCEEDED"), (q1, "CANCELLED"), (run1, "CANCELLED"), (q2, "CANCELLED"), (nc, "SUCCEEDED")):
        assert (await rs.task(tid).status()).state == state
    with pytest.raises(JoinSetExhaustedError):
        await js.join_next()
    again = await js.close()  # closing a closed set changes nothing
    assert (again.state, again.consumed) == ("CLOSED", 7)


async def test_close_after_partial_consumption_marks_only_the_rest_as_closing(rs):
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(MBX)
    js = await run.join_sets.create()
    a = await js.submit(mbx, 1)
    b = await js.submit(mbx, 2)
    c = await js.submit(mbx, 3)
    da, db, dc = await take(mbx, run, 3)
    await db.complete("B")
    await da.reject("bad")
    assert await js.join_next(timeout=5) == (b, "B")
    st = await js.close(timeout=5)  # a's failure is consumed by close and never raises
    assert (st.state, st.consumed) == ("CLOSED", 3)
    flags = [(await raw_record(rs, js, k)) for k in range(3)]
    assert [(f.child_id, f.closing) for f in flags] == [(b, False), (a, True), (c, True)]
    assert [f.failure_kind for f in flags] == [None, "failed", "cancelled"]
    assert (await rs.task(a).status()).state == "FAILED"  # keeps its real result


async def test_closing_a_drained_set_adds_no_closing_consume(rs):
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(MBX)
    js = await run.join_sets.create()
    a = await js.submit(mbx, 1)
    d = await js.submit_delay(0)
    (da,) = await take(mbx, run, 1)
    await da.complete("A")
    got = {await js.join_next(timeout=5), await js.join_next(timeout=5)}
    assert got == {(a, "A"), (d, None)}
    st = await js.close(timeout=5)
    assert (st.state, st.consumed, st.finished) == ("CLOSED", 2, 2)
    assert [(await raw_record(rs, js, k)).closing for k in range(2)] == [False, False]
    empty = await run.join_sets.create()
    st = await empty.close(timeout=5)
    assert (st.state, st.consumed, st.submitted) == ("CLOSED", 0, 0)


async def test_close_of_a_finished_but_unconsumed_set_consumes_in_completion_order(rs):
    # S17: both completed, never awaited: no cancellation changes anything.
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(MBX)
    js = await run.join_sets.create()
    a = await js.submit(mbx, 1)
    b = await js.submit(mbx, 2)
    da, db = await take(mbx, run, 2)
    await db.complete("B")
    await da.complete("A")
    st = await js.close(timeout=5)
    assert (st.state, st.consumed) == ("CLOSED", 2)
    assert await js.join_next(index=0) == (b, "B")
    assert await js.join_next(index=1) == (a, "A")
    assert (await rs.task(a).status()).state == "SUCCEEDED"


# ------------------------------------------------------------------- names


async def test_name_charset(rs):
    run = await rs.scopes.create()
    for good in ("fetch", "a-b/c", "X9", "0", "x" * 128, "/-/"):
        js = await run.join_sets.create(good)
        assert (await js.status()).name == good
        assert (await run.join_sets.by_name(good)).id == js.id
    for bad in ("a_b", "a.b", "a:b", "a b", "é", "", "x" * 129, "tab\t"):
        with pytest.raises(ValidationError) as ei:
            await run.join_sets.create(bad)
        assert "name" in ei.value.message
        if bad:
            with pytest.raises((NotFoundError, ValidationError)):
                await run.join_sets.by_name(bad)  # a refused create leaves nothing behind


async def test_a_name_is_used_once_per_run_even_after_close(rs):
    run = await rs.scopes.create()
    first = await run.join_sets.create("x")
    with pytest.raises(ConflictError):
        await run.join_sets.create("x")
    await first.close()
    with pytest.raises(ConflictError) as ei:
        await run.join_sets.create("x")
    assert ei.value.code == "CONFLICT"
    assert (await run.join_sets.by_name("x")).id == first.id
    other = await rs.scopes.create()
    assert (await other.join_sets.create("x")).id != first.id  # per run


async def test_named_and_generated_sets(rs):
    run = await rs.scopes.create()
    g1 = await run.join_sets.create()
    g2 = await run.join_sets.create()
    n1 = await run.join_sets.create("1")
    ids = {g1.id, g2.id, n1.id}
    assert len(ids) == 3 and all(i.startswith("jst_") for i in ids)
    assert (await g1.status()).name is None
    assert (await n1.status()).name == "1"
    assert (await run.join_sets.by_name("1")).id == n1.id
    assert (await run.join_sets.by_id(g2.id).status()).id == g2.id
    with pytest.raises(NotFoundError):
        await run.join_sets.by_name("2")
    with pytest.raises(NotFoundError):
        await rs.scope(run.id).join_sets.by_id("jst_00000000000000000000000000").status()


async def test_nested_runs_each_have_their_own_sets(rs):
    parent = await rs.scopes.create()
    child = await parent.child()
    mbx = await rs.mailboxes.ensure(MBX)
    pjs = await parent.join_sets.create("work")
    cjs = await child.join_sets.create("work")  # same name, another run: no conflict
    assert pjs.id != cjs.id
    assert (await child.join_sets.by_name("work")).id == cjs.id
    assert (await parent.join_sets.by_name("work")).id == pjs.id
    pt = await pjs.submit(mbx, "p")
    ct = await cjs.submit(mbx, "c")
    cd = await mbx.receive(child, wait=5)
    assert cd.task_id == ct
    await cd.complete("C")
    assert await cjs.join_next(timeout=5) == (ct, "C")
    assert await pjs.join_next_try() is None  # the child's record is not the parent's
    st = await child.complete(timeout=5)  # closes only the child's sets
    assert st.stored_state == "COMPLETED"
    assert (await cjs.status()).state == "CLOSED"
    assert (await pjs.status()).state == "OPEN"
    pd = await mbx.receive(parent, wait=5)
    assert pd.task_id == pt
    await pd.complete("P")
    assert await pjs.join_next(timeout=5) == (pt, "P")


# ------------------------------------------------------------------- structured end


async def test_run_complete_closes_sets_newest_first_and_waits_for_the_last_child(rs):
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(MBX)
    older = await run.join_sets.create("older")
    o_nc = await older.submit(mbx, "o-nc", cancellable=False)
    o_q = await older.submit(mbx, "o-q")
    newer = await run.join_sets.create("newer")
    n_nc = await newer.submit(mbx, "n-nc", cancellable=False)
    n_d = await newer.submit_delay(100)
    drained = await run.join_sets.create("drained")
    closed = await run.join_sets.create("closed")
    await closed.close()
    d_onc = await mbx.receive(run, wait=5)
    d_oq = await mbx.receive(run, wait=5)
    d_nnc = await mbx.receive(run, wait=5)
    assert [d.task_id for d in (d_onc, d_oq, d_nnc)] == [o_nc, o_q, n_nc]

    coord = getattr(getattr(rs, "node", None), "coordinator", None)
    close_order = []
    if coord is not None:  # embedded: watch the order the closes are applied in
        from rallypoint.records import JoinSetClosed

        orig = coord._apply[JoinSetClosed]

        def spy(r):
            close_order.append(r.joinset_id)
            orig(r)

        coord._apply[JoinSetClosed] = spy

    with pytest.raises(WaitTimeout):
        await run.complete(timeout=0.2)  # blocked by the two non-cancellable children
    st = await run.status()
    assert st.stored_state == "ACTIVE"
    if coord is not None:
        assert close_order == [drained.id, newer.id, older.id]  # newest first, each once
    for js in (older, newer, drained):
        assert (await js.status()).state in ("CLOSING", "CLOSED")
    assert (await drained.status()).state == "CLOSED"
    assert (await rs.task(o_q).status()).state == "CANCELLED"
    with pytest.raises(LeaseLostError):
        await d_oq.complete("x")
    result = {}
    async with trio.open_nursery() as n:

        async def completer():
            result["st"] = await run.complete(timeout=20)

        base = await parked_waits(rs)
        n.start_soon(completer)
        await wait_parked_remote(rs, 1, base=base)  # the run's complete waits on the server
        await d_nnc.complete("N")
        assert "st" not in result  # the older set's non-cancellable child still runs
        assert (await newer.status()).state == "CLOSED"
        assert (await run.status()).stored_state == "ACTIVE"
        await d_onc.complete("O")
    assert result["st"].stored_state == "COMPLETED"
    for js in (older, newer, drained, closed):
        assert (await js.status()).state == "CLOSED"
    assert await older.join_next(index=1) == (o_nc, "O")
    assert await newer.join_next(index=1) == (n_nc, "N")
    e = await child_error(newer.join_next(index=0))
    assert (e.child_id, e.failure_kind) == (n_d, "cancelled")


async def test_cancelling_the_run_cancels_every_child_of_every_set_at_once(rs):
    run = await rs.scopes.create()
    sub = await run.child()
    mbx = await rs.mailboxes.ensure(MBX)
    a = await run.join_sets.create()
    b = await run.join_sets.create("b")
    c = await sub.join_sets.create()  # a set of a child run
    kids = {
        a.id: [await a.submit(mbx, 1), await a.submit_delay(100), await a.submit(mbx, 2, cancellable=False)],
        b.id: [await b.submit_delay(50), await b.submit(mbx, 3, cancellable=False)],
        c.id: [await c.submit(mbx, 4), await c.submit_delay(10)],
    }
    running = await mbx.receive(run, wait=5)  # one is held by a worker
    await run.cancel()
    for js in (a, b, c):
        st = await js.status()  # no waiting: everything finished in the cancel itself
        # the cancel closed the set like a close: every child cancelled, in reverse
        # submission order (non-cancellable ones too), each record a closing consume
        assert st.state == "CLOSED" and st.consumed == st.finished == st.submitted == len(kids[js.id])
        assert all(ch.finished for ch in st.children)
        order = []
        for k in range(len(kids[js.id])):
            e = await child_error(js.join_next(index=k))  # positional re-reads
            assert e.failure_kind == "cancelled"
            order.append(e.child_id)
        assert order == list(reversed(kids[js.id]))
        with pytest.raises(JoinSetExhaustedError):
            await js.join_next()
    with pytest.raises(ScopeCancelledError):  # SPEC §2.4: completing is refused
        await running.complete("x")
    with pytest.raises(ScopeCancelledError):
        await a.submit(mbx, 5)


# ------------------------------------------------------------------- refused submissions


async def test_refused_submissions_leave_the_set_usable(rs):
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(MBX)
    js = await run.join_sets.create()
    a = await js.submit(mbx, "a")
    with pytest.raises(ValidationError) as ei:
        await js.submit(mbx, "x" * (70 * 1024))  # oversize payload
    assert "65536" in ei.value.message
    with pytest.raises(ValidationError):
        await js.submit(mbx, object())  # not msgpack-able
    with pytest.raises(ValidationError):
        await js.submit(mbx, 1, key="k" * 1000)
    with pytest.raises(ValidationError):
        await js.submit(mbx, 1, deadline=in_(-5))
    with pytest.raises(NotFoundError):
        await js.submit("js-no-such-mailbox", 1)
    with pytest.raises(ValidationError):
        await js.submit_delay(5, at=in_(5))  # both
    with pytest.raises(ValidationError):
        await js.submit_delay()  # neither
    with pytest.raises(ValidationError):
        await js.submit_delay(-1)
    with pytest.raises(ValidationError):
        await js.submit_delay(at="tomorrow-ish")
    st = await js.status()
    assert (st.submitted, st.finished, st.consumed) == (1, 0, 0)
    (d,) = await take(mbx, run, 1)
    await d.complete("A")
    assert await js.join_next(timeout=5) == (a, "A")
    with trio.fail_after(5):
        with pytest.raises(JoinSetExhaustedError):
            await js.join_next()  # neither hangs nor miscounts


async def test_refused_submission_on_an_inactive_run_adds_nothing(rs):
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(MBX)
    js = await run.join_sets.create()
    a = await js.submit(mbx, "a")
    await run.cancel()
    with pytest.raises(ScopeCancelledError):
        await js.submit(mbx, "b")
    with pytest.raises(ScopeCancelledError):
        await js.submit_delay(1)
    with pytest.raises(ScopeCancelledError):
        await run.join_sets.create()
    st = await js.status()
    assert st.submitted == 1 and st.state == "CLOSED"  # the cancel closed it
    with trio.fail_after(5):
        e = await child_error(js.join_next(index=0))  # the closing consume, re-read
        assert e.child_id == a and e.failure_kind == "cancelled"
        with pytest.raises(JoinSetExhaustedError):
            await js.join_next()


async def test_key_makes_a_submission_idempotent(rs):
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(MBX)
    js = await run.join_sets.create()
    a = await js.submit(mbx, {"n": 1}, key="k1")
    assert await js.submit(mbx, {"n": 1}, key="k1") == a
    with pytest.raises(ConflictError):
        await js.submit(mbx, {"n": 2}, key="k1")
    other = await run.join_sets.create()
    with pytest.raises(ConflictError):
        await other.submit(mbx, {"n": 1}, key="k1")  # that task is not other's child
    assert (await js.status()).submitted == 1 and (await other.status()).submitted == 0


# ------------------------------------------------------------------- positional matching


async def test_join_next_index_rereads_and_never_skips_ahead(rs):
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(MBX)
    js = await run.join_sets.create()
    a = await js.submit(mbx, 1)
    b = await js.submit(mbx, 2)
    c = await js.submit(mbx, 3)
    da, db, dc = await take(mbx, run, 3)
    await db.reject("nope")
    await da.complete("A")
    e0 = await child_error(js.join_next(timeout=5))
    assert await js.join_next(timeout=5) == (a, "A")
    e = await child_error(js.join_next(index=0))  # re-reads, raises the same failure
    assert (e.child_id, e.failure_kind, e.value) == (e0.child_id, e0.failure_kind, e0.value) == (b, "failed", "nope")
    assert await js.join_next(index=1) == (a, "A")
    assert (await js.status()).consumed == 2  # re-reads consume nothing
    for ahead in (3, 4):
        with pytest.raises(ValidationError) as ei:
            await js.join_next(index=ahead)
        assert ei.value.code == "VALIDATION_FAILED" and "index" in ei.value.message
    with pytest.raises(ValidationError):
        await js.join_next(index=-1)
    assert await js.join_next_try() is None  # index 2 has not arrived
    await dc.complete("C")
    assert await js.join_next(index=2, timeout=5) == (c, "C")  # index == next consumes
    with pytest.raises(JoinSetExhaustedError):
        await js.join_next(index=3)
    assert [await js.join_next(index=k) for k in (1, 2)] == [(a, "A"), (c, "C")]
    assert (await rs.task(c).status()).outcome == "C"  # readable after consumption


async def test_two_concurrent_waiters_get_distinct_records(rs):
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(MBX)
    js = await run.join_sets.create()
    a = await js.submit(mbx, 1)
    b = await js.submit(mbx, 2)
    got = []
    base = await parked_waits(rs)
    async with trio.open_nursery() as n:

        async def waiter():
            got.append(await js.join_next(timeout=10))

        n.start_soon(waiter)
        n.start_soon(waiter)
        await wait_parked_remote(rs, 2, base=base)  # both wait on the server
        da, db = await take(mbx, run, 2)
        await db.complete("B")
        await da.complete("A")
    assert sorted(got) == sorted([(a, "A"), (b, "B")])
    assert [await js.join_next(index=k) for k in (0, 1)] == [(b, "B"), (a, "A")]


# ------------------------------------------------------------------- restart and replay


def live_coord_state(node, jid: str) -> str:
    return node.coordinator.joinsets.table[jid].state


def _answers(js_sync, n: int) -> list:
    out = []
    for k in range(n):
        try:
            out.append(("ok",) + tuple(js_sync.join_next(index=k)))
        except ChildError as e:
            out.append((e.failure_kind, e.child_id, e.value))
    return out


def test_sigkill_between_submit_and_consume_and_between_consumes(tmp_path):
    """A real daemon, fsync data dir, SIGKILLed twice; re-attach by name and by id."""
    import time

    import rallypoint.sync

    data = str(tmp_path / "data")
    d = Daemon(data, "fsync").start()
    try:
        with rallypoint.sync.connect(d.url) as rs:
            run = rs.scopes.create()
            mbx = rs.mailboxes.ensure(MBX)
            js = run.join_sets.create("restart-me")
            js_id = js.id
            t1 = js.submit(mbx, "t1")
            t2 = js.submit(mbx, "t2")
            dly = js.submit_delay(0.6)  # comes due while the daemon is down
            t3 = js.submit(mbx, "t3", cancellable=False)
            d1 = mbx.receive(run, wait=5)
            d2 = mbx.receive(run, wait=5)
            assert (d1.task_id, d2.task_id) == (t1, t2)
            d2.reject({"code": 7})
            d1.complete("T1")
            assert _answers(js, 0) == []
            run_id = run.id
        d.kill()  # SIGKILL: two records, nothing consumed
        time.sleep(0.7)
        d = Daemon(data, "fsync").start()
        with rallypoint.sync.connect(d.url) as rs:
            js = rs.scope(run_id).join_sets.by_name("restart-me")
            assert js.id == js_id
            st = js.status()
            assert (st.submitted, st.consumed) == (4, 0)
            deadline = time.monotonic() + 5
            while js.status().finished < 3 and time.monotonic() < deadline:
                time.sleep(0.02)  # the delay fires at start-up
            with pytest.raises(ChildError) as ei:
                js.join_next(timeout=5)
            assert (ei.value.child_id, ei.value.failure_kind, ei.value.value) == (t2, "failed", {"code": 7})
            assert js.join_next(timeout=5) == (t1, "T1")
            first = _answers(js, 2)
        d.kill()  # SIGKILL between two consumes
        d = Daemon(data, "fsync").start()
        with rallypoint.sync.connect(d.url) as rs:
            js = rs.scope(run_id).join_sets.by_id(js_id)
            assert js.status().consumed == 2
            assert _answers(js, 2) == first  # identical answers by index
            assert js.join_next(timeout=5) == (dly, None)
            with pytest.raises(WaitTimeout):
                js.join_next(timeout=0.1)
            d3 = rs.mailbox(MBX).receive(run_id, wait=5)
            assert d3.task_id == t3
            d3.complete("T3")
            assert js.join_next(index=3, timeout=5) == (t3, "T3")
            every = _answers(js, 4)
            with pytest.raises(JoinSetExhaustedError):
                js.join_next()
        d.stop()  # graceful: snapshot
        d = Daemon(data, "fsync").start()
        with rallypoint.sync.connect(d.url) as rs:
            js = rs.scope(run_id).join_sets.by_name("restart-me")
            assert _answers(js, 4) == every
            assert js.status().consumed == 4
    finally:
        d.kill()


async def test_replaying_the_journal_gives_the_same_completion_order(tmp_path):
    live = tmp_path / "live"
    async with rallypoint.open_embedded(str(live), durability="fsync") as rs:
        node = rs.node
        run = await rs.scopes.create()
        mbx = await rs.mailboxes.ensure(MBX, max_attempts=2)
        sets = [await run.join_sets.create("replay-a"), await run.join_sets.create()]
        ids = []
        for i in range(12):
            js = sets[i % 2]
            if i % 4 == 3:
                ids.append(await js.submit_delay(0.01 * (12 - i)))
            else:
                ids.append(await js.submit(mbx, i, cancellable=i % 5 != 0))
        ds = [d for d in await mbx.receive(run, wait=5, max_messages=20)]
        for k, d in enumerate(reversed(ds)):
            if k % 3 == 0:
                await d.complete({"k": k})
            elif k % 3 == 1:
                await d.reject(k)
            else:
                await d.retry(k)
            if k == 2:
                await node.snapshotter.snapshot()  # recovery = snapshot + journal tail
        await trio.sleep(0.2)  # the delays fire
        for js in sets:
            for _ in range(2):
                try:
                    await js.join_next(timeout=5)
                except ChildError:
                    pass
        with pytest.raises(WaitTimeout):
            await sets[0].close(timeout=0.2)  # non-cancellable children keep it CLOSING
        assert live_coord_state(node, sets[0].id) == "CLOSING"
        await run.cancel()  # ... until the run's cancel finishes them
        live_coord = node.coordinator
        expected = {
            js.id: (list(live_coord.joinsets.table[js.id].completions), live_coord.joinsets.table[js.id].consumed,
                    live_coord.joinsets.table[js.id].state, live_coord.joinsets.table[js.id].closing_from)
            for js in sets
        }
        assert all(len(v[0]) == 6 for v in expected.values())
        answers = {js.id: [await raw_record(rs, js, k) for k in range(expected[js.id][1])] for js in sets}
        j = live_coord.journal
        await j.wait_durable(j.last_lsn)
        copy = tmp_path / "copy"
        shutil.copytree(live, copy)
    coord = Coordinator()
    rec, info = recover_coordinator(str(copy), coord)
    rec.store.close()
    assert info["replayed"] > 0 and info["snapshot_lsn"] > 0
    for jid, (completions, consumed, state, closing_from) in expected.items():
        js = coord.joinsets.table[jid]
        assert js.completions == completions
        assert (js.consumed, js.state, js.closing_from) == (consumed, state, closing_from)
    rs2 = Client(EmbeddedTransport(Service(coord)))
    async with trio.open_nursery() as n:
        await n.start(coord.run)  # the recovered coordinator's actors answer the re-reads
        for jid, recs in answers.items():
            js = rs2.scope(run.id).join_sets.by_id(jid)
            again = [await raw_record(rs2, js, k) for k in range(len(recs))]
            assert again == recs
        n.cancel_scope.cancel()
