"""Issue 13, items 1, 2, 5, 6: what ends a run does to its join sets, the one
cancellation order, ``complete()`` and a set created while it waits, group edges.

Every input of the issue is a test here, on the embedded client and over TCP (``rs``),
under MockClock where time matters (``ers``), and across a SIGKILL of a real daemon."""

from __future__ import annotations

import pytest
import trio
import trio.testing

import rallypoint.sync
from rallypoint.errors import (
    ChildError,
    ConflictError,
    JoinSetExhaustedError,
    ScopeCancelledError,
)

from _joinset_util import child_error, in_, raw_record, records, take, uniq, until
from conftest import CROSS_TREE, Daemon

ENDS = ["close", "complete", "cancel"]


async def end_run(run, js, how: str) -> None:
    if how == "close":
        await js.close(timeout=5)
    elif how == "complete":
        st = await run.complete(timeout=5)
        assert st.stored_state == "COMPLETED"
    else:
        await run.cancel()


async def joinset_waiters(rs) -> int:
    return (await rs.status()).actors.get("joinsets", {}).get("waiters", 0)


# ---------------------------------------------------------------- item 1


@pytest.mark.parametrize("how", ENDS)
async def test_every_end_of_a_run_closes_its_set_with_the_same_sequence(rs, how):
    """Run P, set s with two cancellable task children, nobody called join_next. Ending
    P by a close, a return or a cancel leaves the same records: a closing consume per
    child, in reverse submission order, and the set CLOSED in that same step."""
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(uniq("ends"))
    js = await run.join_sets.create("s")
    a = await js.submit(mbx, "a")
    b = await js.submit(mbx, "b")
    await end_run(run, js, how)
    st = await js.status()  # no waiting: the end's own step closed it
    assert (st.state, st.submitted, st.finished, st.consumed) == ("CLOSED", 2, 2, 2)
    assert await records(rs, js, 2) == [(b, False, "cancelled", True), (a, False, "cancelled", True)]
    with trio.fail_after(5):
        with pytest.raises(JoinSetExhaustedError):
            await js.join_next()
        with pytest.raises(JoinSetExhaustedError):
            await js.join_next_try()


@pytest.mark.parametrize("how", ENDS)
async def test_a_consumer_parked_in_join_next_is_answered_by_every_end(rs, how):
    """The same input with one consumer parked in join_next: whichever way P ends, the
    consumer gets the record it waited for (the first closing consume, marked closing),
    and the other child's record is consumed by the close."""
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(uniq("ends"))
    js = await run.join_sets.create("s")
    a = await js.submit(mbx, "a")
    b = await js.submit(mbx, "b")
    got: list = []
    before = await joinset_waiters(rs)

    async def consumer():
        try:
            got.append(await js.join_next(timeout=30))
        except ChildError as e:
            got.append(e)

    async with trio.open_nursery() as n:
        n.start_soon(consumer)

        async def parked():
            return await joinset_waiters(rs) > before

        await until(parked, "the consumer parked")
        await end_run(run, js, how)
    (e,) = got
    assert isinstance(e, ChildError)
    assert (e.child_id, e.failure_kind, e.details["closing"]) == (b, "cancelled", True)
    st = await js.status()
    assert (st.state, st.consumed) == ("CLOSED", 2)
    assert await records(rs, js, 2) == [(b, False, "cancelled", True), (a, False, "cancelled", True)]


