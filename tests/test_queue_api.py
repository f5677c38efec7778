"""Mailboxes, tasks and deliveries (SPEC §3) through the SDK, embedded and over TCP.

Time-dependent behaviour (lease expiry, deadlines, retry delays) is in
test_queue_takeover.py / test_queue_cancel.py under the MockClock.
"""

import uuid

import msgspec
import pytest
import trio

from rallypoint import protocol as p
from rallypoint.client import types as client_types
from rallypoint.errors import (
    ConflictError,
    LeaseLostError,
    LimitError,
    NotFoundError,
    ScopeCancelledError,
    ScopeInactiveError,
    ValidationError,
    WaitTimeout,
)

from conftest import parked_waits, until, wait_parked_remote


def uniq(prefix: str = "q") -> str:
    """Mailbox names are per space and the TCP daemon is shared by the session."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


# --------------------------------------------------------------------- mailboxes
async def test_ensure_creates_then_checks_settings(rs):
    name = uniq()
    m = await rs.mailboxes.ensure(name, max_attempts=3, backlog_limit=10)
    again = await rs.mailboxes.ensure(name, max_attempts=3, backlog_limit=10)
    assert m.info.id == again.info.id and m.info.id.startswith("mbx_")
    with pytest.raises(ConflictError) as ei:
        await rs.mailboxes.ensure(name, max_attempts=4, backlog_limit=10)
    assert "max_attempts" in ei.value.message and ei.value.details["field"] == "max_attempts"
    with pytest.raises(ConflictError) as ei:
        await rs.mailboxes.ensure(name, max_attempts=3, backlog_limit=11)
    assert "backlog_limit" in ei.value.message
    with pytest.raises(ConflictError) as ei:
        await rs.mailboxes.ensure(name, mode="INBOX")
    assert ei.value.details["field"] == "mode"
    got = await rs.mailboxes.get(name)
    assert (got.info.id, got.info.max_attempts, got.info.backlog_limit) == (m.info.id, 3, 10)
    assert name in {i.name for i in await rs.mailboxes.list()}
    with pytest.raises(NotFoundError):
        await rs.mailboxes.get(uniq("missing"))
    with pytest.raises(ValidationError) as ei:
        await rs.mailboxes.ensure(uniq(), mode="BROADCAST")
    assert "mode" in ei.value.message
    with pytest.raises(ValidationError):
        await rs.mailboxes.ensure("bad name")


async def test_ensure_without_settings_takes_the_existing_mailbox(rs):
    # Issue 31 item 10: a producer's ensure(name) -- no settings -- on a mailbox its
    # worker made with other settings is a handle on it, not CONFLICT; only the settings
    # given are checked; a mailbox made by ensure(name) gets the defaults.
    name = uniq()
    made = await rs.mailboxes.ensure(name, max_attempts=3, backlog_limit=10)
    handle = await rs.mailboxes.ensure(name)
    assert (handle.info.id, handle.info.mode, handle.info.max_attempts, handle.info.backlog_limit) == (
        made.info.id, "WORK", 3, 10)
    assert (await rs.mailboxes.ensure(name, max_attempts=3)).info.id == made.info.id  # checked, equal
    with pytest.raises(ConflictError) as ei:
        await rs.mailboxes.ensure(name, max_attempts=5)  # given: checked
    assert ei.value.details == {"field": "max_attempts", "existing": 3}
    inbox = await rs.mailboxes.ensure(uniq(), mode="INBOX", max_attempts=2)
    assert (await rs.mailboxes.ensure(inbox.name)).info.mode == "INBOX"
    fresh = await rs.mailboxes.ensure(uniq())
    assert (fresh.info.mode, fresh.info.max_attempts, fresh.info.backlog_limit) == ("WORK", 5, None)


async def test_full_backlog_refuses_with_retry_after(rs):
    run = await rs.scopes.create()
    m = await rs.mailboxes.ensure(uniq(), backlog_limit=2)
    await m.submit(1, scope=run)
    await m.submit(2, scope=run)
    with pytest.raises(LimitError) as ei:
        await m.submit(3, scope=run)
    assert ei.value.code == "LIMIT_EXCEEDED" and ei.value.retry_after and ei.value.retry_after > 0
    # a running task still counts; a finished one frees a slot
    d = await m.receive(run, wait=0)
    with pytest.raises(LimitError):
        await m.submit(3, scope=run)
    await d.complete("ok")
    await m.submit(3, scope=run)
    assert (await m.status()).queued == 2


async def test_submit_many_respects_backlog_all_or_nothing(rs):
    run = await rs.scopes.create()
    m = await rs.mailboxes.ensure(uniq(), backlog_limit=3)
    await m.submit(0, scope=run)
    with pytest.raises(LimitError):
        await m.submit_many([1, 2, 3], scope=run)
    assert (await m.status()).queued == 1
    assert len(await m.submit_many([1, 2], scope=run)) == 2


# --------------------------------------------------------------------- tasks
async def test_idempotency_key(rs):
    run = await rs.scopes.create()
    m = await rs.mailboxes.ensure(uniq())
    a = await m.submit({"n": 1, "z": [1, 2]}, key="k1", scope=run)
    b = await m.submit({"z": [1, 2], "n": 1}, key="k1", scope=run)  # same value, other dict order
    assert a.id == b.id
    with pytest.raises(ConflictError) as ei:
        await m.submit({"n": 2}, key="k1", scope=run)
    assert "key" in ei.value.message
    other_run = await rs.scopes.create()
    c = await m.submit({"n": 2}, key="k1", scope=other_run)  # the key is per run and mailbox
    assert c.id != a.id
    assert (await m.status()).queued == 2


async def test_submit_many_duplicate_key_in_one_batch_is_one_task(rs):
    run = await rs.scopes.create()
    m = await rs.mailboxes.ensure(uniq())
    ts = await m.submit_many(["x", "x", "y"], keys=["k", "k", None], scope=run)
    assert ts[0].id == ts[1].id != ts[2].id
    assert (await m.status()).queued == 2
    assert (await run.status()).tasks == {"QUEUED": 2}
    with pytest.raises(ConflictError):
        await m.submit_many(["x", "other"], keys=["k2", "k2"], scope=run)


async def test_submit_many_is_all_or_nothing(rs):
    run = await rs.scopes.create()
    m = await rs.mailboxes.ensure(uniq())
    await m.submit("first", key="taken", scope=run)
    with pytest.raises(ConflictError) as ei:
        await m.submit_many(["a", "b", "different"], keys=["a", "b", "taken"], scope=run)
    assert "items[2].key" in ei.value.message
    with pytest.raises(ValidationError) as ei:
        await m.submit_many(["a", "x" * 70_000], scope=run)
    assert "items[1].input" in ei.value.message and "65536" in ei.value.message
    assert (await m.status()).queued == 1
    ts = await m.submit_many([{"i": i} for i in range(5)], scope=run)
    assert [t.info.state for t in ts] == ["QUEUED"] * 5
    ds = await m.receive(run, wait=0, max_messages=10)
    assert [d.input for d in ds] == ["first"] + [{"i": i} for i in range(5)]


async def test_empty_batches_are_no_ops_in_the_sdk(rs):
    """submit_many([]), complete_many([]) and results([]) all return [] (no request);
    the wire op itself still refuses an empty batch."""
    run = await rs.scopes.create()
    m = await rs.mailboxes.ensure(uniq())
    assert await m.submit_many([], scope=run) == []
    assert await m.submit_many([], scope=run, details=False) == []
    assert await m.complete_many([]) == []
    assert await rs.results([]) == []
    assert (await m.status()).queued == 0
    with pytest.raises(ValidationError) as ei:
        await rs._call(p.TaskSubmitMany(mailbox=m.name, scope_id=run.id, items=[]), client_types._TaskList)
    assert "1 to 1000" in ei.value.message


async def test_lifecycle_submit_receive_complete_result(rs):
    run = await rs.scopes.create()
    m = await rs.mailboxes.ensure(uniq())
    ticket = await m.submit({"job": 7}, scope=run)
    assert (await ticket.status()).state == "QUEUED"
    d = await m.receive(run, lease_seconds=10, wait=1)
    assert (d.task_id, d.input, d.attempt, d.token) == (ticket.id, {"job": 7}, 1, 1)
    assert d.id.startswith("dlv_") and d.lease_expires_at is not None
    st = await ticket.status()
    assert st.state == "RUNNING"
    assert (await m.status()).running == 1
    await d.renew()
    done = await d.complete({"answer": 42})
    assert done.state == "SUCCEEDED"
    res = await ticket.result(timeout=5)
    assert (res.state, res.outcome, res.outcome_reason, res.attempt) == ("SUCCEEDED", {"answer": 42}, "completed", 1)
    # the first valid complete wins; every later one is STALE_CLAIM
    with pytest.raises(LeaseLostError) as ei:
        await d.complete("again")
    assert ei.value.code == "STALE_CLAIM"
    assert (await ticket.result()).outcome == {"answer": 42}
    # re-attach by id
    assert (await run.task(ticket.id).status()).outcome == {"answer": 42}
    assert (await rs.task(ticket.id).result(timeout=0)).state == "SUCCEEDED"


async def test_delivery_key_and_task_subscribers_reach_sdk_users(rs):
    # Both were in the protocol views and silently dropped by the hand-kept SDK copies
    # (issue 28): the SDK's types are now generated from the views.
    run = await rs.scopes.create()
    m = await rs.mailboxes.ensure(uniq())
    keyed = await m.submit("a", scope=run, key="order-17")
    plain = await m.submit("b", scope=run)
    ds = await m.receive(run, wait=1, max_messages=2)
    by_task = {d.task_id: d for d in ds}
    assert (by_task[keyed.id].key, by_task[keyed.id].info.key) == ("order-17", "order-17")
    assert by_task[plain.id].key is None
    sub = await rs._call(p.TaskSubscribe(task_id=keyed.id, subscriber_id="watcher-1", scope_id=run.id),
                         client_types.TaskInfo)
    assert sub.subscribers == ["watcher-1"]
    st = await keyed.status()
    assert (st.subscribers, st.key) == (["watcher-1"], "order-17")
    assert (await plain.status()).subscribers == []
    await rs._call(p.TaskDetach(task_id=keyed.id, subscriber_id="watcher-1"), client_types.TaskInfo)
    assert (await keyed.status()).subscribers == []


async def test_result_waits_on_the_server_and_timeout_changes_nothing(rs):
    run = await rs.scopes.create()
    m = await rs.mailboxes.ensure(uniq())
    ticket = await m.submit("t", scope=run)
    with trio.fail_after(5):
        with pytest.raises(WaitTimeout):
            await ticket.result(timeout=0.2)
    assert (await ticket.status()).state == "QUEUED"
    got = {}

    async def waiter():
        got["r"] = await ticket.result(timeout=10)

    base = await parked_waits(rs)
    async with trio.open_nursery() as n:
        n.start_soon(waiter)
        d = await m.receive(run, wait=1)
        await wait_parked_remote(rs, 1, base=base)  # the result wait is parked on the server
        assert "r" not in got
        await d.complete("fin")
    assert got["r"].state == "SUCCEEDED" and got["r"].outcome == "fin"


async def test_receive_long_waits_for_a_submit(rs):
    run = await rs.scopes.create()
    m = await rs.mailboxes.ensure(uniq())
    got = {}

    async def receiver():
        got["d"] = await m.receive(run, wait=10)

    base = await parked_waits(rs)
    async with trio.open_nursery() as n:
        n.start_soon(receiver)
        await wait_parked_remote(rs, 1, base=base)  # the receive is parked: the submit comes later
        with trio.fail_after(5):  # and wakes it (long before its 10 s)
            t = await m.submit("late", scope=run)
            await until(lambda: "d" in got)
    assert got["d"].task_id == t.id
    assert await m.receive(run, wait=0) is None
    assert await m.receive(run, wait=0, max_messages=5) == []


async def test_retry_requeues_with_next_attempt_then_failed_after_max(rs):
    run = await rs.scopes.create()
    m = await rs.mailboxes.ensure(uniq(), max_attempts=3)
    ticket = await m.submit("flaky", scope=run)
    tokens = []
    for attempt in (1, 2, 3):
        d = await m.receive(run, wait=1)
        assert d.attempt == attempt
        tokens.append(d.token)
        r = await d.retry(error={"why": attempt})
        assert r.state == ("QUEUED" if attempt < 3 else "FAILED")
        assert r.error == {"why": attempt}
    assert tokens == sorted(set(tokens))  # strictly increasing
    res = await ticket.result(timeout=1)
    assert (res.state, res.outcome_reason, res.attempt) == ("FAILED", "max_attempts", 3)
    assert await m.receive(run, wait=0) is None
    # the retried delivery's token is stale now
    with pytest.raises(LeaseLostError):
        await d.renew()


async def test_reject_fails_at_once(rs):
    run = await rs.scopes.create()
    m = await rs.mailboxes.ensure(uniq(), max_attempts=5)
    ticket = await m.submit("bad", scope=run)
    d = await m.receive(run, wait=1)
    r = await d.reject({"reason": "malformed"})
    assert (r.state, r.outcome_reason, r.error) == ("FAILED", "rejected", {"reason": "malformed"})
    with pytest.raises(LeaseLostError):
        await d.complete("late")
    assert (await ticket.status()).state == "FAILED"


async def test_wrong_token_is_stale_and_changes_nothing(rs):
    run = await rs.scopes.create()
    m = await rs.mailboxes.ensure(uniq())
    ticket = await m.submit("x", scope=run)
    d = await m.receive(run, wait=1)
    real = d.token
    for forged in (real + 1, real - 1, 0):
        d.token = forged
        for call in (d.renew, lambda: d.complete("forged"), d.retry, lambda: d.reject("forged")):
            with pytest.raises(LeaseLostError) as ei:
                await call()
            assert ei.value.code == "STALE_CLAIM"
    assert d.lost
    st = await ticket.status()
    assert (st.state, st.attempt, st.outcome) == ("RUNNING", 1, None)
    d.token = real
    assert (await d.complete("real")).outcome == "real"


async def test_ticket_cancel_and_holder_loses_lease(rs):
    run = await rs.scopes.create()
    m = await rs.mailboxes.ensure(uniq())
    queued = await m.submit("q", scope=run)
    running = await m.submit("r", scope=run)
    assert (await queued.cancel()).state == "CANCELLED"
    d = await m.receive(run, wait=1)
    assert d.task_id == running.id  # the cancelled one is never delivered
    assert (await running.cancel()).state == "CANCELLED"
    with pytest.raises(LeaseLostError):
        await d.renew()
    with pytest.raises(LeaseLostError):
        await d.complete("too late")
    assert (await running.cancel()).state == "CANCELLED"  # no-op on a finished task
    res = await running.result(timeout=0)
    assert (res.state, res.outcome) == ("CANCELLED", None)


async def test_receive_serves_run_and_descendants_oldest_first(rs):
    m = await rs.mailboxes.ensure(uniq())
    root = await rs.scopes.create()
    child = await root.child()
    grandchild = await child.child()
    sibling = await root.child()
    other = await rs.scopes.create()
    order = [grandchild, root, sibling, child, grandchild, other, root]
    tickets = [await m.submit(i, scope=r) for i, r in enumerate(order)]
    # from `child`: only child and grandchild tasks, oldest first
    ds = await m.receive(child, wait=0, max_messages=10)
    assert [d.task_id for d in ds] == [tickets[i].id for i in (0, 3, 4)]
    # from root: the rest of its subtree, but not `other`
    ds2 = await m.receive(root, wait=0, max_messages=2)
    assert [d.task_id for d in ds2] == [tickets[1].id, tickets[2].id]
    d = await m.receive(root, wait=0)
    assert d.task_id == tickets[6].id
    assert await m.receive(root, wait=0) is None
    d = await m.receive(other, wait=0)
    assert d.task_id == tickets[5].id


async def test_retried_task_keeps_its_place_in_line(rs):
    m = await rs.mailboxes.ensure(uniq())
    run = await rs.scopes.create()
    a = await m.submit("a", scope=run)
    d = await m.receive(run, wait=0)
    b = await m.submit("b", scope=run)
    await d.retry()
    d2 = await m.receive(run, wait=0)
    assert (d2.task_id, d2.attempt, d2.token) == (a.id, 2, 2)
    assert (await m.receive(run, wait=0)).task_id == b.id


async def test_release_gives_the_task_back_without_counting_an_attempt(rs):
    # Given a task with max_attempts=1 whose first delivery is released (a stopping
    # worker), then it is QUEUED again at once, at its FIFO place, with the same attempt;
    # the next delivery is attempt 1 with a new token (the old one is stale), and it can
    # still succeed -- a retry instead would have FAILED it (max_attempts).
    m = await rs.mailboxes.ensure(uniq(), max_attempts=1)
    run = await rs.scopes.create()
    a = await m.submit("a", scope=run)
    d = await m.receive(run, wait=0)
    b = await m.submit("b", scope=run)
    info = await d.release()
    assert (info.state, info.attempt) == ("QUEUED", 1)
    d2 = await m.receive(run, wait=0)
    assert (d2.task_id, d2.attempt, d2.token) == (a.id, 1, d.token + 1)
    with pytest.raises(LeaseLostError):
        await d.release()  # the old token is stale
    assert (await d2.complete("done")).state == "SUCCEEDED"
    assert (await m.receive(run, wait=0)).task_id == b.id
    kinds = [(e.type, (e.data or {}).get("attempt")) for e in (await rs.events.list(limit=10_000)).events
             if e.id == a.id]
    assert ("task.released", 1) in kinds and not any(k == "task.retried" for k, _ in kinds)
    # on a stopped run a release is answered and changes nothing (the run cancelled it)
    run2 = await rs.scopes.create()
    c = await m.submit("c", scope=run2)
    d3 = await m.receive(run2, wait=0)
    await run2.cancel()
    assert (await d3.release()).state == "CANCELLED"
    assert (await c.status()).state == "CANCELLED"


async def test_lease_bounds(rs):
    m = await rs.mailboxes.ensure(uniq())
    run = await rs.scopes.create()
    await m.submit("x", scope=run)
    for bad in (4.999, 0, 600.001, 3600):
        with pytest.raises(ValidationError) as ei:
            await m.receive(run, lease_seconds=bad, wait=0)
        assert "lease_ms" in ei.value.message
    d = await m.receive(run, lease_seconds=5, wait=0)
    for bad in (4, 601):
        with pytest.raises(ValidationError):
            await d.renew(bad)
    await d.renew(600)
    with pytest.raises(ValidationError):
        await m.receive(run, wait=0, max_messages=0)


async def test_payload_limits(rs):
    m = await rs.mailboxes.ensure(uniq())
    run = await rs.scopes.create()
    with pytest.raises(ValidationError) as ei:
        await m.submit("x" * 70_000, scope=run)
    assert "input" in ei.value.message and "65536" in ei.value.message
    await m.submit("ok", scope=run)
    d = await m.receive(run, wait=0)
    with pytest.raises(ValidationError) as ei:
        await d.complete("y" * 70_000)
    assert "outcome" in ei.value.message
    assert (await rs.task(d.task_id).status()).state == "RUNNING"


async def test_unknown_mailbox_and_run(rs):
    run = await rs.scopes.create()
    with pytest.raises(NotFoundError):
        await rs.mailbox(uniq("nope")).submit(1, scope=run)
    m = await rs.mailboxes.ensure(uniq())
    with pytest.raises(NotFoundError):
        await m.submit(1, scope="scp_00000000000000000000000000")
    with pytest.raises(NotFoundError):
        await rs.task("tsk_00000000000000000000000000").status()


# --------------------------------------------------------------------- inactive runs
async def test_inactive_run_refuses_submit_and_receive_and_cancels_its_tasks(rs):
    m = await rs.mailboxes.ensure(uniq())
    run = await rs.scopes.create()
    child = await run.child()
    done = await m.submit("done", scope=run)
    d = await m.receive(run, wait=0)
    await d.complete("kept")
    queued = await m.submit("q", scope=child)
    running = await m.submit("r", scope=run)
    to_retry = await m.submit("rt", scope=run)
    to_reject = await m.submit("rj", scope=run)
    ds = await m.receive(run, wait=0, max_messages=10)
    held = {x.task_id: x for x in ds}
    assert set(held) == {queued.id, running.id, to_retry.id, to_reject.id}
    # give the queued one back so it is QUEUED when the run is cancelled
    await held[queued.id].retry()
    await run.cancel()
    for r in (run, child):
        with pytest.raises(ScopeCancelledError):
            await m.submit("new", scope=r)
        with pytest.raises(ScopeCancelledError):
            await m.submit_many(["new"], scope=r)
        with pytest.raises(ScopeCancelledError):
            await m.receive(r, wait=0)
    for t in (queued, running, to_retry, to_reject):
        st = await t.status()
        assert (st.state, st.outcome_reason) == ("CANCELLED", "scope_cancelled")
    # renewals refused: the holder learns it lost the lease
    with pytest.raises((LeaseLostError, ScopeInactiveError)):
        await held[running.id].renew()
    assert held[running.id].lost
    # completing is refused, retry and reject are still answered (and change nothing)
    with pytest.raises((LeaseLostError, ScopeInactiveError)):
        await held[running.id].complete("nope")
    assert (await held[to_retry.id].retry("giving back")).state == "CANCELLED"
    assert (await held[to_reject.id].reject("giving up")).state == "CANCELLED"
    # recorded results stay readable
    res = await done.result(timeout=0)
    assert (res.state, res.outcome) == ("SUCCEEDED", "kept")
    counts = (await run.status()).tasks
    assert counts == {"SUCCEEDED": 1, "CANCELLED": 3}
    assert (await m.status()).queued == 0 and (await m.status()).running == 0


async def test_cancel_wakes_a_long_waiting_receiver(rs):
    m = await rs.mailboxes.ensure(uniq())
    run = await rs.scopes.create()
    child = await run.child()
    err = {}

    async def receiver():
        try:
            await m.receive(child, wait=30)
        except ScopeCancelledError as e:
            err["e"] = e

    base = await parked_waits(rs)
    async with trio.open_nursery() as n:
        n.start_soon(receiver)
        await wait_parked_remote(rs, 1, base=base)  # the receive is parked when the run ends
        with trio.fail_after(5):  # and the cancel wakes it (long before its 30 s)
            await run.cancel()
            await until(lambda: "e" in err)
    assert err["e"].code == "SCOPE_CANCELLED"


async def test_long_receive_sees_changes_made_before_its_wait_began(rs):
    # Over TCP a batch frame dispatches every request before the first wait starts: a
    # cancel or a submit landing between a receive's dispatch and its server-side wait
    # must still end that wait at once (it used to sleep the whole `wait`).
    import msgspec

    from rallypoint import protocol as p
    from rallypoint.client import types as t
    from rallypoint.client.api import encode_payload

    async def pipelined(first, second):
        # TCP: one batch frame; embedded: both queued before the first is awaited
        r = (await rs._transport.call_many([first, second]))[0]
        return r if isinstance(r, Exception) else msgspec.msgpack.decode(r, type=t._ReceiveReply)

    m = await rs.mailboxes.ensure(uniq())
    run = await rs.scopes.create()
    recv = p.Receive(mailbox=m.name, scope_id=run.id, lease_ms=30_000, wait_ms=20_000)
    with trio.fail_after(5):
        got = await pipelined(recv, p.TaskSubmit(mailbox=m.name, scope_id=run.id, input=encode_payload("now")))
    assert [d.input for d in got.deliveries] == ["now"]
    with trio.fail_after(5):
        got = await pipelined(recv, p.ScopeCancel(scope_id=run.id))
    assert isinstance(got, ScopeCancelledError)


async def test_batch_forms_complete_many_and_results(rs):
    # complete_many settles several deliveries in one frame (a stale one is reported,
    # not raised), and results() waits for many tasks in one frame.
    from rallypoint.errors import LeaseLostError

    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure("batch-forms")
    tickets = await mbx.submit_many([{"i": i} for i in range(5)], scope=run)
    ds = await mbx.receive(run, wait=0, max_messages=5)
    stale = ds[0]
    await stale.complete("first")  # now its token is spent
    out = await mbx.complete_many([(d, d.input["i"] * 10) for d in ds])
    assert isinstance(out[0], LeaseLostError) and stale.lost
    assert [o.state for o in out[1:]] == ["SUCCEEDED"] * 4
    infos = await rs.results(tickets, timeout=5)
    assert [i.outcome for i in infos] == ["first", 10, 20, 30, 40]


async def test_results_without_details_answers_outcomes_only(rs):
    # details=False: one TaskOutcome per task (state, attempt, outcome, reason, error),
    # no input echoed back; a failed task carries its error, a waiting one is waited for
    from rallypoint import TaskOutcome

    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure(uniq(), max_attempts=1)
    tickets = await mbx.submit_many([{"i": i, "pad": "x" * 500} for i in range(3)], scope=run)
    ds = await mbx.receive(run, wait=0, max_messages=3)
    await ds[0].complete({"got": 0})
    await ds[1].reject({"why": "bad"})
    sent = []
    real = rs._call

    async def spy(op, reply_type):
        sent.append(op)
        return await real(op, reply_type)

    base = await parked_waits(rs)
    rs._call = spy
    async with trio.open_nursery() as n:
        got: list = []

        async def wait_all():
            got.extend(await rs.results(tickets, timeout=30, details=False))

        n.start_soon(wait_all)
        await until(lambda: sent)  # the one request is made ...
        rs._call = real
        await wait_parked_remote(rs, 1, base=base)  # ... and waits on the server for the third task
        assert not got
        await ds[2].complete(None)
    assert all(isinstance(o, TaskOutcome) and o.finished for o in got)
    assert [(o.id, o.state, o.attempt, o.outcome) for o in got] == [
        (tickets[0].id, "SUCCEEDED", 1, {"got": 0}), (tickets[1].id, "FAILED", 1, None),
        (tickets[2].id, "SUCCEEDED", 1, None)]
    assert got[1].error == {"why": "bad"} and got[0].error is None
    assert [type(op).__name__ for op in sent] == ["TaskResults"] and sent[0].brief
    # the brief reply is smaller: no input, no instants
    from rallypoint import protocol as p
    import msgspec
    full = await rs._call(p.TaskResults(task_ids=[t.id for t in tickets]), msgspec.Raw)
    brief = await rs._call(p.TaskResults(task_ids=[t.id for t in tickets], brief=True), msgspec.Raw)
    assert len(bytes(brief)) * 4 < len(bytes(full))


async def test_results_times_out_without_changing_anything(rs):
    from rallypoint.errors import WaitTimeout

    run = await rs.scopes.create()
    mbx = await rs.mailboxes.ensure("batch-wait")
    tickets = await mbx.submit_many([1, 2], scope=run)
    with pytest.raises(WaitTimeout):
        await rs.results(tickets, timeout=0.2)
    assert [(await t.status()).state for t in tickets] == ["QUEUED", "QUEUED"]


async def test_results_waits_for_many_tasks_with_one_request_and_one_parked_wait(autojump_clock, ers):
    # tasks in two runs; rs.results sends ONE task.results request, parked ONCE (on the
    # first task's run), woken as each finishes -- also by a task of the other run
    coord = ers.node.coordinator
    m = await ers.mailboxes.ensure(uniq())
    a, b = await ers.scopes.create(), await ers.scopes.create()
    tickets = await m.submit_many([1, 2, 3], scope=a) + await m.submit_many([4, 5], scope=b)
    got: list = []
    async with trio.open_nursery() as n:
        async def wait_all():
            got.extend(await ers.results(tickets, timeout=600))

        n.start_soon(wait_all)
        await trio.testing.wait_all_tasks_blocked()
        assert coord.runtime.n_waiters == 1  # one parked wait for five tasks
        for run in (b, a):  # the other run's tasks first
            for d in await m.receive(run, wait=0, max_messages=10):
                await trio.sleep(1)
                await d.complete(d.input * 10)
        await trio.testing.wait_all_tasks_blocked()
    assert [(i.state, i.outcome) for i in got] == [("SUCCEEDED", k * 10) for k in (1, 2, 3, 4, 5)]
    assert coord.runtime.n_waiters == 0 and not coord.queues.result_watch
    # a wait that times out answers the tasks as they are, and changes nothing
    t = await m.submit("late", scope=a)
    with pytest.raises(WaitTimeout):
        await ers.results([t], timeout=5)
    assert not coord.queues.result_watch


async def test_complete_many_is_one_request_per_run_and_judges_each_item(rs):
    # deliveries of two runs, one of them stale: ONE request per run (one commit each);
    # the stale item is refused on its own, the others are recorded
    from rallypoint import protocol as p

    m = await rs.mailboxes.ensure(uniq())
    a, b = await rs.scopes.create(), await rs.scopes.create()
    await m.submit_many([1, 2], scope=a)
    await m.submit_many([3], scope=b)
    da = await m.receive(a, wait=0, max_messages=2)
    db = [await m.receive(b, wait=0)]
    stale = da[1]
    await stale.complete("first")  # its token is then no longer a live lease
    sent = []
    real = rs._call_many

    async def spy(ops, reply_type):
        sent.append([type(op).__name__ for op in ops])
        return await real(ops, reply_type)

    rs._call_many = spy
    out = await m.complete_many([(da[0], "x"), (stale, "again"), (db[0], "z")])
    assert sent == [["DeliveryCompleteMany", "DeliveryCompleteMany"]]  # one frame, one op per run
    assert out[0].state == "SUCCEEDED" and out[0].outcome == "x"
    assert isinstance(out[1], LeaseLostError) and stale.lost
    assert out[2].state == "SUCCEEDED" and out[2].outcome == "z"
    assert (await rs.task(stale.task_id).status()).outcome == "first"  # unchanged
    # the same task twice in one batch: the second is refused
    await m.submit("dup", scope=a)
    d = await m.receive(a, wait=0)
    raw = await rs._call(p.DeliveryCompleteMany(items=[
        p.CompleteItem(task_id=d.task_id, token=d.token, outcome=msgspec.Raw(msgspec.msgpack.encode(1))),
        p.CompleteItem(task_id=d.task_id, token=d.token, outcome=msgspec.Raw(msgspec.msgpack.encode(2))),
    ]), p.SettledListView)
    assert raw.items[0].task is not None and raw.items[1].error.code == "STALE_CLAIM"
    assert (await rs.task(d.task_id).status()).outcome == 1


async def test_a_payload_nested_too_deeply_is_a_validation_error(rs):
    # not a RecursionError out of the encoder: the documented exception, naming the field
    run = await rs.scopes.create()
    m = await rs.mailboxes.ensure(uniq())
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(ValidationError) as ei:
        await m.submit(deep, scope=run)
    assert "nested too deeply" in ei.value.message and ei.value.details == {"field": "input"}


async def test_a_name_too_long_is_reported_with_its_own_length(rs):
    with pytest.raises(ValidationError) as ei:
        await rs.mailboxes.ensure("a" * 129)
    assert "(129 chars)" in ei.value.message
    with pytest.raises(ValidationError) as ei:
        await rs.scopes.create(name="b" * 300)
    assert "(300 chars)" in ei.value.message


async def test_complete_and_next_in_one_request(rs):
    # Complete-and-next (issue 47) embedded, over TCP and through a sharded cluster's
    # router: the settle and the next deliveries in one answer; a refused settle
    # receives nothing.
    m = await rs.mailboxes.ensure(uniq("cn"))
    run = await rs.scopes.create()
    a, b, c = await m.submit_many(["a", "b", "c"], scope=run)
    d = await m.receive(run, wait=0)
    nxt = await d.complete_and_next("A", max_messages=5)
    assert [x.task_id for x in nxt] == [b.id, c.id] and nxt.task.outcome == "A"
    with pytest.raises(LeaseLostError):
        await d.complete_and_next("again")
    last = await nxt[0].complete_and_next("B")
    assert last == [] and last.task.state == "SUCCEEDED"
    assert (await nxt[1].reject_and_next("no")).task.state == "FAILED"
    assert [(await t.status()).state for t in (a, b, c)] == ["SUCCEEDED", "SUCCEEDED", "FAILED"]
