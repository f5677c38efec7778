"""The coordinator operations added for the HTTP API (issue 17), embedded under MockClock:
named runs, named timers (token, ack, poll), named barriers, once, stored idempotency
answers (TTL, conflicts), task subscriptions, mailbox contents, the ops views; and that
their records replay to the same state."""

from __future__ import annotations

import msgspec
import pytest
import trio

from rallypoint import protocol as p
from rallypoint.actors.api import REPLY_TYPES
from rallypoint.actors import Coordinator
from rallypoint.errors import (
    BarrierCancelledError,
    ConflictError,
    LeaseLostError,
    NotFoundError,
    ScopeCancelledError,
    TimerCancelledError,
    ValidationError,
)
from rallypoint.records import decode_commit
from rallypoint.service import Session

S = Session(space="s1")


async def call(rs, op, session: Session = S):
    raw = await rs.node.service.call(session, op)
    return msgspec.msgpack.decode(raw, type=REPLY_TYPES[type(op)])


def enc(v) -> msgspec.Raw:
    return msgspec.Raw(msgspec.msgpack.encode(v))


async def test_named_runs_join_the_live_run_and_start_anew_after_it_ended(autojump_clock, ers):
    a = await call(ers, p.ScopeEnsureNamed(name="nightly research"))
    b = await call(ers, p.ScopeEnsureNamed(name="nightly research", deadline="2099-01-01T00:00:00Z"))
    assert a.id == b.id and b.deadline is None  # the deadline applies only when creating
    other = await call(ers, p.ScopeEnsureNamed(name="nightly research"), Session(space="s2"))
    assert other.id != a.id  # per space
    await call(ers, p.ScopeCancel(scope_id=a.id))
    c = await call(ers, p.ScopeEnsureNamed(name="nightly research"))
    assert c.id != a.id and c.stored_state == "ACTIVE"
    assert (await call(ers, p.ScopeStatus(scope_id=a.id))).stored_state == "CANCELLED"
    # a run past its deadline is not joined either
    short = await call(ers, p.ScopeCreate(name="short", deadline=_in(ers, 5)))
    assert (await call(ers, p.ScopeEnsureNamed(name="short"))).id == short.id
    await trio.sleep(6)
    assert (await call(ers, p.ScopeEnsureNamed(name="short"))).id != short.id
    with pytest.raises(ValidationError):
        await call(ers, p.ScopeEnsureNamed(name="bad\nname"))


async def test_a_named_run_join_does_not_fork_when_a_newer_run_of_that_name_ended(autojump_clock, ers):
    # issue 42, item 4: PUT /runs/shared gave run A; a native client made run B with the
    # same name and cancelled it; PUT /runs/shared made a new run C while A was ACTIVE
    a = await call(ers, p.ScopeEnsureNamed(name="shared"))
    b = await call(ers, p.ScopeCreate(name="shared"))
    assert b.id != a.id
    await call(ers, p.ScopeCancel(scope_id=b.id))
    assert (await call(ers, p.ScopeEnsureNamed(name="shared"))).id == a.id  # the newest ACTIVE one
    # a newer ACTIVE one is the one joined; once it ends, the older ACTIVE one again
    c = await call(ers, p.ScopeCreate(name="shared"))
    assert (await call(ers, p.ScopeEnsureNamed(name="shared"))).id == c.id
    await call(ers, p.ScopeComplete(scope_id=c.id))
    assert (await call(ers, p.ScopeEnsureNamed(name="shared"))).id == a.id
    await call(ers, p.ScopeCancel(scope_id=a.id))
    new = await call(ers, p.ScopeEnsureNamed(name="shared"))
    assert new.id not in (a.id, b.id, c.id)


async def test_a_named_run_join_finds_the_same_run_after_a_restart(tmp_path):
    import rallypoint

    async with rallypoint.open_embedded(str(tmp_path), durability="fsync", sync_helper="thread") as rs:
        a = await call(rs, p.ScopeEnsureNamed(name="shared"))
        b = await call(rs, p.ScopeCreate(name="shared"))
        await call(rs, p.ScopeCancel(scope_id=b.id))
        c = await call(rs, p.ScopeCreate(name="shared"))
        await call(rs, p.ScopeComplete(scope_id=c.id))
    async with rallypoint.open_embedded(str(tmp_path), durability="fsync", sync_helper="thread") as rs:
        assert (await call(rs, p.ScopeEnsureNamed(name="shared"))).id == a.id


