"""Runs (SPEC §2), through the SDK, embedded and over TCP."""

from datetime import datetime, timedelta, timezone

import pytest
import trio

import rallypoint
from rallypoint.errors import (
    ConflictError,
    DeadlineExceededError,
    LimitError,
    NotFoundError,
    ScopeCancelledError,
    ValidationError,
)


def in_(seconds: float) -> datetime:
    return datetime.now(timezone.utc) + timedelta(seconds=seconds)


async def test_create_child_status(rs):
    run = await rs.scopes.create(name="nightly")
    child = await run.child(name="shard-1")
    st = await child.status()
    assert st.parent_id == run.id and st.name == "shard-1"
    assert (st.stored_state, st.effective) == ("ACTIVE", "ACTIVE")
    assert (await run.status()).children == 1
    assert run.id.startswith("scp_") and child.id > run.id  # time-ordered ids


async def test_two_creates_make_two_runs(rs):
    a = await rs.scopes.create(name="same")
    b = await rs.scopes.create(name="same")
    assert a.id != b.id


async def test_reattach_by_id(rs):
    run = await rs.scopes.create(name="x")
    st = await rs.scope(run.id).status()
    assert st.id == run.id and st.name == "x"


async def test_unknown_run_is_not_found(rs):
    with pytest.raises(NotFoundError):
        await rs.scope("scp_00000000000000000000000000").status()


async def test_cancel_makes_subtree_inactive_and_refuses_children(rs):
    run = await rs.scopes.create()
    child = await run.child()
    grandchild = await child.child()
    st = await run.cancel(reason="stop")
    assert st.stored_state == "CANCELLED" and st.effective == "INACTIVE"
    gst = await grandchild.status()
    assert (gst.stored_state, gst.effective, gst.inactive_reason) == ("ACTIVE", "INACTIVE", "ancestor_cancelled")
    for r in (run, child, grandchild):
        with pytest.raises(ScopeCancelledError):
            await r.child()


async def test_cancel_cancelled_is_idempotent_other_combinations_conflict(rs):
    a = await rs.scopes.create()
    first = await a.cancel()
    again = await a.cancel()
    assert again.stored_state == "CANCELLED" and again.ended_at == first.ended_at
    with pytest.raises(ConflictError):
        await a.complete()
    b = await rs.scopes.create()
    st = await b.complete()
    assert st.stored_state == "COMPLETED" and st.effective == "INACTIVE"
    with pytest.raises(ConflictError):
        await b.cancel()
    with pytest.raises(ConflictError):
        await b.complete()
    with pytest.raises(ScopeCancelledError):
        await b.child()


async def test_run_status_has_a_state_like_every_status(rs):
    # issue 31.11: RunStatus.state is one word -- ACTIVE while the run accepts work,
    # CANCELLED / COMPLETED once it ended itself, INACTIVE while an ancestor's end refuses
    # its work (stored_state and effective stay as they were).
    run = await rs.scopes.create()
    child = await run.child()
    done = await rs.scopes.create()
    assert (await run.status()).state == "ACTIVE"
    assert (await done.complete()).state == "COMPLETED"
    st = await run.cancel()
    assert (st.state, st.stored_state) == ("CANCELLED", "CANCELLED")
    cst = await child.status()
    assert (cst.state, cst.stored_state, cst.effective) == ("INACTIVE", "ACTIVE", "INACTIVE")
    assert cst["state"] == "INACTIVE"  # as every field of a status reads


async def test_child_limit(rs):
    run = await rs.scopes.create(child_limit=2)
    await run.child()
    await run.child()
    with pytest.raises(LimitError) as ei:
        await run.child()
    assert ei.value.code == "LIMIT_EXCEEDED"


async def test_deadline_in_the_past_is_validation_failed(rs):
    with pytest.raises(ValidationError) as ei:
        await rs.scopes.create(deadline=in_(-10))
    assert "deadline" in ei.value.message


