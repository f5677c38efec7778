"""Claims (SPEC §8, runstate kernel §9; issue 15 item 1): exclusive fenced leases on a
key unique per space; renew, release with an observation, complete(result) once;
takeover after expiry bumps the generation; stale tokens get STALE_CLAIM; durable FIFO
waiters with a time limit; the cancellation row; leases on server time (MockClock)."""

from __future__ import annotations

import functools
from datetime import datetime, timedelta, timezone

import pytest
import trio

import rallypoint
from rallypoint import protocol as p
from rallypoint.client import types as t
from rallypoint.clock import Clock
from rallypoint.errors import (
    ClaimHeldError,
    DeadlineExceededError,
    LeaseLostError,
    NotFoundError,
    ScopeCancelledError,
    ValidationError,
    WaitTimeout,
)

from test_durability_restart import controlled_time


async def _acquire_raw(rs, run, key, **kw) -> t._ClaimLeaseReply:
    return await rs._call(p.ClaimAcquire(scope_id=run.id, key=key, **kw), t._ClaimLeaseReply)


# ------------------------------------------------------------------ the lease


async def test_acquire_gives_a_fenced_lease_and_a_second_acquire_is_claim_held(rs):
    run = await rs.scopes.create()
    lease = await run.claims.acquire("invoice-42", lease_seconds=30, holder="w1")
    assert lease.generation == 1 and lease.token > 0 and not lease.completed
    assert lease.lease_expires_at > datetime.now(timezone.utc) + timedelta(seconds=20)
    other = await rs.scopes.create()
    with pytest.raises(ClaimHeldError) as ei:  # keys are unique per space: any run
        await other.claims.acquire("invoice-42")
    assert ei.value.code == "CLAIM_HELD" and 20 < ei.value.retry_after <= 30
    assert ei.value.details["holder"] == "w1" and ei.value.details["generation"] == 1
    assert await other.claims.try_acquire("invoice-42") is None
    st = await rs.claims.status("invoice-42")
    assert st.state == "HELD" and st.generation == 1 and st.scope_id == run.id and st.holder == "w1"
    with pytest.raises(NotFoundError):
        await rs.claims.status("never-acquired")


async def test_renew_release_and_an_observation_for_the_next_acquirer(rs):
    run = await rs.scopes.create()
    lease = await run.claims.acquire("k", lease_seconds=10)
    before = lease.lease_expires_at
    after = await lease.renew(60)
    assert after > before + timedelta(seconds=40)
    info = await lease.release({"progress": "half done", "cursor": 17})
    assert info.state == "FREE" and info.observation == {"progress": "half done", "cursor": 17}
    assert await lease.release() is not None  # twice is harmless (the same lease: idempotent)
    nxt = await run.claims.acquire("k")
    assert nxt.generation == 2 and nxt.token != lease.token
    assert nxt.observation == {"progress": "half done", "cursor": 17}  # shown to the next acquirer
    with pytest.raises(LeaseLostError):  # the old token is stale now
        await lease.renew()
    assert lease.lost
    with pytest.raises(LeaseLostError) as ei:
        await rs._call(p.ClaimRelease(key="k", token=lease.token), t.ClaimInfo)
    assert ei.value.code == "STALE_CLAIM"
    assert (await rs.claims.status("k")).state == "HELD"  # the stale release changed nothing


async def test_complete_records_the_result_once_and_every_later_acquirer_gets_it(rs):
    run = await rs.scopes.create()
    lease = await run.claims.acquire("send-welcome-mail")
    info = await lease.complete({"message_id": "m-1"})
    assert info.state == "COMPLETED" and info.result == {"message_id": "m-1"}
    # a re-sent complete of the same lease returns the claim; another token is STALE_CLAIM
    again = await rs._call(p.ClaimComplete(key="send-welcome-mail", token=lease.token,
                                           result=rallypoint.client.api.encode_payload("other")), t.ClaimInfo)
    assert again.result == {"message_id": "m-1"}
    with pytest.raises(LeaseLostError):
        await rs._call(p.ClaimComplete(key="send-welcome-mail", token=lease.token + 1), t.ClaimInfo)
    for r in (run, await rs.scopes.create()):
        later = await r.claims.acquire("send-welcome-mail")
        assert later.completed and later.result == {"message_id": "m-1"} and later.token == 0
    with pytest.raises(LeaseLostError):
        await lease.renew()


