"""Task groups (SPEC §4): creation, membership and verdicts, embedded and over TCP."""

import pytest

from rallypoint.errors import (
    ConflictError,
    LimitError,
    NotFoundError,
    ScopeCancelledError,
    ValidationError,
)

from _groups_util import new_group, succeed_all, take, uniq
from conftest import CROSS_TREE


# --- create ----------------------------------------------------------------------------


async def test_gate_run_is_a_child_of_the_run_the_group_was_created_from(rs):
    mbx, run, g = await new_group(rs, "FIRST_ACCEPTED")
    st = await g.status()
    assert g.id.startswith("grp_") and st.scope_id.startswith("scp_") and st.scope_id != run.id
    assert (st.state, st.outcome, st.parent_scope_id, st.mailbox) == ("OPEN", None, run.id, mbx.name)
    gate = await rs.scope(st.scope_id).status()
    assert gate.parent_id == run.id and gate.group_id == g.id and gate.effective == "ACTIVE"
    assert (await run.status()).children == 1


@pytest.mark.not_in_cluster(CROSS_TREE)
async def test_gate_run_is_a_child_of_parent_scope_id_when_given(rs):
    mbx = await rs.mailboxes.ensure(uniq("mbx"))
    origin = await rs.scopes.create()
    other = await rs.scopes.create()
    parent = await other.child()
    g = await origin.groups.create(mbx, "N_ACCEPTED", threshold=1, parent_scope_id=parent)
    gate = await rs.scope(g.scope_id).status()
    assert gate.parent_id == parent.id
    assert (await origin.status()).children == 0 and (await parent.status()).children == 1
    # ... so cancelling that parent's ancestor finalizes the group
    await other.cancel()
    st = await g.wait(timeout=5)
    assert (st.state, st.outcome, st.outcome_reason) == ("FINALIZED", "FAILURE", "cancelled")


async def test_create_with_a_missing_mailbox_is_not_found(rs):
    run = await rs.scopes.create()
    with pytest.raises(NotFoundError):
        await run.groups.create(uniq("no-such-mailbox"), "FIRST_ACCEPTED")


async def test_create_on_an_inactive_run_is_refused(rs):
    mbx = await rs.mailboxes.ensure(uniq("mbx"))
    run = await rs.scopes.create()
    await run.cancel()
    with pytest.raises(ScopeCancelledError):
        await run.groups.create(mbx, "FIRST_ACCEPTED")


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(condition="N_ACCEPTED"), "threshold"),  # threshold required
        (dict(condition="N_ACCEPTED", threshold=0), "threshold"),
        (dict(condition="N_ACCEPTED", threshold=3, expected_members=2), "expected_members"),
        (dict(condition="ALL_TERMINAL", expected_members=0), "expected_members"),
        (dict(condition="ALL_TERMINAL", expected_members=101), "expected_members"),
        (dict(condition="FIRST_ACCEPTED", threshold=2), "threshold"),
        (dict(condition="MOST_ACCEPTED"), "condition"),
    ],
)
async def test_create_validates_condition_threshold_and_expected_members(rs, kw, field):
    mbx = await rs.mailboxes.ensure(uniq("mbx"))
    run = await rs.scopes.create()
    with pytest.raises(ValidationError) as ei:
        await run.groups.create(mbx, **kw)
    assert ei.value.details["field"] == field


async def test_expected_members_bounds_1_and_100_and_equal_to_threshold_are_accepted(rs):
    mbx = await rs.mailboxes.ensure(uniq("mbx"))
    run = await rs.scopes.create()
    for kw in (dict(expected_members=1), dict(expected_members=100)):
        g = await run.groups.create(mbx, "ALL_TERMINAL", **kw)
        assert (await g.status()).expected_members == kw["expected_members"]
    g = await run.groups.create(mbx, "N_ACCEPTED", threshold=4, expected_members=4)
    st = await g.status()
    assert (st.threshold, st.expected_members) == (4, 4)


# --- members ---------------------------------------------------------------------------


