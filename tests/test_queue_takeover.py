"""Leases under the MockClock: takeover after expiry, fencing, deadlines, retry delays."""

from datetime import datetime, timedelta, timezone

import pytest
import trio

from rallypoint.errors import LeaseLostError, ValidationError


def in_(seconds: float) -> datetime:
    return datetime.now(timezone.utc) + timedelta(seconds=seconds)


async def test_takeover_race_stale_holder_is_fenced_off(autojump_clock, ers):
    coord = ers.node.coordinator
    m = await ers.mailboxes.ensure("takeover")
    run = await ers.scopes.create()
    ticket = await m.submit({"job": 1}, scope=run)

    a = await m.receive(run, lease_seconds=5, wait=0)  # worker A
    assert (a.task_id, a.token, a.attempt) == (ticket.id, 1, 1)
    await trio.sleep(3)
    await a.renew()  # still A's: the lease now runs to t=8
    await trio.sleep(4.9)
    assert await m.receive(run, wait=0) is None  # not yet expired
    await trio.sleep(0.2)  # A's lease expires; the task is back in the queue
    st = await ticket.status()
    assert (st.state, st.attempt) == ("QUEUED", 2)
    # before anyone takes it over, A's token is current but its lease is gone
    with pytest.raises(LeaseLostError):
        await a.complete("A, late")

    b = await m.receive(run, lease_seconds=5, wait=0)  # worker B takes over
    assert b.task_id == ticket.id and b.token > a.token and b.attempt == 2
    for call in (lambda: a.complete("A"), a.renew, lambda: a.retry("A"), lambda: a.reject("A")):
        with pytest.raises(LeaseLostError) as ei:
            await call()
        assert ei.value.code == "STALE_CLAIM"
    assert (await ticket.status()).state == "RUNNING"  # A changed nothing
    await b.renew()
    assert (await b.complete("B")).state == "SUCCEEDED"
    with pytest.raises(LeaseLostError):
        await a.complete("A after B")
    with pytest.raises(LeaseLostError):
        await b.complete("B twice")
    res = await ticket.result(timeout=0)
    assert (res.state, res.outcome, res.attempt) == ("SUCCEEDED", "B", 2)
    assert coord.queues.tasks[ticket.id].token == b.token
    await trio.sleep(60)  # B's old lease timer fires and must change nothing
    assert (await ticket.result(timeout=0)).outcome == "B"


async def test_concurrent_complete_race_records_one_outcome(autojump_clock, ers):
    # A (stale) and B (current) complete at the same instant, in both orders.
    m = await ers.mailboxes.ensure("race")
    run = await ers.scopes.create()
    for first in ("A", "B"):
        t = await m.submit(first, scope=run)
        a = await m.receive(run, lease_seconds=5, wait=0)
        await trio.sleep(5.01)
        b = await m.receive(run, lease_seconds=5, wait=0)
        results = {}

        async def finish(name, d):
            try:
                results[name] = (await d.complete(name)).outcome
            except LeaseLostError:
                results[name] = "STALE"

        async with trio.open_nursery() as n:
            for name, d in ((first, a if first == "A" else b), ("B" if first == "A" else "A", b if first == "A" else a)):
                n.start_soon(finish, name, d)
        assert results == {"A": "STALE", "B": "B"}
        assert (await t.result(timeout=0)).outcome == "B"


async def test_tokens_strictly_increase_across_takeovers(autojump_clock, ers):
    m = await ers.mailboxes.ensure("tokens", max_attempts=10)
    run = await ers.scopes.create()
    ticket = await m.submit("x", scope=run)
    tokens = []
    for i in range(6):
        d = await m.receive(run, lease_seconds=5, wait=10)
        tokens.append(d.token)
        assert d.attempt == i + 1
        if i % 2:
            await d.retry()
        # else: let the lease expire (the receive above waits for the requeue)
    assert tokens == sorted(tokens) and len(set(tokens)) == 6
    assert (await ticket.status()).state in ("RUNNING", "QUEUED")


async def test_lease_expiry_counts_as_an_attempt_then_failed(autojump_clock, ers):
    m = await ers.mailboxes.ensure("expire-max", max_attempts=2)
    run = await ers.scopes.create()
    ticket = await m.submit("x", scope=run)
    d1 = await m.receive(run, lease_seconds=5, wait=0)
    await trio.sleep(6)
    d2 = await m.receive(run, lease_seconds=5, wait=0)
    assert (d2.attempt, d2.token) == (2, d1.token + 1)
    await trio.sleep(6)
    res = await ticket.result(timeout=0)
    assert (res.state, res.outcome_reason, res.attempt) == ("FAILED", "lease_expired", 2)
    with pytest.raises(LeaseLostError):
        await d2.renew()


async def test_retry_delay_holds_the_task_until_due(autojump_clock, ers):
    m = await ers.mailboxes.ensure("delay")
    run = await ers.scopes.create()
    a = await m.submit("a", scope=run)
    d = await m.receive(run, wait=0)
    await d.retry(delay=30)
    b = await m.submit("b", scope=run)
    # b is eligible now, a only after 30 s
    assert (await m.receive(run, wait=0)).task_id == b.id
    assert await m.receive(run, wait=0) is None
    t0 = trio.current_time()
    d2 = await m.receive(run, wait=60)  # long-poll woken when the delay ends
    assert d2.task_id == a.id and d2.attempt == 2
    assert 29.9 <= trio.current_time() - t0 <= 30.1
    with pytest.raises(ValidationError):
        await d2.retry(delay=-1)


async def test_task_deadline_expires_it(autojump_clock, ers):
    m = await ers.mailboxes.ensure("deadline")
    run = await ers.scopes.create()
    queued = await m.submit("q", scope=run, deadline=in_(10))
    running = await m.submit("r", scope=run, deadline=in_(10))
    finished = await m.submit("f", scope=run, deadline=in_(10))
    await queued.cancel()  # take it out of the way for a moment: receive the other two
    ds = await m.receive(run, lease_seconds=60, wait=0, max_messages=2)
    assert {d.task_id for d in ds} == {running.id, finished.id}
    held = {d.task_id: d for d in ds}
    await held[finished.id].complete("in time")
    q2 = await m.submit("q2", scope=run, deadline=in_(10))
    with pytest.raises(ValidationError):
        await m.submit("past", scope=run, deadline=in_(-1))
    await trio.sleep(10.5)
    assert (await q2.result(timeout=0)).state == "EXPIRED"
    res = await running.result(timeout=0)
    assert (res.state, res.outcome_reason) == ("EXPIRED", "deadline")
    with pytest.raises(LeaseLostError):
        await held[running.id].complete("too late")
    assert (await finished.result(timeout=0)).state == "SUCCEEDED"
    assert await m.receive(run, wait=0) is None


async def test_result_timeout_under_mock_clock(autojump_clock, ers):
    m = await ers.mailboxes.ensure("result-wait")
    run = await ers.scopes.create()
    ticket = await m.submit("x", scope=run)
    from rallypoint.errors import WaitTimeout

    t0 = trio.current_time()
    with pytest.raises(WaitTimeout):
        await ticket.result(timeout=150)  # re-issued past the 60 s server limit
    assert 149.9 <= trio.current_time() - t0 <= 150.1
    assert (await ticket.status()).state == "QUEUED"