async def test_a_resent_acquire_with_the_same_request_id_returns_the_same_lease(rs):
    run = await rs.scopes.create()
    a = await _acquire_raw(rs, run, "dedup", request_id="r-1")
    b = await _acquire_raw(rs, run, "dedup", request_id="r-1")
    assert a.status == b.status == "ACQUIRED" and a.token == b.token and b.claim.generation == 1
    with pytest.raises(ClaimHeldError):
        await _acquire_raw(rs, run, "dedup", request_id="r-2")


async def test_validation(rs):
    run = await rs.scopes.create()
    for kw in ({"lease_ms": 4_000}, {"lease_ms": 601_000}, {"wait_ms": 24 * 3600 * 1000 + 1}):
        with pytest.raises(ValidationError):
            await _acquire_raw(rs, run, "v", **kw)
    with pytest.raises(ValidationError):
        await _acquire_raw(rs, run, "")
    with pytest.raises(ValidationError):
        await _acquire_raw(rs, run, "x" * 257)
    lease = await run.claims.acquire("v")
    with pytest.raises(ValidationError):
        await lease.complete(b"x" * 70_000)  # results are payloads: 64 KiB at most


# ------------------------------------------------------------------ takeover, time


async def test_takeover_after_expiry_bumps_the_generation_and_the_old_token_is_stale(autojump_clock, ers):
    run = await ers.scopes.create()
    a = await run.claims.acquire("k", lease_seconds=5)
    await trio.sleep(6)  # a never renews
    b = await run.claims.acquire("k", lease_seconds=30)
    assert b.generation == a.generation + 1
    for call in (a.renew(), a.complete("late"), ers._call(p.ClaimRelease(key="k", token=a.token), t.ClaimInfo)):
        with pytest.raises(LeaseLostError) as ei:
            await call
        assert ei.value.code == "STALE_CLAIM"
    assert await a.release() is None  # the SDK's release after a loss does nothing
    st = await ers.claims.status("k")
    assert st.state == "HELD" and st.generation == 2


async def test_a_lease_is_judged_at_request_time(autojump_clock, ers):
    run = await ers.scopes.create()
    a = await run.claims.acquire("k", lease_seconds=5)
    await trio.sleep(4)
    autojump_clock.jump(1.5)  # past the expiry; no task has run since (and no stall: < 2 s)
    with pytest.raises(LeaseLostError) as ei:
        await a.renew()
    assert "expired" in ei.value.message
    assert (await ers.claims.status("k")).state == "FREE"


async def test_keep_alive_renews_and_a_lost_lease_cancels_the_body(autojump_clock, ers):
    run = await ers.scopes.create()
    lease = await run.claims.acquire("k", lease_seconds=6)
    async with lease.keep_alive():
        await trio.sleep(60)  # ten lease lengths, renewed every 2 s
    assert (await ers.claims.status("k")).generation == 1 and not lease.lost
    body_done = False
    with pytest.raises(LeaseLostError):
        async with lease.keep_alive():
            await run.cancel()  # the next renewal is refused: the holder must stop
            await trio.sleep(3600)
            body_done = True
    assert not body_done and lease.lost


async def test_hold_acquires_keeps_and_releases(autojump_clock, ers):
    run = await ers.scopes.create()
    async with run.claims.hold("k", lease_seconds=5) as lease:
        await trio.sleep(20)
        assert (await ers.claims.status("k")).state == "HELD"
    st = await ers.claims.status("k")
    assert st.state == "FREE" and st.generation == 1 and lease.released


# ------------------------------------------------------------------ waiters