async def test_submit_adds_a_member_task_in_the_gate_run_delivered_through_the_mailbox(rs):
    mbx, run, g = await new_group(rs, "FIRST_ACCEPTED")
    t = await g.submit({"draft": 1}, key="d1")
    assert t.info.scope_id == g.scope_id and t.info.group_id == g.id and t.info.state == "QUEUED"
    assert t.info.mailbox == mbx.name
    # not visible to a receiver on an unrelated run; visible on the gate (and ancestors)
    stranger = await rs.scopes.create()
    assert await mbx.receive(stranger, wait=0) is None
    d = await mbx.receive(run, wait=0)  # the creating run is the gate's parent
    assert d.task_id == t.id and d.input == {"draft": 1} and d.group_id == g.id
    st = await g.status()
    assert [(m.task_id, m.task_state, m.key, m.verdict, m.late) for m in st.members] == [
        (t.id, "RUNNING", "d1", None, False)
    ]
    assert st.counts["members"] == 1


@pytest.mark.not_in_cluster(CROSS_TREE)
async def test_join_task_adds_an_existing_task_while_open(rs):
    mbx, run, g = await new_group(rs, "FIRST_ACCEPTED")
    other = await rs.scopes.create()
    outside = await mbx.submit({"x": 1}, scope=other)
    t = await g.join_task(outside)
    assert t.id == outside.id and t.info.group_id == g.id
    assert (await g.join_task(outside.id)).id == outside.id  # again: the same member
    assert [m.task_id for m in (await g.status()).members] == [outside.id]
    # it still runs where it was submitted, and counts for the group
    d = await mbx.receive(other, wait=0)
    await d.complete("done")
    v = await g.accept(outside)
    assert (v.group_state, v.outcome, v.outcome_reason) == ("FINALIZED", "SUCCESS", "first_accepted")


async def test_join_task_refuses_a_member_of_another_group_and_a_closed_group(rs):
    mbx, run, g1 = await new_group(rs, "FIRST_ACCEPTED")
    g2 = await run.groups.create(mbx, "FIRST_ACCEPTED")
    t = await g1.submit("a")
    with pytest.raises(ConflictError):
        await g2.join_task(t)
    await g2.close()
    fresh = await mbx.submit("b", scope=run)
    with pytest.raises(ConflictError):
        await g2.join_task(fresh)


async def test_a_group_holds_at_most_100_members(rs):
    mbx, run, g = await new_group(rs, "ALL_TERMINAL")
    first = None
    for i in range(100):
        t = await g.submit(i, key=f"k{i}")
        first = first or t
    with pytest.raises(LimitError):
        await g.submit(100, key="k100")
    with pytest.raises(LimitError):
        await g.join_task(await mbx.submit("outside", scope=run))
    assert (await g.submit(0, key="k0")).id == first.id  # resubmission still answers
    st = await g.status()
    assert st.state == "OPEN" and st.counts["members"] == 100


async def test_submit_after_close_is_conflict_but_resubmission_returns_the_member(rs):
    mbx, run, g = await new_group(rs, "N_ACCEPTED", threshold=1)
    a = await g.submit({"a": 1}, key="a")
    d = await g.close()
    assert (d.state, d.outcome, d.outcome_reason) == ("SEALED", None, None)
    with pytest.raises(ConflictError):
        await g.submit({"b": 1}, key="b")
    with pytest.raises(ConflictError):
        await g.submit({"b": 1})
    with pytest.raises(ConflictError):
        await g.submit({"a": 2}, key="a")  # same key, other input
    assert (await g.submit({"a": 1}, key="a")).id == a.id
    # ... and still once finalized
    await succeed_all(mbx, g, [a])
    await g.accept(a)
    assert (await g.status()).state == "FINALIZED"
    again = await g.submit({"a": 1}, key="a")
    assert again.id == a.id and again.info.state == "SUCCEEDED"
    with pytest.raises(ConflictError):
        await g.submit({"c": 1}, key="c")


async def test_resubmission_while_open_returns_the_member_and_adds_nothing(rs):
    mbx, run, g = await new_group(rs, "ALL_TERMINAL", expected_members=2)
    a = await g.submit("x", key="a")
    assert (await g.submit("x", key="a")).id == a.id
    st = await g.status()
    assert st.state == "OPEN" and st.counts["members"] == 1  # the resubmission did not seal


async def test_submit_to_an_unknown_group_is_not_found(rs):
    with pytest.raises(NotFoundError):
        await rs.group("grp_00000000000000000000000000").submit("x")
    with pytest.raises(NotFoundError):
        await (await rs.scopes.create()).groups.by_id("grp_00000000000000000000000000").status()


# --- verdicts --------------------------------------------------------------------------


