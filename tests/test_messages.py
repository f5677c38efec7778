"""Messages (issue 15 item 6): ``mailbox.send(payload, scope)`` into an INBOX-mode
mailbox; receive, renew, complete (ACKED) and nack (retry / reject) with the same
fencing tokens and leases as task deliveries; the cancellation row; message leases are
extended by ``LeasesExtended`` like task leases."""

from __future__ import annotations

from datetime import timedelta

import pytest
import trio

import rallypoint
from rallypoint.clock import ms_to_datetime
from rallypoint.errors import (
    ConflictError,
    DeadlineExceededError,
    LeaseLostError,
    NotFoundError,
    ScopeCancelledError,
    ValidationError,
)
from rallypoint.records import LeasesExtended


def coord(rs):
    return rs.node.coordinator


async def test_send_receive_complete(rs):
    run = await rs.scopes.create()
    name = f"inbox-{run.id[-6:]}"
    inbox = await rs.mailboxes.ensure(name, mode="INBOX")
    assert inbox.info.mode == "INBOX"
    m = await inbox.send({"text": "hello"}, scope=run)
    assert m.id.startswith("msg_") and m.info.state == "QUEUED" and m.info.payload == {"text": "hello"}
    d = await inbox.receive(run, lease_seconds=10, wait=0)
    assert d.message_id == m.id and d.payload == {"text": "hello"} and d.attempt == 1 and d.token == 1
    assert (await m.status()).state == "RUNNING"
    info = await d.complete({"read": True})
    assert info.state == "ACKED" and info.finished
    st = await m.status()
    assert (st.state, st.result, st.outcome_reason) == ("ACKED", {"read": True}, "completed")
    with pytest.raises(LeaseLostError):
        await d.complete({"again": True})  # exactly once
    assert (await rs.message(m.id).status()).result == {"read": True}
    assert (await inbox.status()).queued == 0


async def test_mailbox_modes_keep_tasks_and_messages_apart(ers):
    run = await ers.scopes.create()
    inbox = await ers.mailboxes.ensure("in", mode="INBOX")
    work = await ers.mailboxes.ensure("work")
    with pytest.raises(ConflictError) as ei:
        await inbox.submit({"x": 1}, scope=run)
    assert "send()" in ei.value.message
    with pytest.raises(ConflictError) as ei:
        await work.send({"x": 1}, scope=run)
    assert "submit()" in ei.value.message
    with pytest.raises(ConflictError):
        await run.groups.create(inbox, "ALL_TERMINAL")
    with pytest.raises(ConflictError) as ei:
        await ers.mailboxes.ensure("in", mode="WORK")  # WORK asked, INBOX exists
    assert ei.value.details["field"] == "mode"
    assert (await ers.mailboxes.ensure("in")).info.mode == "INBOX"  # no mode asked: a handle on it
    with pytest.raises(ValidationError):
        await ers.mailboxes.ensure("odd", mode="FANOUT")
    t = await work.submit({"x": 1}, scope=run)
    with pytest.raises(NotFoundError):
        await ers.message(t.id).status()  # a task is not a message


async def test_messages_are_fifo_keyed_and_limited_like_tasks(ers):
    run = await ers.scopes.create()
    inbox = await ers.mailboxes.ensure("fifo", mode="INBOX", backlog_limit=3)
    ids = [(await inbox.send(i, scope=run, key=f"k{i}")).id for i in range(3)]
    assert (await inbox.send(0, scope=run, key="k0")).id == ids[0]  # idempotent per key
    with pytest.raises(ConflictError):
        await inbox.send("other", scope=run, key="k0")
    with pytest.raises(rallypoint.LimitError):
        await inbox.send(99, scope=run)
    with pytest.raises(ValidationError) as ei:
        await inbox.send("x" * 70_000, scope=run)
    assert ei.value.details["field"] == "payload"
    got = await inbox.receive(run, wait=0, max_messages=10)
    assert [d.message_id for d in got] == ids and [d.payload for d in got] == [0, 1, 2]


async def test_nack_retry_and_reject_with_fencing(autojump_clock, ers):
    run = await ers.scopes.create()
    inbox = await ers.mailboxes.ensure("nack", mode="INBOX", max_attempts=3)
    m = await inbox.send("job", scope=run)
    d1 = await inbox.receive(run, lease_seconds=5, wait=0)
    await d1.nack(retry=True, error="busy")
    d2 = await inbox.receive(run, lease_seconds=5, wait=0)
    assert (d2.message_id, d2.attempt, d2.token) == (m.id, 2, 2)
    with pytest.raises(LeaseLostError):
        await d1.renew()  # the first token is stale
    with pytest.raises(LeaseLostError):
        await d1.complete("late")
    await trio.sleep(6)  # the lease runs out: delivered again, attempt 3
    with pytest.raises(LeaseLostError):
        await d2.renew()
    d3 = await inbox.receive(run, lease_seconds=5, wait=0)
    assert (d3.attempt, d3.token) == (3, 3)
    await d3.renew(10)
    with pytest.raises(ConflictError):
        await d3.run()  # only tasks have runs of their own
    await d3.nack(retry=False, error="poison")
    st = await m.status()
    assert (st.state, st.error, st.outcome_reason) == ("FAILED", "poison", "rejected")