async def test_waiters_are_served_first_come_first_served_without_polling(autojump_clock, ers):
    run = await ers.scopes.create()
    holder = await run.claims.acquire("k", lease_seconds=30)
    order: list[tuple[str, int]] = []

    async def wait_for(name):
        lease = await run.claims.acquire("k", lease_seconds=30, wait=600, holder=name)
        order.append((name, lease.generation))
        await trio.sleep(1)
        await lease.release(name)

    async with trio.open_nursery() as n:
        for name in ("first", "second", "third"):
            n.start_soon(wait_for, name)
            await trio.sleep(0.01)
        st = await ers.claims.status("k")
        assert [w.holder for w in st.waiters] == ["first", "second", "third"]
        t0 = trio.current_time()
        await holder.release()
    assert order == [("first", 2), ("second", 3), ("third", 4)]
    assert trio.current_time() - t0 < 3.5  # handed over at each release (1 s each), not polled
    assert (await ers.claims.status("k")).observation == "third"


async def test_a_wait_longer_than_one_request_keeps_its_place(autojump_clock, ers):
    run = await ers.scopes.create()
    holder = await run.claims.acquire("k", lease_seconds=600)
    got = []

    async def waiter(name, delay):
        await trio.sleep(delay)
        got.append((name, await run.claims.acquire("k", wait=3600, holder=name)))

    async with trio.open_nursery() as n:
        n.start_soon(waiter, "early", 0)
        n.start_soon(waiter, "late", 100)  # queued after the early one re-issued its wait
        await trio.sleep(300)  # the early waiter's request was re-sent 4 times meanwhile
        assert [w.holder for w in (await ers.claims.status("k")).waiters] == ["early", "late"]
        await holder.release()
        await trio.sleep(1)
        assert [name for name, _ in got] == ["early"]
        await got[0][1].release()
    assert [name for name, _ in got] == ["early", "late"]


async def test_a_waiter_whose_time_runs_out_leaves_the_queue_with_wait_timeout(autojump_clock, ers):
    run = await ers.scopes.create()
    await run.claims.acquire("k", lease_seconds=600)
    t0 = trio.current_time()
    with pytest.raises(WaitTimeout):
        await run.claims.acquire("k", wait=30)
    assert 29 <= trio.current_time() - t0 <= 31
    assert (await ers.claims.status("k")).waiters == []


async def test_a_waiter_whose_time_ends_as_the_lease_runs_out_gets_the_lease(autojump_clock, ers):
    """Issue 34 item 7, for claims: the waiter's time limit, its request's wait and the
    lease's expiry are one instant; the lease running out falls due at it, so the
    waiter is handed the lease (generation 2), not told TIMEOUT."""
    run = await ers.scopes.create()
    await run.claims.acquire("tie", lease_seconds=30)
    t0 = trio.current_time()
    got = await _acquire_raw(ers, run, "tie", lease_ms=30_000, wait_ms=30_000, request_id="tie-waiter")
    assert (got.status, got.claim.generation, got.request_id) == ("ACQUIRED", 2, "tie-waiter")
    assert trio.current_time() - t0 == pytest.approx(30, abs=0.01)
    assert (await ers.claims.status("tie")).waiters == []


async def test_a_cancelled_acquire_withdraws_its_waiter(autojump_clock, ers):
    run = await ers.scopes.create()
    holder = await run.claims.acquire("k", lease_seconds=600)
    with trio.move_on_after(5):
        await run.claims.acquire("k", wait=600)
    assert (await ers.claims.status("k")).waiters == []
    await holder.release()
    assert (await ers.claims.status("k")).state == "FREE"  # nobody got a lease no one holds


async def test_withdrawing_a_request_that_was_already_served_releases_its_lease(autojump_clock, ers):
    run = await ers.scopes.create()
    holder = await run.claims.acquire("k", lease_seconds=600)
    waiting = await _acquire_raw(ers, run, "k", wait_ms=600_000, request_id="req-1")
    assert waiting.status == "WAITING" and waiting.position == 1  # after one 60 s park
    await holder.release()  # handed to req-1 in the same step, though nobody is parked for it
    assert (await ers.claims.status("k")).generation == 2
    out = await ers._call(p.ClaimCancelWait(key="k", request_id="req-1"), t._CancelWaitReply)
    assert out.outcome == "released"  # its client gave up: the lease goes back at once
    assert (await ers.claims.status("k")).state == "FREE"
    out = await ers._call(p.ClaimCancelWait(key="k", request_id="req-1"), t._CancelWaitReply)
    assert out.outcome == "none"