async def test_accept_requires_succeeded_and_reject_requires_finished(rs):
    mbx, run, g = await new_group(rs, "ALL_TERMINAL")
    m0, m1, m2 = [await g.submit(i) for i in range(3)]
    ds = await take(mbx, g.scope_id, 2)  # FIFO: m0 and m1 RUNNING, m2 stays QUEUED
    assert set(ds) == {m0.id, m1.id}
    for t, state in ((m2, "QUEUED"), (m0, "RUNNING"), (m1, "RUNNING")):
        with pytest.raises(ConflictError) as ei:
            await g.accept(t)
        assert ei.value.details["task_state"] == state
        with pytest.raises(ConflictError):
            await g.reject(t)
    await ds[m1.id].reject("boom")  # m1 FAILED
    with pytest.raises(ConflictError):
        await g.accept(m1)  # finished but not SUCCEEDED
    v = await g.reject(m1)  # finished: may be rejected
    assert (v.task_id, v.verdict, v.late, v.group_state) == (m1.id, "REJECTED", False, "OPEN")
    await ds[m0.id].complete("ok")
    v = await g.accept(m0)
    assert (v.verdict, v.late, v.group_state) == ("ACCEPTED", False, "OPEN")
    with pytest.raises(NotFoundError):
        await g.accept(await mbx.submit("stranger", scope=run))  # not a member


async def test_verdicts_are_idempotent_and_the_opposite_verdict_is_conflict(rs):
    mbx, run, g = await new_group(rs, "ALL_TERMINAL")
    a, b = await g.submit("a"), await g.submit("b")
    await succeed_all(mbx, g, [a, b])
    va = await g.accept(a)
    assert (await g.accept(a)) == va
    vb = await g.reject(b)
    assert (await g.reject(b)) == vb
    with pytest.raises(ConflictError):
        await g.reject(a)
    with pytest.raises(ConflictError):
        await g.accept(b)
    st = await g.status()
    assert {m.task_id: m.verdict for m in st.members} == {a.id: "ACCEPTED", b.id: "REJECTED"}
    assert (st.counts["accepted"], st.counts["rejected"]) == (1, 1)


async def test_verdicts_after_finalization_are_late_and_never_change_the_outcome(rs):
    mbx, run, g = await new_group(rs, "FIRST_ACCEPTED")
    a, b, c, d = [await g.submit(x) for x in "abcd"]
    ds = await take(mbx, g.scope_id)
    for t in (a, b, c):
        await ds[t.id].complete("ok")  # d stays RUNNING
    v = await g.accept(a)
    assert (v.late, v.group_state, v.outcome, v.outcome_reason) == (False, "FINALIZED", "SUCCESS", "first_accepted")
    late_b = await g.accept(b)
    assert (late_b.verdict, late_b.late, late_b.outcome, late_b.outcome_reason) == (
        "ACCEPTED", True, "SUCCESS", "first_accepted")
    assert await g.accept(b) == late_b  # idempotent, still late
    late_c = await g.reject(c)
    assert (late_c.verdict, late_c.late) == ("REJECTED", True)
    late_d = await g.reject(d)  # d was cancelled by the finalization: finished, may be rejected
    assert late_d.late
    with pytest.raises(ConflictError):
        await g.accept(d)  # CANCELLED, not SUCCEEDED
    with pytest.raises(ConflictError):
        await g.reject(a)  # opposite verdict, even after finalization
    st = await g.status()
    assert (st.state, st.outcome, st.outcome_reason) == ("FINALIZED", "SUCCESS", "first_accepted")
    assert {m.task_id: (m.task_state, m.verdict, m.late) for m in st.members} == {
        a.id: ("SUCCEEDED", "ACCEPTED", False),
        b.id: ("SUCCEEDED", "ACCEPTED", True),
        c.id: ("SUCCEEDED", "REJECTED", True),
        d.id: ("CANCELLED", "REJECTED", True),
    }


async def test_a_late_rejection_cannot_turn_a_success_into_a_failure(rs):
    # ALL_TERMINAL: 'none rejected' is judged at finalization; a later reject is late.
    mbx, run, g = await new_group(rs, "ALL_TERMINAL", expected_members=2)
    a, b = await g.submit("a"), await g.submit("b")
    ds = await take(mbx, g.scope_id)
    await ds[a.id].complete(1)
    await ds[b.id].reject("nope")  # FAILED: finished, not judged
    v = await g.accept(a)
    assert (v.group_state, v.outcome) == ("FINALIZED", "SUCCESS")
    late = await g.reject(b)
    assert late.late and (late.outcome, late.outcome_reason) == ("SUCCESS", "all_terminal")
    assert (await g.status()).outcome == "SUCCESS"
