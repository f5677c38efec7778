"""Task groups (SPEC §4): every row of the decision table, both outcomes, and what
finalizing does, as one step. Deadlines run under the MockClock (``ers``)."""

import pytest
import trio

import rallypoint
from rallypoint.errors import ConflictError, LeaseLostError, ScopeCancelledError, ScopeInactiveError

from conftest import CROSS_TREE, parked_waits, until, wait_parked_remote
from _groups_util import decision, in_, new_group, submit_n, succeed_all, take, UNFINISHED


def fin(outcome, reason):
    return ("FINALIZED", outcome, reason)


# --- FIRST_ACCEPTED --------------------------------------------------------------------


async def test_first_accepted_succeeds_on_the_first_accept_and_cancels_the_rest(rs):
    mbx, run, g = await new_group(rs, "FIRST_ACCEPTED")
    a, b, c = await submit_n(g, 3)
    ds = await take(mbx, g.scope_id, 2)  # a, b RUNNING; c QUEUED
    await ds[a.id].complete("draft a")
    assert decision(await g.status()) == ("OPEN", None, None)  # succeeded, not yet judged
    v = await g.accept(a)
    assert (v.group_state, v.outcome, v.outcome_reason) == fin("SUCCESS", "first_accepted")
    st = await g.status()
    assert decision(st) == fin("SUCCESS", "first_accepted") and st.finalized_at is not None
    assert {m.task_id: m.task_state for m in st.members} == {a.id: "SUCCEEDED", b.id: "CANCELLED", c.id: "CANCELLED"}
    gate = await rs.scope(g.scope_id).status()
    assert (gate.stored_state, gate.effective) == ("CANCELLED", "INACTIVE")
    with pytest.raises(ScopeCancelledError):
        await ds[b.id].complete("too late")  # completing on a cancelled run is refused


async def test_first_accepted_does_not_fail_when_every_member_is_rejected(rs):
    # SPEC: FIRST_ACCEPTED fails only when its deadline passes.
    mbx, run, g = await new_group(rs, "FIRST_ACCEPTED", expected_members=2)
    a, b = await submit_n(g, 2)
    ds = await take(mbx, g.scope_id)
    await ds[a.id].complete(1)
    await ds[b.id].reject("x")
    await g.reject(a)
    await g.reject(b)
    assert decision(await g.status()) == ("SEALED", None, None)
    assert decision(await g.close()) == ("SEALED", None, None)


async def test_first_accepted_fails_when_its_deadline_passes(autojump_clock, ers):
    mbx, run, g = await new_group(ers, "FIRST_ACCEPTED", deadline=in_(3600))
    a, b = await submit_n(g, 2)
    ds = await take(mbx, g.scope_id, 1)
    await ds[a.id].complete(1)  # succeeded, never judged
    st = await g.wait(timeout=7200)
    assert decision(st) == fin("FAILURE", "deadline")
    assert {m.task_id: m.task_state for m in st.members} == {a.id: "SUCCEEDED", b.id: "CANCELLED"}
    late = await g.accept(a)
    assert late.late and (late.outcome, late.outcome_reason) == ("FAILURE", "deadline")


# --- N_ACCEPTED ------------------------------------------------------------------------


async def test_n_accepted_reaches_its_threshold_while_open(rs):
    mbx, run, g = await new_group(rs, "N_ACCEPTED", threshold=2)
    ts = await submit_n(g, 4)
    await succeed_all(mbx, g, ts[:2])
    v = await g.accept(ts[0])
    assert v.group_state == "OPEN"
    v = await g.accept(ts[1])
    assert (v.group_state, v.outcome, v.outcome_reason) == fin("SUCCESS", "threshold_reached")
    st = await g.status()
    assert [m.task_state for m in st.members] == ["SUCCEEDED", "SUCCEEDED", "CANCELLED", "CANCELLED"]


async def test_n_accepted_reaches_its_threshold_while_sealed(rs):
    mbx, run, g = await new_group(rs, "N_ACCEPTED", threshold=2)
    ts = await submit_n(g, 3)
    await succeed_all(mbx, g, ts)
    await g.accept(ts[0])
    assert decision(await g.close()) == ("SEALED", None, None)
    v = await g.accept(ts[2])
    assert (v.group_state, v.outcome, v.outcome_reason) == fin("SUCCESS", "threshold_reached")