# ------------------------------------------------------------------ cancellation row


async def test_cancellation_row(autojump_clock, ers):
    """In an inactive run: acquire refused; waiters answered at once (the claim's own run
    and another run's); renewals refused; release allowed and hands over to an active
    waiter; complete refused; the claim and its result stay readable."""
    owner = await ers.scopes.create(name="owner")
    other = await ers.scopes.create(name="other")
    lease = await owner.claims.acquire("k", lease_seconds=60)
    done = await owner.claims.acquire("done", lease_seconds=60)
    await done.complete({"r": 1})
    answers: dict[str, object] = {}

    async def wait_in(run, name):
        try:
            if name == "other-waiter":
                answers[name] = await run.claims.acquire("k", wait=600, holder=name)
            else:  # the raw request: its first answer, with no SDK re-send or withdrawal
                answers[name] = await _acquire_raw(ers, run, "k", wait_ms=600_000, holder=name, request_id=name)
        except Exception as e:  # noqa: BLE001
            answers[name] = e

    child = await owner.child(name="child")
    async with trio.open_nursery() as n:
        n.start_soon(wait_in, owner, "owner-waiter")
        n.start_soon(wait_in, child, "child-waiter")
        n.start_soon(wait_in, other, "other-waiter")
        await trio.sleep(1)
        assert len((await ers.claims.status("k")).waiters) == 3
        t0 = trio.current_time()
        await owner.cancel()
        for _ in range(1000):
            if len(answers) >= 2:
                break
            await trio.sleep(0)
        assert len(answers) == 2 and trio.current_time() == t0  # at once, in no virtual time
        st = await ers.claims.status("k")
        assert [w.holder for w in st.waiters] == ["other-waiter"]
        for name in ("owner-waiter", "child-waiter"):
            assert isinstance(answers[name], ScopeCancelledError), answers[name]
        with pytest.raises(ScopeCancelledError):
            await owner.claims.acquire("new-key")
        with pytest.raises(ScopeCancelledError):
            await lease.renew()
        assert lease.lost
        with pytest.raises(ScopeCancelledError):
            await ers._call(p.ClaimComplete(key="k", token=lease.token), t.ClaimInfo)
        info = await lease.release("stopped early")  # release stays allowed...
        assert info is not None and info.state in ("FREE", "HELD")
    got = answers["other-waiter"]  # ...and hands the claim to the active run's waiter
    assert got.generation == 2 and got.scope_id == other.id and got.observation == "stopped early"
    assert (await ers.claims.status("done")).result == {"r": 1}  # results stay readable
    assert (await other.claims.acquire("done")).result == {"r": 1}


async def test_a_deadline_refuses_acquires_and_answers_waiters_with_deadline_exceeded(autojump_clock, ers):
    clock = ers.node.coordinator.clock
    run = await ers.scopes.create(deadline=datetime.fromtimestamp(clock.now() + 10, tz=timezone.utc))
    holder = await (await ers.scopes.create()).claims.acquire("k", lease_seconds=600)
    t0 = trio.current_time()
    with pytest.raises(DeadlineExceededError):
        await run.claims.acquire("k", wait=600)
    assert 9.9 <= trio.current_time() - t0 <= 10.1  # answered when the deadline passed
    with pytest.raises(DeadlineExceededError):
        await run.claims.acquire("other")
    assert (await ers.claims.status("k")).waiters == []
    await holder.release()


# ------------------------------------------------------------------ restarts


