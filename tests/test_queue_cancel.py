"""Cancelling a run reaches every task state at once (SPEC §2, §3), under the MockClock."""

import pytest
import trio

from rallypoint.errors import LeaseLostError, ScopeCancelledError, ScopeInactiveError


async def test_cancel_reaches_queued_leased_delayed_and_completed(autojump_clock, ers):
    coord = ers.node.coordinator
    m = await ers.mailboxes.ensure("cancel-all", max_attempts=5)
    run = await ers.scopes.create()
    child = await run.child()
    completed = await m.submit("done", scope=run)
    delayed = await m.submit("delayed", scope=child)
    leased = await m.submit("leased", scope=child)
    queued = await m.submit("queued", scope=child)
    ds = await m.receive(run, lease_seconds=30, wait=0, max_messages=3)
    held = {d.task_id: d for d in ds}
    await held[completed.id].complete({"kept": True})
    await held[delayed.id].retry("later", delay=20)
    assert (await delayed.status()).state == "QUEUED"
    before = {t.id: (await t.status()) for t in (completed, delayed, leased, queued)}

    await trio.sleep(1)
    st = await run.cancel(reason="stop")
    assert st.tasks == {"SUCCEEDED": 1}  # counts are per run
    assert (await child.status()).tasks == {"CANCELLED": 3}
    for t in (delayed, leased, queued):
        res = await t.status()
        assert (res.state, res.outcome_reason, res.attempt) == ("CANCELLED", "scope_cancelled", before[t.id].attempt)
        assert t.id not in coord.queues.ready_set
    res = await completed.result(timeout=0)  # recorded results stay readable
    assert (res.state, res.outcome) == ("SUCCEEDED", {"kept": True})
    mi = await m.status()
    assert (mi.queued, mi.running) == (0, 0)

    # the leased task's holder: renew refused (lease lost), complete refused,
    # retry and reject answered without a change
    d = held[leased.id]
    with pytest.raises((LeaseLostError, ScopeInactiveError)):
        await d.renew()
    assert d.lost
    with pytest.raises((LeaseLostError, ScopeInactiveError)):
        await d.complete("nope")
    assert (await d.retry("back")).state == "CANCELLED"
    assert (await d.reject("give up")).state == "CANCELLED"
    assert (await leased.status()).state == "CANCELLED"

    # the retry scheduled before the cancel never runs after it: go past its due time
    # and past every lease; nothing is delivered, nothing changes
    await trio.sleep(120)
    for t in (delayed, leased, queued):
        res = await t.status()
        assert (res.state, res.attempt) == ("CANCELLED", before[t.id].attempt)
    assert not any(tid in coord.queues.ready_set for tid in (delayed.id, leased.id, queued.id))
    for per_run in coord.queues.ready_index.entries().values():
        for ids in per_run.values():
            assert not (set(ids) & {delayed.id, leased.id, queued.id})
    with pytest.raises(ScopeCancelledError):
        await m.receive(child, wait=0)
    # another run on the same mailbox sees none of them
    other = await ers.scopes.create()
    o = await m.submit("other", scope=other)
    got = await m.receive(other, wait=0, max_messages=10)
    assert [g.task_id for g in got] == [o.id]


async def test_delayed_retry_in_cancelled_run_never_delivered_to_ancestor_receiver(autojump_clock, ers):
    # Cancel only the child: a receiver on the (still active) parent must never get the
    # child's delayed retry when it comes due.
    m = await ers.mailboxes.ensure("cancel-child")
    parent = await ers.scopes.create()
    child = await parent.child()
    t = await m.submit("x", scope=child)
    d = await m.receive(parent, wait=0)
    await d.retry(delay=10)
    await child.cancel()
    got = await m.receive(parent, wait=30)  # waits through the retry's due time
    assert got is None
    st = await t.status()
    assert (st.state, st.attempt) == ("CANCELLED", 2)


async def test_cancel_is_atomic_with_a_waiting_receiver_and_results(autojump_clock, ers):
    m = await ers.mailboxes.ensure("cancel-waiters")
    run = await ers.scopes.create()
    t = await m.submit("x", scope=run)
    d = await m.receive(run, wait=0)
    seen = {}

    async def result_waiter():
        seen["result"] = await t.result(timeout=100)

    async def receiver():
        try:
            await m.receive(run, wait=100)
        except ScopeCancelledError as e:
            seen["receive"] = e.code

    async with trio.open_nursery() as n:
        n.start_soon(result_waiter)
        n.start_soon(receiver)
        await trio.sleep(5)
        await run.cancel()
    assert seen["receive"] == "SCOPE_CANCELLED"
    assert seen["result"].state == "CANCELLED"
    with pytest.raises((LeaseLostError, ScopeInactiveError)):
        await d.renew()


async def test_deadline_of_run_cancels_its_tasks(autojump_clock, ers):
    from datetime import datetime, timedelta, timezone

    from rallypoint.errors import DeadlineExceededError

    m = await ers.mailboxes.ensure("run-deadline")
    run = await ers.scopes.create(deadline=datetime.now(timezone.utc) + timedelta(seconds=30))
    q = await m.submit("q", scope=run)
    r = await m.submit("r", scope=run)
    d = await m.receive(run, wait=0)
    assert d.task_id == q.id
    await trio.sleep(31)
    for t in (q, r):
        st = await t.status()
        assert (st.state, st.outcome_reason) == ("CANCELLED", "deadline")
    with pytest.raises(DeadlineExceededError):
        await m.submit("late", scope=run)
    with pytest.raises(DeadlineExceededError):
        await m.receive(run, wait=0)
    with pytest.raises((LeaseLostError, ScopeInactiveError)):
        await d.renew()