async def test_n_accepted_unreachable_only_once_sealed_and_close_decides_it(rs):
    mbx, run, g = await new_group(rs, "N_ACCEPTED", threshold=2)
    a, b, c = await submit_n(g, 3)
    ds = await take(mbx, g.scope_id)
    await ds[a.id].reject("x")
    await ds[b.id].reject("y")
    await ds[c.id].complete("z")
    await g.accept(c)
    # 1 accepted + 0 still acceptable < 2, but OPEN: more members may come
    assert decision(await g.status()) == ("OPEN", None, None)
    d = await g.close()
    assert (d.state, d.outcome, d.outcome_reason) == fin("FAILURE", "threshold_unreachable")


async def test_n_accepted_unreachable_by_a_reject_after_sealing(rs):
    mbx, run, g = await new_group(rs, "N_ACCEPTED", threshold=2, expected_members=3)
    a, b, c = await submit_n(g, 3)
    assert (await g.status()).state == "SEALED"
    await succeed_all(mbx, g, [a, b])  # c stays RUNNING: still acceptable
    v = await g.reject(a)
    assert v.group_state == "SEALED"  # b and c can still make 2
    v = await g.reject(b)
    assert (v.group_state, v.outcome, v.outcome_reason) == fin("FAILURE", "threshold_unreachable")
    assert {m.task_id: m.task_state for m in (await g.status()).members}[c.id] == "CANCELLED"


async def test_n_accepted_unreachable_by_a_member_failing_after_sealing(rs):
    mbx, run, g = await new_group(rs, "N_ACCEPTED", threshold=1, expected_members=1)
    (a,) = await submit_n(g, 1)
    ds = await take(mbx, g.scope_id)
    await ds[a.id].reject("crashed")
    st = await g.status()
    assert decision(st) == fin("FAILURE", "threshold_unreachable")


async def test_n_accepted_fails_when_its_deadline_passes(autojump_clock, ers):
    mbx, run, g = await new_group(ers, "N_ACCEPTED", threshold=2, deadline=in_(60))
    ts = await submit_n(g, 3)
    await succeed_all(mbx, g, ts[:1])
    await g.accept(ts[0])
    await g.close()  # sealed: 1 accepted + 2 still acceptable, undecided
    st = await g.wait(timeout=120)
    assert decision(st) == fin("FAILURE", "deadline")


# --- ALL_TERMINAL ----------------------------------------------------------------------


async def test_all_terminal_succeeds_once_sealed_all_finished_and_judged(rs):
    mbx, run, g = await new_group(rs, "ALL_TERMINAL")
    a, b, c = await submit_n(g, 3)
    ds = await take(mbx, g.scope_id)
    await ds[a.id].complete(1)
    await ds[b.id].complete(2)
    await ds[c.id].reject("crashed")  # FAILED members do not fail ALL_TERMINAL
    await g.accept(a)
    await g.accept(b)
    d = await g.close()
    assert (d.state, d.outcome, d.outcome_reason) == fin("SUCCESS", "all_terminal")


async def test_all_terminal_waits_for_a_verdict_on_every_succeeded_member(rs):
    mbx, run, g = await new_group(rs, "ALL_TERMINAL", expected_members=2)
    a, b = await submit_n(g, 2)
    await succeed_all(mbx, g, [a, b])
    await g.accept(a)
    assert decision(await g.status()) == ("SEALED", None, None)  # b not judged yet
    v = await g.accept(b)
    assert (v.group_state, v.outcome, v.outcome_reason) == fin("SUCCESS", "all_terminal")


async def test_all_terminal_with_a_rejected_member_fails(rs):
    mbx, run, g = await new_group(rs, "ALL_TERMINAL", expected_members=3)
    a, b, c = await submit_n(g, 3)
    await succeed_all(mbx, g, [a, b, c])
    await g.accept(a)
    await g.reject(b)
    v = await g.accept(c)
    assert (v.group_state, v.outcome, v.outcome_reason) == fin("FAILURE", "all_terminal")


async def test_all_terminal_with_nothing_accepted_fails(rs):
    mbx, run, g = await new_group(rs, "ALL_TERMINAL", expected_members=2)
    a, b = await submit_n(g, 2)
    ds = await take(mbx, g.scope_id)
    await ds[a.id].reject("x")
    assert (await g.status()).state == "SEALED"
    await ds[b.id].reject("y")
    assert decision(await g.status()) == fin("FAILURE", "all_terminal")


