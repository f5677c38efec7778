"""The read operations added for the web console (issue 32), embedded under MockClock:
``scope.list``'s name filter, ``ops.items`` (what a run or a space holds, by kind),
``ops.task`` (a task's current delivery) and ``ops.joinset`` (completion records and the
log of answers); every one answers only the session's space."""

from __future__ import annotations

import msgspec
import pytest
import trio

from rallypoint import protocol as p
from rallypoint.actors.api import REPLY_TYPES
from rallypoint.errors import ForbiddenError, NotFoundError, ValidationError
from rallypoint.service import Session

S = Session(space="s1")
OTHER = Session(space="s2")


def read_only(rs) -> Session:
    """A session of a live key of s1 that holds only ``coordination_read``."""
    key, _secret = rs.node.coordinator.keys.create_key("s1", ["coordination_read"])
    return Session(space="s1", permissions=frozenset(key.permissions), key_id=key.id)


async def call(rs, op, session: Session = S):
    raw = await rs.node.service.call(session, op)
    return msgspec.msgpack.decode(raw, type=REPLY_TYPES[type(op)])


def enc(v) -> msgspec.Raw:
    return msgspec.Raw(msgspec.msgpack.encode(v))


async def test_scope_list_filters_by_a_part_of_the_name(autojump_clock, ers):
    a = await call(ers, p.ScopeCreate(name="Nightly research"))
    await call(ers, p.ScopeCreate(name="backfill"))
    c = await call(ers, p.ScopeCreate(name="research-2"))
    await call(ers, p.ScopeCreate())
    got = await call(ers, p.ScopeList(name="RESEARCH", order="desc"))
    assert [s.id for s in got.scopes] == [c.id, a.id]
    got = await call(ers, p.ScopeList(name="research", order="desc", before=c.id))
    assert [s.id for s in got.scopes] == [a.id]
    assert (await call(ers, p.ScopeList(name="research"), OTHER)).scopes == []
    with pytest.raises(ValidationError):
        await call(ers, p.ScopeList(name=""))


async def test_ops_items_lists_what_a_run_holds_by_kind(autojump_clock, ers):
    run = await call(ers, p.ScopeCreate(name="r"))
    other_run = await call(ers, p.ScopeCreate())
    await call(ers, p.MailboxEnsure(name="q"))
    await call(ers, p.MailboxEnsure(name="q2"))
    ts = [await call(ers, p.TaskSubmit(mailbox="q", scope_id=run.id, input=enc(i))) for i in range(5)]
    await call(ers, p.TaskSubmit(mailbox="q2", scope_id=run.id))
    elsewhere = await call(ers, p.TaskSubmit(mailbox="q", scope_id=other_run.id))
    await call(ers, p.TaskCancel(task_id=ts[1].id))
    g = await call(ers, p.GroupCreate(scope_id=run.id, mailbox="q", condition="ALL_TERMINAL"))
    js = await call(ers, p.JoinSetCreate(scope_id=run.id, name="fan"))
    bar = await call(ers, p.BarrierCreate(scope_id=run.id, target=2, name="b"))
    tmr = await call(ers, p.TimerCreate(scope_id=run.id, after_ms=60_000, name="t"))
    await call(ers, p.ClaimAcquire(scope_id=run.id, key="lock", holder="w1"))
    await call(ers, p.ClaimAcquire(scope_id=other_run.id, key="other-lock"))
    await call(ers, p.PoolEnsure(name="gpu", units_total=4))
    await call(ers, p.PoolAcquire(pool="gpu", scope_id=run.id, units=3, holder="w2"))

    kinds = ["tasks", "groups", "joinsets", "barriers", "timers", "claims", "grants"]
    v = await call(ers, p.OpsItems(scope_id=run.id, kinds=kinds, limit=3))
    assert [t.id for t in v.tasks] == [x.id for x in (await call(ers, p.OpsItems(scope_id=run.id, kinds=["tasks"],
                                                                                 limit=100))).tasks][:3]
    everything = (await call(ers, p.OpsItems(scope_id=run.id, kinds=["tasks"], limit=100))).tasks
    assert elsewhere.id not in {t.id for t in everything} and len(everything) == 6
    assert [t.id for t in everything] == sorted((t.id for t in everything), reverse=True)  # newest first
    # paging and filters
    page2 = await call(ers, p.OpsItems(scope_id=run.id, kinds=["tasks"], limit=100, before=ts[3].id))
    assert [t.id for t in page2.tasks] == [ts[2].id, ts[1].id, ts[0].id]
    cancelled = await call(ers, p.OpsItems(scope_id=run.id, kinds=["tasks"], state="CANCELLED"))
    assert [(t.id, t.state, t.mailbox) for t in cancelled.tasks] == [(ts[1].id, "CANCELLED", "q")]
    by_queue = await call(ers, p.OpsItems(kinds=["tasks"], mailbox="q2"))
    assert [t.mailbox for t in by_queue.tasks] == ["q2"]
    assert [x.id for x in v.groups] == [g.id] and v.groups[0].condition == "ALL_TERMINAL"
    assert [x.id for x in v.joinsets] == [js.id] and v.joinsets[0].children == []
    assert [x.id for x in v.barriers] == [bar.id] and [x.id for x in v.timers] == [tmr.id]
    assert [(c.key, c.holder) for c in v.claims] == [("lock", "w1")]
    assert [(x.pool, x.units, x.holder, x.token) for x in v.grants] == [("gpu", 3, "w2", 0)]  # never the token
    # the space's lists
    space = await call(ers, p.OpsItems(kinds=["claims", "groups", "grants"]))
    assert {c.key for c in space.claims} == {"lock", "other-lock"} and [x.id for x in space.groups] == [g.id]
    assert len(space.grants) == 1
    with pytest.raises(ValidationError):
        await call(ers, p.OpsItems(kinds=["secrets"]))
    with pytest.raises(ValidationError):
        await call(ers, p.OpsItems(kinds=["tasks"], limit=0))