def test_sigkill_between_the_cancel_and_the_next_consume(tmp_path):
    """A real daemon (fsync), three runs ended by close, return and cancel; SIGKILL
    right after the cancel; after the restart every set is CLOSED with the same records
    as before, and the next consume is JOIN_SET_EXHAUSTED."""
    data = str(tmp_path / "data")
    d = Daemon(data, "fsync").start()
    try:
        seen = {}
        with rallypoint.sync.connect(d.url) as rs:
            mbx = rs.mailboxes.ensure("ends-restart")
            for how in ENDS:
                run = rs.scopes.create()
                js = run.join_sets.create("s")
                a = js.submit(mbx, "a")
                b = js.submit(mbx, "b")
                if how == "close":
                    js.close(timeout=5)
                elif how == "complete":
                    run.complete(timeout=5)
                else:
                    run.cancel()
                seen[how] = (run.id, js.id, [b, a])
        d.kill()
        d = Daemon(data, "fsync").start()
        with rallypoint.sync.connect(d.url) as rs:
            sequences = []
            for how, (run_id, js_id, order) in seen.items():
                js = rs.scope(run_id).join_sets.by_name("s")
                assert js.id == js_id
                st = js.status()
                assert (st.state, st.consumed, st.finished) == ("CLOSED", 2, 2), how
                seq = []
                for k in range(2):
                    with pytest.raises(ChildError) as ei:
                        js.join_next(index=k)
                    seq.append((ei.value.child_id, ei.value.failure_kind, ei.value.details["closing"]))
                assert seq == [(order[0], "cancelled", True), (order[1], "cancelled", True)], how
                sequences.append([s[1:] for s in seq])
                with pytest.raises(JoinSetExhaustedError):
                    js.join_next(timeout=5)
            assert sequences[0] == sequences[1] == sequences[2]  # a return, a close, a cancel: one sequence
    finally:
        d.kill()


# ---------------------------------------------------------------- item 2


@pytest.mark.parametrize("how", ENDS)
async def test_every_path_cancels_children_in_reverse_submission_order(rs, how):
    """Tasks and delays interleaved, one task held by a worker: an explicit close, a
    return and a cancel all cancel in reverse submission order (not tasks first, then
    delays)."""
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(uniq("order"))
    js = await run.join_sets.create()
    t1 = await js.submit(mbx, 1)
    d1 = await js.submit_delay(100)
    t2 = await js.submit(mbx, 2)
    d2 = await js.submit_delay(at=in_(200))
    t3 = await js.submit(mbx, 3)
    await take(mbx, run, 2)  # t1 and t2 are RUNNING
    await end_run(run, js, how)
    assert [r[0] for r in await records(rs, js, 5)] == [t3, d2, t2, d1, t1]


async def test_a_deadline_cancels_in_reverse_submission_order_too(autojump_clock, ers):
    run = await ers.scopes.create(deadline=in_(10))
    mbx = await ers.mailboxes.ensure("order")
    js = await run.join_sets.create()
    t1 = await js.submit(mbx, 1)
    nc = await js.submit(mbx, 2, cancellable=False)
    d1 = await js.submit_delay(100)
    t2 = await js.submit(mbx, 3)
    await take(mbx, run, 2)
    await trio.sleep(11)
    st = await js.status()
    assert (st.state, st.consumed) == ("CLOSED", 4)
    assert await records(ers, js, 4) == [
        (t2, False, "cancelled", True), (d1, False, "cancelled", True),
        (nc, False, "cancelled", True), (t1, False, "cancelled", True),
    ]


@pytest.mark.parametrize("how", ["close", "complete"])
async def test_close_and_return_cancel_in_reverse_order_and_await_the_non_cancellable(rs, how):
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(uniq("order"))
    js = await run.join_sets.create()
    t1 = await js.submit(mbx, 1)
    nc = await js.submit(mbx, 2, cancellable=False)
    d1 = await js.submit_delay(100)
    t2 = await js.submit(mbx, 3)
    _, dnc = await take(mbx, run, 2)
    assert dnc.task_id == nc
    async with trio.open_nursery() as n:
        n.start_soon(end_run, run, js, how)

        async def closing():
            return (await js.status()).state == "CLOSING"

        await until(closing, "the set is closing")
        assert [r[0] for r in await records(rs, js, 3)] == [t2, d1, t1]
        await dnc.complete("N")
    assert await records(rs, js, 4) == [
        (t2, False, "cancelled", True), (d1, False, "cancelled", True),
        (t1, False, "cancelled", True), (nc, True, None, True),
    ]


# ---------------------------------------------------------------- item 5