@pytest.mark.parametrize("crash", [False, True], ids=["clean", "crash"])
async def test_leases_and_waiters_survive_a_restart_and_get_the_downtime_back(tmp_path, autojump_clock, crash):
    import shutil

    live, crashed = tmp_path / "live", tmp_path / "crashed"
    clock = Clock()
    async with controlled_time() as tc:
        async with rallypoint.open_embedded(str(live), durability="fsync", clock=clock) as rs:
            run = await rs.scopes.create()
            lease = await run.claims.acquire("k", lease_seconds=30)
            async with trio.open_nursery() as n:  # a waiter whose client is gone (a parked request dropped)
                n.start_soon(functools.partial(_acquire_raw, rs, run, "k", wait_ms=3_600_000, request_id="w-1",
                                               holder="w1"))
                while not (await rs.claims.status("k")).waiters:
                    await trio.sleep(0)
                n.cancel_scope.cancel()
            expiring = await run.claims.acquire("short", lease_seconds=5)
            if crash:
                j = rs.node.coordinator.journal
                await j.wait_durable(j.last_lsn)
                shutil.copytree(live, crashed)
        await tc.advance(120)  # down for two minutes: longer than the leases
        async with rallypoint.open_embedded(str(crashed if crash else live), durability="fsync", clock=clock) as rs:
            assert rs.node.recovery_info["leases_extended_ms"] == pytest.approx(120_000, abs=5)
            st = await rs.claims.status("k")
            assert st.state == "HELD" and st.generation == 1 and [w.holder for w in st.waiters] == ["w1"]
            renewed = await rs._call(p.ClaimRenew(key="k", token=lease.token, lease_ms=30_000), t._ClaimLeaseReply)
            assert renewed.token == lease.token
            await tc.advance(6)  # the 5 s lease (given its 120 s back) runs out on time
            assert (await rs.claims.status("short")).state == "FREE"
            await rs._call(p.ClaimRelease(key="k", token=lease.token), t.ClaimInfo)
            again = await _acquire_raw(rs, rs.scope(run.id), "k", wait_ms=3_600_000, request_id="w-1")
            assert again.status == "ACQUIRED" and again.claim.generation == 2  # the waiter kept its place
            assert expiring.generation == 1


async def test_a_renewal_sent_in_time_survives_an_event_loop_stall(autojump_clock, ers):
    run = await ers.scopes.create()
    lease = await run.claims.acquire("k", lease_seconds=5)
    await trio.sleep(1)
    autojump_clock.jump(9)  # a 9 s stall: the holder could not be heard
    await lease.renew()  # still its lease: the stall was given back
    assert ers.node.coordinator.stalls == 1 and (await ers.claims.status("k")).generation == 1


async def test_keys_are_unique_per_space_and_invisible_across_spaces():
    from rallypoint.actors import Coordinator
    from rallypoint.service import Session

    async def go():
        coord = Coordinator()
        a, b = Session(space="a"), Session(space="b")
        ra = coord.decide(a, p.ScopeCreate()).id
        rb = coord.decide(b, p.ScopeCreate()).id
        la = coord.decide(a, p.ClaimAcquire(scope_id=ra, key="same"))
        lb = coord.decide(b, p.ClaimAcquire(scope_id=rb, key="same"))  # another space: its own claim
        assert la.status == lb.status == "ACQUIRED" and la.claim.id != lb.claim.id
        with pytest.raises(NotFoundError):
            coord.decide(b, p.ClaimAcquire(scope_id=ra, key="x"))  # a's run is not b's
        with pytest.raises(LeaseLostError):  # b cannot touch a's lease with its own token
            coord.decide(b, p.ClaimRelease(key="same", token=la.token))
        assert coord.decide(a, p.ClaimStatus(key="same")).state == "HELD"
        assert [c.key for c in coord.decide(b, p.ClaimList()).claims] == ["same"]

    await go()


async def test_a_claims_actor_runs_in_its_owning_runs_nursery_and_a_pools_under_the_root(autojump_clock, ers):
    rt = ers.node.coordinator.runtime
    run = await ers.scopes.create()
    child = await run.child()
    lease = await child.claims.acquire("k", lease_seconds=60)
    pool = await ers.pools.ensure("tree", 1)
    await lease.renew()  # a command on the claim's actor: active now (idle ones passivate after 2 s)
    a = rt.get(lease.claim_id)
    assert a is not None and a.parent_id == child.id and a.depth == rt.get(child.id).depth + 1
    info = await pool.status()
    assert rt.get(info.id).parent_id is None
    await run.cancel()  # its nursery and everything below it: the claim's actor too
    await trio.sleep(0)
    assert rt.tasks_below(run.id) == 0