async def test_ops_items_queues_depth_in_flight_done_and_oldest_ready(autojump_clock, ers):
    run = await call(ers, p.ScopeCreate())
    await call(ers, p.MailboxEnsure(name="jobs"))
    first = await call(ers, p.TaskSubmit(mailbox="jobs", scope_id=run.id))
    await trio.sleep(5)
    second = await call(ers, p.TaskSubmit(mailbox="jobs", scope_id=run.id))
    await call(ers, p.TaskSubmit(mailbox="jobs", scope_id=run.id))
    [q] = (await call(ers, p.OpsItems(kinds=["queues"]))).queues
    assert (q.name, q.queued, q.running, q.done, q.oldest_ready_at) == ("jobs", 3, 0, 0, first.created_at)
    d = (await call(ers, p.Receive(mailbox="jobs", scope_id=run.id))).deliveries[0]
    assert d.task_id == first.id
    await call(ers, p.DeliveryComplete(task_id=d.task_id, token=d.token))
    await call(ers, p.TaskCancel(task_id=second.id))  # a stale head of the ready heap
    d = (await call(ers, p.Receive(mailbox="jobs", scope_id=run.id, max_messages=1))).deliveries[0]
    [q] = (await call(ers, p.OpsItems(kinds=["queues"]))).queues
    assert (q.queued, q.running, q.done, q.oldest_ready_at) == (0, 1, 2, None)
    assert (await call(ers, p.OpsItems(kinds=["queues"]), OTHER)).queues == []


async def test_ops_task_shows_the_current_delivery_while_running(autojump_clock, ers):
    run = await call(ers, p.ScopeCreate())
    await call(ers, p.MailboxEnsure(name="jobs", max_attempts=3))
    t = await call(ers, p.TaskSubmit(mailbox="jobs", scope_id=run.id, input=enc({"n": 1})))
    v = await call(ers, p.OpsTask(task_id=t.id), read_only(ers))
    assert v.task.state == "QUEUED" and v.delivery is None and v.lease_left_ms is None and v.max_attempts == 3
    d = (await call(ers, p.Receive(mailbox="jobs", scope_id=run.id, lease_ms=30_000))).deliveries[0]
    await trio.sleep(10)
    v = await call(ers, p.OpsTask(task_id=t.id), read_only(ers))
    assert v.delivery.token == d.token and v.delivery.id == d.id and v.lease_left_ms == 20_000
    await call(ers, p.DeliveryRetry(task_id=t.id, token=d.token, error=enc("boom")))
    v = await call(ers, p.OpsTask(task_id=t.id))
    assert v.delivery is None and v.task.attempt == 2 and msgspec.msgpack.decode(v.task.error) == "boom"
    with pytest.raises(NotFoundError):
        await call(ers, p.OpsTask(task_id=t.id), OTHER)