def _in(rs, seconds: float) -> str:
    from rallypoint.clock import to_iso

    return to_iso(rs.node.coordinator.now_ms() + int(seconds * 1000))


async def test_named_timer_is_never_rearmed_fires_with_a_token_and_acks_once(autojump_clock, ers):
    run = await call(ers, p.ScopeCreate())
    t = await call(ers, p.TimerCreate(scope_id=run.id, after_ms=10_000, name="cooldown"))
    assert t.state == "ARMED" and t.token is None and t.now is not None
    await trio.sleep(4)
    again = await call(ers, p.TimerCreate(scope_id=run.id, after_ms=10_000, name="cooldown"))
    assert again.id == t.id and again.fire_at == t.fire_at  # not reset
    with pytest.raises(ConflictError):
        await call(ers, p.TimerAck(timer_id=t.id))  # not fired yet
    assert (await call(ers, p.TimerPoll(scope_id=run.id))).timers == []
    await trio.sleep(7)
    fired = await call(ers, p.TimerCreate(scope_id=run.id, after_ms=10_000, name="cooldown"))
    assert fired.state == "FIRED" and fired.token
    polled = (await call(ers, p.TimerPoll(scope_id=run.id))).timers
    assert [x.id for x in polled] == [t.id] and polled[0].token == fired.token
    with pytest.raises(LeaseLostError):
        await call(ers, p.TimerAck(timer_id=t.id, token="f1"))
    acked = await call(ers, p.TimerAck(timer_id=t.id, token=fired.token))
    assert acked.state == "ACKED"
    with pytest.raises(ConflictError):
        await call(ers, p.TimerAck(timer_id=t.id, token=fired.token))
    assert (await call(ers, p.TimerPoll(scope_id=run.id))).timers == []
    # another run has its own "cooldown"
    run2 = await call(ers, p.ScopeCreate())
    assert (await call(ers, p.TimerCreate(scope_id=run2.id, after_ms=1, name="cooldown"))).id != t.id
    # a cancelled run cancels its armed named timer; ack says so
    t3 = await call(ers, p.TimerCreate(scope_id=run2.id, after_ms=60_000, name="later"))
    await call(ers, p.ScopeCancel(scope_id=run2.id))
    with pytest.raises(TimerCancelledError):
        await call(ers, p.TimerAck(timer_id=t3.id))


async def test_named_barrier_is_one_per_run_and_name(autojump_clock, ers):
    run = await call(ers, p.ScopeCreate())
    b = await call(ers, p.BarrierCreate(scope_id=run.id, target=2, name="stage-2"))
    assert (await call(ers, p.BarrierCreate(scope_id=run.id, target=2, name="stage-2"))).id == b.id
    with pytest.raises(ConflictError):
        await call(ers, p.BarrierCreate(scope_id=run.id, target=3, name="stage-2"))
    await call(ers, p.BarrierArrive(barrier_id=b.id, key="w1"))
    await call(ers, p.BarrierArrive(barrier_id=b.id, key="w2"))
    assert (await call(ers, p.BarrierStatus(barrier_id=b.id))).state == "RELEASED"
    await call(ers, p.ScopeCancel(scope_id=run.id))
    with pytest.raises(ScopeCancelledError):
        await call(ers, p.BarrierCreate(scope_id=run.id, target=2, name="stage-2"))
    run2 = await call(ers, p.ScopeCreate())
    b2 = await call(ers, p.BarrierCreate(scope_id=run2.id, target=2, name="stage-3"))
    await call(ers, p.ScopeCancel(scope_id=run2.id))
    with pytest.raises(BarrierCancelledError):
        await call(ers, p.BarrierWait(barrier_id=b2.id, wait_ms=1000))