async def test_consume_serves_an_inbox(ers):
    run = await ers.scopes.create()
    inbox = await ers.mailboxes.ensure("chat", mode="INBOX")
    sent = [await inbox.send({"n": i}, scope=run) for i in range(5)]
    seen = []

    async def handler(delivery):
        seen.append(delivery.payload["n"])
        if len(seen) == 5:
            await run.cancel()  # stops the consumer
        return {"double": delivery.payload["n"] * 2}

    await rallypoint.consume(ers, inbox, run, handler, concurrency=1)
    assert sorted(seen) == [0, 1, 2, 3, 4]
    states = [(await m.status()).state for m in sent]
    assert states[:4] == ["ACKED"] * 4


# ------------------------------------------------------------------ the cancellation row


async def test_send_is_refused_in_an_inactive_run_below_it_and_past_a_deadline(autojump_clock, ers):
    inbox = await ers.mailboxes.ensure("gate", mode="INBOX")
    cancelled = await ers.scopes.create()
    below = await (await cancelled.child()).child()
    await cancelled.cancel()
    timed = await ers.scopes.create(deadline=ms_to_datetime(coord(ers).now_ms()) + timedelta(seconds=5))
    await trio.sleep(5)
    for run, err in ((cancelled, ScopeCancelledError), (below, ScopeCancelledError), (timed, DeadlineExceededError)):
        with pytest.raises(err):
            await inbox.send("x", scope=run)
        with pytest.raises(err):
            await inbox.receive(run, wait=0)
    assert (await inbox.status()).queued == 0


async def test_a_runs_end_drops_its_queued_messages_and_refuses_renewals(autojump_clock, ers):
    run = await ers.scopes.create()
    inbox = await ers.mailboxes.ensure("end", mode="INBOX")
    done = await inbox.send("d", scope=run)
    held = await inbox.send("h", scope=run)
    queued = await inbox.send("q", scope=run)
    d_done = await inbox.receive(run, wait=0)
    await d_done.complete("ok")
    d = await inbox.receive(run, wait=0)
    assert d.message_id == held.id
    got = {}

    empty = await ers.mailboxes.ensure("end-empty", mode="INBOX")

    async def waiting_receiver():
        try:
            await empty.receive(run, wait=600)
        except ScopeCancelledError as e:
            got["e"] = e

    async with trio.open_nursery() as n:
        n.start_soon(waiting_receiver)
        await trio.testing.wait_all_tasks_blocked()
        await run.cancel()
    assert got["e"].details["reason"] == "cancelled"  # a waiting receive answered at once
    st = await queued.status()
    assert (st.state, st.outcome_reason) == ("CANCELLED", "scope_cancelled")
    with pytest.raises(ScopeCancelledError):
        await d.renew()  # renewals refused: the holder sees its lease lost
    assert d.lost
    assert (await d.retry()).state == "CANCELLED"  # retry/reject stay allowed (no-ops)
    assert (await done.status()).result == "ok"  # results stay readable


async def test_message_leases_are_extended_like_task_leases(autojump_clock, ers):
    run = await ers.scopes.create()
    inbox = await ers.mailboxes.ensure("ext", mode="INBOX")
    m = await inbox.send("x", scope=run)
    d = await inbox.receive(run, lease_seconds=10, wait=0)
    c = coord(ers)
    assert m.id in c.queues.leased
    c.commit([LeasesExtended(by_ms=60_000, at_ms=c.now_ms(), reason="stall")])
    await trio.sleep(30)  # past the original 10 s
    assert (await m.status()).state == "RUNNING"
    await d.renew(10)
    await d.complete("in time")
    assert (await m.status()).state == "ACKED"


def test_messages_with_the_blocking_client(daemon):
    with rallypoint.sync.connect(daemon.url) as rs:
        run = rs.scopes.create()
        inbox = rs.mailboxes.ensure("sync-inbox", mode="INBOX")
        m = inbox.send({"a": 1}, scope=run, key="one")
        d = inbox.receive(run, wait=1)
        assert d.message_id == m.id
        d.complete("done")
        assert m.status().state == "ACKED"