async def test_ops_joinset_records_in_completion_order_with_closing_consumes_and_steps(autojump_clock, ers):
    run = await call(ers, p.ScopeCreate())
    await call(ers, p.MailboxEnsure(name="jobs"))
    js = await call(ers, p.JoinSetCreate(scope_id=run.id))
    a = await call(ers, p.JoinSetSubmit(joinset_id=js.id, mailbox="jobs"))
    b = await call(ers, p.JoinSetSubmit(joinset_id=js.id, mailbox="jobs"))
    c = await call(ers, p.JoinSetSubmit(joinset_id=js.id, mailbox="jobs"))
    await call(ers, p.JoinNext(joinset_id=js.id, try_only=True))  # step 0: pending
    await call(ers, p.JoinNext(joinset_id=js.id, try_only=True))  # step 1: pending (one entry, n=2)
    got = (await call(ers, p.Receive(mailbox="jobs", scope_id=run.id, max_messages=3))).deliveries
    by_task = {d.task_id: d for d in got}
    await call(ers, p.DeliveryComplete(task_id=b.child_id, token=by_task[b.child_id].token))  # b finishes first
    await call(ers, p.DeliveryReject(task_id=a.child_id, token=by_task[a.child_id].token))
    r = await call(ers, p.JoinNext(joinset_id=js.id))  # step 2: record 0 (b)
    assert r.child_id == b.child_id
    await call(ers, p.JoinSetClose(joinset_id=js.id))  # c is cancelled; a and c consumed closing
    v = await call(ers, p.OpsJoinSet(joinset_id=js.id), read_only(ers))
    assert [(x.child_id, x.ok, x.failure_kind, x.consumed, x.closing) for x in v.records] == [
        (b.child_id, True, None, True, False),
        (a.child_id, False, "failed", True, True),
        (c.child_id, False, "cancelled", True, True),
    ]
    assert [(s.step, s.op, s.outcome, s.index, s.n) for s in v.steps] == [
        (0, "try", "pending", 0, 2), (2, "next", "record", 0, 1)]
    assert v.joinset.state == "CLOSED" and v.closed_at is not None
    with pytest.raises(NotFoundError):
        await call(ers, p.OpsJoinSet(joinset_id=js.id), OTHER)


async def test_the_console_reads_need_only_coordination_read(autojump_clock, ers):
    run = await call(ers, p.ScopeCreate())
    for op in (p.OpsItems(scope_id=run.id, kinds=["tasks", "queues"]), p.ScopeList(name="x")):
        await call(ers, op, read_only(ers))
    with pytest.raises(ForbiddenError):  # a read-only session cannot write
        await call(ers, p.ScopeCancel(scope_id=run.id), read_only(ers))


async def test_roots_only_lists_read_the_roots_index_which_purge_and_recovery_keep(autojump_clock, ers):
    coord = ers.node.coordinator
    roots = [await call(ers, p.ScopeCreate(name=f"root-{i}")) for i in range(3)]
    for r in roots:
        for _ in range(3):
            await call(ers, p.ScopeCreate(parent_id=r.id))
    await call(ers, p.ScopeCreate(name="elsewhere"), OTHER)
    want = [r.id for r in reversed(roots)]
    assert [s.id for s in (await call(ers, p.ScopeList(roots_only=True, order="desc"))).scopes] == want
    assert [s.id for s in (await call(ers, p.ScopeList(roots_only=True, before=roots[2].id, order="desc")))
            .scopes] == want[1:]
    assert list(coord.runs.roots["s1"]) == [r.id for r in roots]
    before = {sp: list(ids) for sp, ids in coord.runs.roots.items()}
    coord.runs.rebuild_indexes()  # what recovery does
    assert {sp: list(ids) for sp, ids in coord.runs.roots.items()} == before
    # a purged root leaves the index (its subtree first, as retention does)
    for rid in reversed(list(coord.runs.subtree(roots[0].id))):
        coord.runs.purge_run(rid)
    assert [s.id for s in (await call(ers, p.ScopeList(roots_only=True))).scopes] == [roots[1].id, roots[2].id]