async def test_complete_closes_a_set_created_while_it_waits_and_returns_at_once(rs):
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(uniq("late-set"))
    first = await run.join_sets.create("first")
    nc = await first.submit(mbx, "nc", cancellable=False)
    (dnc,) = await take(mbx, run, 1)
    result = {}

    async def completer():
        result["st"] = await run.complete(timeout=120)

    async with trio.open_nursery() as n:
        n.start_soon(completer)

        async def closing():
            return (await first.status()).state == "CLOSING"

        await until(closing, "complete() closed the first set")
        late = await run.join_sets.create("late")
        assert (await late.status()).state == "CLOSED"  # the waiting complete() closed it too
        with pytest.raises(ConflictError):
            await late.submit(mbx, "too late")
        with trio.fail_after(10):  # the bug: ~59 s, until the complete's wait ran out
            await dnc.complete("N")
            while "st" not in result:
                await trio.sleep(0.005)
    assert result["st"].stored_state == "COMPLETED"
    assert await first.join_next(index=0) == (nc, "N")


async def test_complete_with_a_set_created_while_it_waits_takes_no_time(autojump_clock, ers):
    run = await ers.scopes.create()
    mbx = await ers.mailboxes.ensure("late-set")
    first = await run.join_sets.create()
    await first.submit(mbx, "nc", cancellable=False)
    (dnc,) = await take(mbx, run, 1)
    done = trio.Event()

    async def completer():
        await run.complete(timeout=600)
        done.set()

    async with trio.open_nursery() as n:
        n.start_soon(completer)
        await trio.testing.wait_all_tasks_blocked()
        late = await run.join_sets.create()
        assert (await late.status()).state == "CLOSED"
        t0 = trio.current_time()
        await dnc.complete("N")
        await done.wait()
        assert trio.current_time() - t0 < 0.5  # not the rest of a 60 s server wait


# ---------------------------------------------------------------- item 6


async def test_group_submit_with_the_key_of_a_plain_task_of_the_gate_run_is_conflict(rs):
    mbx = await rs.mailboxes.ensure(uniq("grp-edge"))
    run = await rs.scopes.create()
    g = await run.groups.create(mbx, "N_ACCEPTED", threshold=1)
    plain = await mbx.submit({"x": 1}, key="k", scope=g.scope_id)  # a task of the gate run, not a member
    with pytest.raises(ConflictError) as ei:
        await g.submit({"x": 1}, key="k")
    assert plain.id in ei.value.message and ei.value.details["task_id"] == plain.id
    st = await g.status()
    assert st.counts["members"] == 0 and st.members == []


@pytest.mark.not_in_cluster(CROSS_TREE)
async def test_groups_create_needs_the_calling_run_active_even_with_another_parent(rs):
    mbx = await rs.mailboxes.ensure(uniq("grp-edge"))
    cancelled = await rs.scopes.create()
    active = await rs.scopes.create()
    await cancelled.cancel()
    with pytest.raises(ScopeCancelledError) as ei:
        await cancelled.groups.create(mbx, "FIRST_ACCEPTED", parent_scope_id=active)
    assert ei.value.details["scope_id"] == cancelled.id
    assert (await active.status()).children == 0  # no gate run was made


async def test_a_consumer_parked_before_the_cancel_then_the_record_reread(rs):
    """After the parked consumer was answered, re-reading index 0 gives the same record."""
    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(uniq("ends"))
    js = await run.join_sets.create()
    a = await js.submit(mbx, "a")
    got = []
    before = await joinset_waiters(rs)

    async def consumer():
        got.append(await child_error(js.join_next(timeout=30)))

    async with trio.open_nursery() as n:
        n.start_soon(consumer)

        async def parked():
            return await joinset_waiters(rs) > before

        await until(parked, "parked")
        await run.cancel()
    assert got[0].child_id == a
    r = await raw_record(rs, js, 0)
    assert (r.child_id, r.failure_kind, r.closing) == (a, "cancelled", True)
