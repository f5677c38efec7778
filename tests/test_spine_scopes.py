"""SPEC §2 details not covered by tests/test_scopes.py: what ``status()`` reports
(counts of children and of tasks by state, instants, reasons), the child limit's
edges, and what an inactive run does to its queued work."""

from datetime import datetime, timedelta, timezone

import pytest
import trio

from rallypoint.errors import LimitError, ScopeCancelledError, ValidationError


def in_(seconds: float) -> datetime:
    return datetime.now(timezone.utc) + timedelta(seconds=seconds)


async def test_status_fields(rs):
    before = datetime.now(timezone.utc) - timedelta(seconds=1)
    dl = in_(3600).replace(microsecond=0)
    run = await rs.scopes.create(name="fields", deadline=dl, child_limit=7)
    st = await run.status()
    assert st.id == run.id and st.name == "fields" and st.parent_id is None
    assert (st.stored_state, st.effective, st.inactive_reason) == ("ACTIVE", "ACTIVE", None)
    assert st.deadline == dl and st.deadline.tzinfo is not None
    assert st.created_at.tzinfo is not None and before <= st.created_at <= datetime.now(timezone.utc)
    assert st.ended_at is None and st.child_limit == 7
    assert st.children == 0 and st.tasks == {}
    assert st["name"] == "fields"  # mapping access too


async def test_status_counts_children_and_tasks_by_state(rs):
    run = await rs.scopes.create()
    kids = [await run.child() for _ in range(3)]
    await kids[0].child()  # a grandchild is not a direct child
    mbx = await rs.mailboxes.ensure("spine-scope-counts")
    tickets = [await mbx.submit({"i": i}, scope=run) for i in range(5)]
    await mbx.submit("in child", scope=kids[1])  # counted on the child, not the parent
    d1 = await mbx.receive(run, wait=1)
    await d1.complete("ok")
    d2 = await mbx.receive(run, wait=1)  # stays RUNNING
    d3 = await mbx.receive(run, wait=1)
    await d3.reject("bad")
    await tickets[4].cancel()
    st = await run.status()
    assert st.children == 3
    assert st.tasks == {"SUCCEEDED": 1, "RUNNING": 1, "FAILED": 1, "CANCELLED": 1, "QUEUED": 1}, st.tasks
    assert d2.task_id in {t.id for t in tickets}
    assert (await kids[1].status()).tasks == {"QUEUED": 1}
    assert (await kids[0].status()).children == 1


async def test_cancel_cancels_queued_and_running_work_and_counts_show_it(rs):
    run = await rs.scopes.create()
    child = await run.child()
    mbx = await rs.mailboxes.ensure("spine-scope-cancel")
    done = await mbx.submit(0, scope=run)
    d0 = await mbx.receive(run, wait=1)
    assert d0.task_id == done.id
    await d0.complete({"answer": 42})
    t_root = await mbx.submit(1, scope=run)
    t_child = await mbx.submit(2, scope=child)
    d = await mbx.receive(run, wait=1)
    assert d.task_id == t_root.id  # RUNNING when the run is cancelled
    await run.cancel(reason="stop")
    st = await run.status()
    assert st.ended_at is not None and st.inactive_reason == "cancelled"
    assert st.tasks == {"SUCCEEDED": 1, "CANCELLED": 1}
    assert (await t_child.status()).state == "CANCELLED"
    assert (await child.status()).tasks == {"CANCELLED": 1}
    # recorded results stay readable
    info = await done.result(timeout=1)
    assert (info.state, info.outcome) == ("SUCCEEDED", {"answer": 42})
    # an agent can still hand back what it holds (retry is answered; nothing changes)
    await d.retry("giving back")
    assert (await t_root.status()).state == "CANCELLED"


async def test_completed_parent_makes_children_inactive_with_reason(rs):
    run = await rs.scopes.create()
    child = await run.child()
    st = await run.complete()
    assert (st.stored_state, st.effective, st.inactive_reason) == ("COMPLETED", "INACTIVE", "completed")
    cst = await child.status()
    assert (cst.stored_state, cst.effective, cst.inactive_reason) == ("ACTIVE", "INACTIVE", "ancestor_completed")
    with pytest.raises(ScopeCancelledError):
        await child.child()
    # the child itself can still be cancelled (its own state is ACTIVE)
    assert (await child.cancel()).stored_state == "CANCELLED"


async def test_deadline_reason_and_children(rs):
    run = await rs.scopes.create(deadline=in_(0.3))
    child = await run.child()
    await trio.sleep(0.35)
    st = await run.status()
    assert (st.stored_state, st.effective, st.inactive_reason) == ("ACTIVE", "INACTIVE", "deadline")
    cst = await child.status()
    assert (cst.effective, cst.inactive_reason) == ("INACTIVE", "ancestor_deadline")
    # a run past its deadline can still be cancelled or completed (its own state)
    assert (await run.complete()).stored_state == "COMPLETED"


async def test_child_limit_edges(rs):
    zero = await rs.scopes.create(child_limit=0)
    with pytest.raises(LimitError):
        await zero.child()
    run = await rs.scopes.create(child_limit=2)
    a = await run.child()
    await run.child()
    await a.cancel()  # ended children still count: the limit is on children made
    with pytest.raises(LimitError) as ei:
        await run.child()
    assert "child_limit" in ei.value.message or ei.value.details.get("field") == "child_limit"
    assert (await run.status()).children == 2


async def test_child_deadline_and_naive_datetime(rs):
    run = await rs.scopes.create()
    with pytest.raises(ValidationError) as ei:
        await run.child(deadline=datetime.now() + timedelta(hours=1))  # naive
    assert "deadline" in ei.value.message
    with pytest.raises(ValidationError) as ei:
        await run.child(deadline="not a date")
    assert "deadline" in ei.value.message
    with pytest.raises(ValidationError):
        await run.child(deadline=in_(-1))
    assert (await run.status()).children == 0  # nothing half-made