async def test_once_acquire_held_done_and_failed(autojump_clock, ers):
    run = await call(ers, p.ScopeCreate())
    a = await call(ers, p.OnceAcquire(scope_id=run.id, key="work:1", holder="h1", holder_session="s1"))
    assert a.state == "ACQUIRED" and a.token == 1 and a.attempts == 0
    held = await call(ers, p.OnceAcquire(scope_id=run.id, key="work:1", holder="h1", holder_session="s1"))
    assert held.state == "HELD" and held.token == 0  # not re-entrant; no token to others
    assert (await call(ers, p.OnceGet(scope_id=run.id, key="nobody"))).state == "OPEN"
    with pytest.raises(LeaseLostError):
        await call(ers, p.OnceComplete(scope_id=run.id, key="work:1", token=2, result=enc(1)))

    async def finish():
        await trio.sleep(3)
        await call(ers, p.OnceComplete(scope_id=run.id, key="work:1", token=1, result=enc({"v": 42})))

    async with trio.open_nursery() as n:
        n.start_soon(finish)
        got = await call(ers, p.OnceGet(scope_id=run.id, key="work:1", wait_ms=25_000))
    assert got.state == "DONE" and msgspec.msgpack.decode(got.result) == {"v": 42}
    again = await call(ers, p.OnceComplete(scope_id=run.id, key="work:1", token=1, result=enc({"v": 42})))
    assert again.state == "DONE"  # a re-sent complete
    assert (await call(ers, p.OnceAcquire(scope_id=run.id, key="work:1"))).state == "DONE"
    # failures: OPEN until max_attempts, then FAILED for good
    b1 = await call(ers, p.OnceAcquire(scope_id=run.id, key="flaky"))
    f1 = await call(ers, p.OnceFail(scope_id=run.id, key="flaky", token=b1.token, error="E: 1", max_attempts=2))
    assert f1.state == "OPEN" and f1.attempts == 1
    b2 = await call(ers, p.OnceAcquire(scope_id=run.id, key="flaky"))
    assert b2.state == "ACQUIRED" and b2.attempts == 1 and b2.token == b1.token + 1
    f2 = await call(ers, p.OnceFail(scope_id=run.id, key="flaky", token=b2.token, error="E: 2", max_attempts=2))
    assert f2.state == "FAILED" and f2.attempts == 2 and f2.last_error == "E: 2"
    assert (await call(ers, p.OnceAcquire(scope_id=run.id, key="flaky"))).state == "FAILED"
    # a lease that runs out: OPEN again, not counted; the old token is stale
    c = await call(ers, p.OnceAcquire(scope_id=run.id, key="slow", lease_ms=5_000))
    await call(ers, p.OnceRenew(scope_id=run.id, key="slow", token=c.token, lease_ms=5_000))
    await trio.sleep(6)
    assert (await call(ers, p.OnceGet(scope_id=run.id, key="slow"))).state == "OPEN"
    with pytest.raises(LeaseLostError):
        await call(ers, p.OnceRenew(scope_id=run.id, key="slow", token=c.token))
    d = await call(ers, p.OnceAcquire(scope_id=run.id, key="slow"))
    assert d.attempts == 0 and d.token == c.token + 1
    # the run ends: renewals say so; acquire refused; DONE still answered
    await call(ers, p.ScopeCancel(scope_id=run.id))
    with pytest.raises(ScopeCancelledError):
        await call(ers, p.OnceRenew(scope_id=run.id, key="slow", token=d.token))
    with pytest.raises(ScopeCancelledError):
        await call(ers, p.OnceAcquire(scope_id=run.id, key="new"))
    assert (await call(ers, p.OnceAcquire(scope_id=run.id, key="work:1"))).state == "DONE"
    with pytest.raises(ValidationError):
        await call(ers, p.OnceAcquire(scope_id=run.id, key="x", lease_ms=1000))


async def test_idempotency_answers_are_kept_for_the_ttl_then_forgotten(autojump_clock, ers):
    coord = ers.node.coordinator
    coord.idempotency.ttl_ms = 3_600_000
    assert not (await call(ers, p.IdempotencyLookup(key="k1", fingerprint="f"))).found
    await call(ers, p.IdempotencyRecord(key="k1", fingerprint="f", status=200, body=b'{"a":1}'))
    first = await call(ers, p.IdempotencyRecord(key="k1", fingerprint="f", status=500, body=b"x"))
    assert first.status == 200 and first.body == b'{"a":1}'  # the first record wins
    got = await call(ers, p.IdempotencyLookup(key="k1", fingerprint="f"))
    assert got.found and got.body == b'{"a":1}'
    with pytest.raises(ConflictError) as e:
        await call(ers, p.IdempotencyLookup(key="k1", fingerprint="other"))
    assert e.value.code == "IDEMPOTENCY_CONFLICT"
    assert not (await call(ers, p.IdempotencyLookup(key="k1", fingerprint="f"), Session(space="s2"))).found
    await trio.sleep(3601)
    assert not (await call(ers, p.IdempotencyLookup(key="k1", fingerprint="f"))).found
    await call(ers, p.IdempotencyRecord(key="k2", fingerprint="f", status=200, body=b"{}"))
    assert len(coord.idempotency.table) == 1  # k1 forgotten in k2's commit