async def test_bad_name_is_validation_failed(rs):
    # a run's name is a label (runstate's run names: 1-256 characters, spaces and / too)
    assert (await (await rs.scopes.create(name="nightly research/v2")).status()).name == "nightly research/v2"
    with pytest.raises(ValidationError) as ei:
        await rs.scopes.create(name="line\nbreak")
    assert "name" in ei.value.message
    with pytest.raises(ValidationError):
        await rs.scopes.create(name="x" * 257)
    with pytest.raises(ValidationError):
        await rs.scopes.create(name="")


async def test_list_roots_and_children(rs):
    run = await rs.scopes.create(name="lister")
    c1 = await run.child()
    kids = await run.children()
    assert [k.id for k in kids] == [c1.id]
    roots = await rs.scopes.list(roots_only=True, limit=10_000)
    assert run.id in {r.id for r in roots} and c1.id not in {r.id for r in roots}


# --- deadlines under the mock clock (embedded) ---------------------------------------


def vin(rs, seconds: float) -> datetime:
    """An instant ``seconds`` after now on the coordinator's (virtual) clock."""
    return datetime.fromtimestamp(rs.node.coordinator.clock.now() + seconds, tz=timezone.utc)


async def test_hour_long_deadline_passes_in_virtual_time(autojump_clock, ers):
    run = await ers.scopes.create(deadline=vin(ers, 3600))
    child = await run.child()
    grandchild = await child.child()
    await trio.sleep(3599)
    assert (await grandchild.status()).effective == "ACTIVE"
    await grandchild.child()  # still allowed one second before
    await trio.sleep(1.001)
    st = await grandchild.status()
    assert (st.effective, st.inactive_reason) == ("INACTIVE", "ancestor_deadline")
    assert (await run.status()).stored_state == "ACTIVE"
    assert (await run.status()).state == "INACTIVE"  # past its deadline: refuses work
    for r in (run, child, grandchild):
        with pytest.raises(DeadlineExceededError):
            await r.child()


async def test_deadline_refuses_at_the_instant_even_before_the_timer_fires(autojump_clock, ers):
    # The refusal is computed from the tree, not from a fired timer.
    node = ers.node
    run = await ers.scopes.create(deadline=vin(ers, 10))
    node.coordinator.heap.clear()  # no activity will ever fire
    await trio.sleep(10.001)
    with pytest.raises(DeadlineExceededError):
        await run.child()


async def test_cancel_is_one_atomic_step(autojump_clock, ers):
    # Given a 40-run tree with queued tasks everywhere, a concurrent observer that looks
    # at the whole state at every scheduling point never sees a mix: either every run
    # is active with its tasks queued, or every run is inactive with its tasks cancelled.
    coord = ers.node.coordinator
    mbx = await ers.mailboxes.ensure("atomic")
    run = await ers.scopes.create()
    level, all_runs = [run], [run]
    for _ in range(3):
        nxt = [await r.child() for r in level for _ in range(3)]
        all_runs += nxt
        level = nxt
    for r in all_runs:
        await mbx.submit({"run": r.id}, scope=r)
    seen = set()
    stop = trio.Event()
    looked = trio.Event()

    async def observer():
        while not stop.is_set():
            active = {coord.runs.inactive_error(r.id) is None for r in all_runs}
            queued = {t.state for t in coord.queues.tasks.values()}
            seen.add((frozenset(active), frozenset(queued)))
            looked.set()
            await trio.sleep(0)

    async with trio.open_nursery() as n:
        n.start_soon(observer)
        await looked.wait()
        async with trio.open_nursery() as n2:  # the cancel races the observer
            n2.start_soon(run.cancel)
            for _ in range(20):
                await trio.sleep(0)
        stop.set()
    assert seen == {
        (frozenset({True}), frozenset({"QUEUED"})),
        (frozenset({False}), frozenset({"CANCELLED"})),
    }