async def test_all_terminal_fails_when_its_deadline_passes_while_sealed(autojump_clock, ers):
    mbx, run, g = await new_group(ers, "ALL_TERMINAL", deadline=in_(30))
    ts = await submit_n(g, 2)
    await succeed_all(mbx, g, ts[:1])
    await g.accept(ts[0])
    assert (await g.close()).state == "SEALED"
    await trio.sleep(31)
    assert decision(await g.status()) == fin("FAILURE", "deadline")


# --- while OPEN, sealing, cancellation, close ------------------------------------------


@pytest.mark.parametrize("condition, kw", [("N_ACCEPTED", dict(threshold=1)), ("ALL_TERMINAL", {})])
async def test_members_failing_while_open_do_not_fail_the_group(rs, condition, kw):
    mbx, run, g = await new_group(rs, condition, **kw)
    a, b = await submit_n(g, 2)
    ds = await take(mbx, g.scope_id)
    await ds[a.id].reject("x")
    await rs.task(b.id).cancel()
    assert decision(await g.status()) == ("OPEN", None, None)
    (c,) = await submit_n(g, 1, start=2)  # a later member can still succeed
    await succeed_all(mbx, g, [c])
    v = await g.accept(c)
    if condition == "N_ACCEPTED":
        assert (v.outcome, v.outcome_reason) == ("SUCCESS", "threshold_reached")
    else:
        assert v.group_state == "OPEN"
        assert decision(await g.close()) == fin("SUCCESS", "all_terminal")


async def test_the_submit_that_adds_the_last_expected_member_seals_the_group(rs):
    mbx, run, g = await new_group(rs, "ALL_TERMINAL", expected_members=3)
    await submit_n(g, 2)
    assert (await g.status()).state == "OPEN"
    await g.submit("third", key="third")
    assert (await g.status()).state == "SEALED"
    with pytest.raises(ConflictError):
        await g.submit("fourth")


@pytest.mark.not_in_cluster(CROSS_TREE)
async def test_the_sealing_join_is_evaluated_in_the_same_step(rs):
    # threshold 2, expected 2: one member failed while open (harmless), then the join
    # that seals adds an already-failed task: unreachable at once.
    mbx, run, g = await new_group(rs, "N_ACCEPTED", threshold=2, expected_members=2)
    (a,) = await submit_n(g, 1)
    ds = await take(mbx, g.scope_id)
    await ds[a.id].reject("x")
    assert (await g.status()).state == "OPEN"
    other = await rs.scopes.create()
    outside = await mbx.submit("o", scope=other)
    await (await mbx.receive(other, wait=0)).reject("y")
    added = await g.join_task(outside)
    assert added.id == outside.id
    assert decision(await g.status()) == fin("FAILURE", "threshold_unreachable")


@pytest.mark.parametrize("which", ["gate", "parent", "grandparent"])
async def test_cancelling_the_gate_or_an_ancestor_fails_the_group_as_cancelled(rs, which):
    mbx = await rs.mailboxes.ensure("grp-cancel")
    top = await rs.scopes.create()
    parent = await top.child()
    g = await parent.groups.create(mbx, "N_ACCEPTED", threshold=1)
    a, b = await submit_n(g, 2)
    ds = await take(mbx, g.scope_id, 1)
    target = {"gate": rs.scope(g.scope_id), "parent": parent, "grandparent": top}[which]
    base = await parked_waits(rs)
    async with trio.open_nursery() as n:
        seen = []

        async def waiter():
            seen.append(await g.wait(timeout=10))

        n.start_soon(waiter)
        await wait_parked_remote(rs, 1, base=base)  # the wait is parked when the cancel comes
        await target.cancel()
    assert decision(seen[0]) == fin("FAILURE", "cancelled")
    assert {m.task_state for m in seen[0].members} == {"CANCELLED"}
    with pytest.raises(ScopeInactiveError):
        await ds[a.id].complete("late")
    d = await g.close()
    assert (d.state, d.outcome, d.outcome_reason) == fin("FAILURE", "cancelled")


async def test_a_parent_deadline_fails_the_group_as_deadline(autojump_clock, ers):
    mbx = await ers.mailboxes.ensure("m")
    run = await ers.scopes.create(deadline=in_(10))
    g = await run.groups.create(mbx, "FIRST_ACCEPTED")
    await submit_n(g, 1)
    st = await g.wait(timeout=60)
    assert decision(st) == fin("FAILURE", "deadline")