async def test_subscriptions_mailbox_contents_and_ops_views(autojump_clock, ers):
    run = await call(ers, p.ScopeCreate())
    await call(ers, p.MailboxEnsure(name="q"))
    t = await call(ers, p.TaskSubmit(mailbox="q", scope_id=run.id, input=enc(1), key="a"))
    await call(ers, p.TaskSubscribe(task_id=t.id, subscriber_id="s1", scope_id=run.id))
    await call(ers, p.TaskSubscribe(task_id=t.id, subscriber_id="s2"))
    await call(ers, p.TaskSubscribe(task_id=t.id, subscriber_id="s1"))
    v = await call(ers, p.TaskDetach(task_id=t.id, subscriber_id="s1"))
    assert v.subscribers == ["s2"] and v.state == "QUEUED"
    t2 = await call(ers, p.TaskSubmit(mailbox="q", scope_id=run.id, input=enc(2)))
    listed = await call(ers, p.MailboxMessages(name="q", limit=10))
    assert [x.id for x in listed.tasks] == [t2.id, t.id]
    assert [x.id for x in (await call(ers, p.MailboxMessages(name="q", before=t2.id))).tasks] == [t.id]
    kid = await call(ers, p.ScopeCreate(parent_id=run.id))
    await call(ers, p.OnceAcquire(scope_id=kid.id, key="k", holder="worker-1"))
    ops = await call(ers, p.OpsRun(scope_id=kid.id))
    assert ops.root_scope_id == run.id and [(w.holder, w.keys) for w in ops.workers] == [("worker-1", ["k"])]
    assert (await call(ers, p.OpsRun(scope_id=run.id))).workers[0].holder == "worker-1"
    assert "onces" in (await call(ers, p.OpsWaits())).parked
    with pytest.raises(NotFoundError):
        await call(ers, p.OpsRun(scope_id=run.id), Session(space="s2"))


async def test_records_of_the_new_ops_replay_to_the_same_state(autojump_clock):
    """Every commit journaled by the new ops, replayed into a fresh coordinator, gives the
    same entities (the MemoryJournal keeps the entries)."""
    import rallypoint

    async with rallypoint.open_embedded() as rs:
        coord = rs.node.coordinator
        entries: list[bytes] = []
        append = coord.journal.append

        def capture(payload: bytes) -> int:
            entries.append(payload)
            return append(payload)

        coord.journal.append = capture
        run = await call(rs, p.ScopeEnsureNamed(name="r"))
        t = await call(rs, p.TimerCreate(scope_id=run.id, after_ms=1000, name="t"))
        await call(rs, p.BarrierCreate(scope_id=run.id, target=1, name="b"))
        o = await call(rs, p.OnceAcquire(scope_id=run.id, key="k", lease_ms=5000))
        await call(rs, p.OnceFail(scope_id=run.id, key="k", token=o.token, error="e"))
        o = await call(rs, p.OnceAcquire(scope_id=run.id, key="k", lease_ms=5000))
        await call(rs, p.OnceComplete(scope_id=run.id, key="k", token=o.token, result=enc([1])))
        await call(rs, p.OnceAcquire(scope_id=run.id, key="k2", lease_ms=5000))
        await call(rs, p.IdempotencyRecord(key="i", fingerprint="f", status=200, body=b"{}"))
        await call(rs, p.MailboxEnsure(name="q"))
        task = await call(rs, p.TaskSubmit(mailbox="q", scope_id=run.id))
        await call(rs, p.TaskSubscribe(task_id=task.id, subscriber_id="x"))
        await trio.sleep(7)  # the timer fires, k2's lease runs out
        await call(rs, p.TimerAck(timer_id=t.id))
        live = {k: msgspec.msgpack.encode(v) for k, (tbl, _) in coord.entity_tables().items()
                for k, v in tbl.items() if k[:3] in ("onc", "tmr", "bar", "idm", "scp", "tsk")}
    assert entries
    fresh = Coordinator()
    fresh.replaying = True
    for payload in entries:
        for rec in decode_commit(payload):
            fresh._apply[type(rec)](rec)
    again = {k: msgspec.msgpack.encode(v) for k, (tbl, _) in fresh.entity_tables().items()
             for k, v in tbl.items() if k[:3] in ("onc", "tmr", "bar", "idm", "scp", "tsk")}
    assert again == live