async def test_close_returns_the_decision_and_is_repeatable(rs):
    mbx, run, g = await new_group(rs, "FIRST_ACCEPTED")
    (a,) = await submit_n(g, 1)
    d1 = await g.close()
    assert (d1.state, d1.outcome, d1.outcome_reason) == ("SEALED", None, None)
    assert await g.close() == d1
    await succeed_all(mbx, g, [a])
    await g.accept(a)
    d2 = await g.close()
    assert (d2.state, d2.outcome, d2.outcome_reason) == fin("SUCCESS", "first_accepted")
    assert await g.close() == d2


# --- what finalizing does --------------------------------------------------------------


async def test_finalizing_refuses_receives_stops_consume_cancels_members_and_wakes_waiters(rs):
    mbx, run, g = await new_group(rs, "N_ACCEPTED", threshold=1)
    a, b, c = await submit_n(g, 3)
    ds = await take(mbx, g.scope_id, 2)  # a, b RUNNING; c QUEUED
    await ds[a.id].complete("good")
    seen = {"got": []}

    async def waiter():
        seen["wait"] = await g.wait(timeout=30)

    async def handler(d):
        seen["got"].append(d.task_id)
        await trio.sleep_forever()  # holds c until the run stops

    async def gate_worker():
        # two loops: one holds c, the other long-polls the gate for more
        seen["stats"] = await rallypoint.consume(rs, mbx, g.scope_id, handler, concurrency=2, wait=30)

    base = await parked_waits(rs)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(waiter)
            n.start_soon(gate_worker)
            # the group's wait and consume's second loop (long-polling the gate) are
            # parked on the server; the first loop holds c
            await wait_parked_remote(rs, 2, base=base)
            await until(lambda: seen["got"] == [c.id])
            v = await g.accept(a)
            assert v.group_state == "FINALIZED"
        # the nursery exits only because consume returned and the waiter woke
    assert seen["stats"].stop_reason == "SCOPE_CANCELLED"
    assert decision(seen["wait"]) == fin("SUCCESS", "threshold_reached")
    st = await g.status()
    assert {m.task_id: m.task_state for m in st.members} == {a.id: "SUCCEEDED", b.id: "CANCELLED", c.id: "CANCELLED"}
    with pytest.raises(ScopeCancelledError):
        await mbx.receive(g.scope_id, wait=0)
    assert await mbx.receive(run, wait=0) is None  # nothing of the group is left for the parent
    assert (await run.status()).effective == "ACTIVE"
    with pytest.raises((LeaseLostError, ScopeInactiveError)):
        await ds[b.id].renew()
    assert not UNFINISHED & {m.task_state for m in st.members}


async def test_a_verdict_after_the_deadline_cannot_decide_even_before_the_timer_fires(autojump_clock, ers):
    # The deadline refuses work at its instant (SPEC §2), before the timer task runs;
    # a verdict arriving in that window must not turn the group into a SUCCESS.
    mbx, run, g = await new_group(ers, "FIRST_ACCEPTED", deadline=in_(10))
    (a,) = await submit_n(g, 1)
    await succeed_all(mbx, g, [a])
    autojump_clock.jump(11)  # past the deadline; the embedded call dispatches before any checkpoint
    v = await g.accept(a)
    assert (v.group_state, v.outcome, v.outcome_reason) == fin("FAILURE", "deadline")
    assert v.late


async def test_close_after_the_deadline_decides_deadline_even_before_the_timer_fires(autojump_clock, ers):
    mbx, run, g = await new_group(ers, "N_ACCEPTED", threshold=2, deadline=in_(10))
    await submit_n(g, 1)
    autojump_clock.jump(11)
    d = await g.close()
    assert (d.state, d.outcome, d.outcome_reason) == fin("FAILURE", "deadline")


async def test_join_task_past_the_deadline_is_refused_even_before_the_timer_fires(autojump_clock, ers):
    from rallypoint.errors import DeadlineExceededError

    mbx, run, g = await new_group(ers, "ALL_TERMINAL", deadline=in_(10))
    outside = await mbx.submit("o", scope=run)
    autojump_clock.jump(11)
    with pytest.raises(DeadlineExceededError):
        await g.join_task(outside)
    with pytest.raises(DeadlineExceededError):
        await g.submit("x")


async def test_a_cancel_after_the_deadline_keeps_deadline_as_the_reason(autojump_clock, ers):
    mbx, run, g = await new_group(ers, "FIRST_ACCEPTED", deadline=in_(10))
    await submit_n(g, 1)
    autojump_clock.jump(11)  # past the deadline, its timer not yet run
    await run.cancel()
    assert decision(await g.status()) == fin("FAILURE", "deadline")
