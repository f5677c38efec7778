"""consume(): the SDK worker loop (SPEC §3)."""

import threading
from functools import partial
import uuid

import trio

import rallypoint
from rallypoint.client.consume import consume


async def test_blocked_handler_is_cancelled_within_one_renewal_period(autojump_clock, ers):
    m = await ers.mailboxes.ensure("c-block")
    run = await ers.scopes.create()
    ticket = await m.submit("forever", scope=run)
    started, cancelled_at = trio.Event(), {}

    async def handler(d):
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            cancelled_at["t"] = trio.current_time()

    result = {}

    async def worker():
        result["stats"] = await consume(ers, m, run, handler, lease_seconds=30)

    async with trio.open_nursery() as n:
        n.start_soon(worker)
        await started.wait()
        await trio.sleep(47)  # several renewals happen meanwhile
        assert "t" not in cancelled_at
        cancel_t = trio.current_time()
        await run.cancel()
    assert cancelled_at["t"] - cancel_t <= 10.0 + 1e-6  # lease/3
    stats = result["stats"]
    assert stats.stop_reason == "SCOPE_CANCELLED" and stats.lost == 1 and stats.completed == 0
    assert (await ticket.status()).state == "CANCELLED"


async def test_long_handler_keeps_its_lease_by_renewing(autojump_clock, ers):
    m = await ers.mailboxes.ensure("c-renew")
    run = await ers.scopes.create()
    ticket = await m.submit(3, scope=run)
    seen = {}

    async def handler(d):
        await trio.sleep(100)  # > 3 leases
        seen["token"] = d.token
        return d.input * 2

    async with trio.open_nursery() as n:
        n.start_soon(partial(consume, ers, m, run, handler, lease_seconds=15))
        res = await ticket.result(timeout=200)
        await run.cancel()
    assert (res.state, res.outcome, res.attempt, seen["token"]) == ("SUCCEEDED", 6, 1, 1)


async def test_lost_lease_cancels_the_handler_and_consume_goes_on(autojump_clock, ers):
    m = await ers.mailboxes.ensure("c-lost")
    run = await ers.scopes.create()
    stuck = await m.submit("stuck", scope=run)
    cancelled = trio.Event()

    async def handler(d):
        if d.input == "stuck":
            try:
                await trio.sleep_forever()
            finally:
                cancelled.set()
        return "ok:" + d.input

    result = {}

    async def worker():
        result["stats"] = await consume(ers, m, run, handler, lease_seconds=6)

    async with trio.open_nursery() as n:
        n.start_soon(worker)
        await trio.sleep(1)
        await stuck.cancel()  # the holder's next renewal is refused
        with trio.fail_after(2.01):
            await cancelled.wait()
        nxt = await m.submit("next", scope=run)
        assert (await nxt.result(timeout=10)).outcome == "ok:next"
        await run.cancel()
    s = result["stats"]
    assert (s.received, s.lost, s.completed, s.stop_reason) == (2, 1, 1, "SCOPE_CANCELLED")


async def test_raising_handler_is_retried_until_failed(autojump_clock, ers):
    m = await ers.mailboxes.ensure("c-raise", max_attempts=3)
    run = await ers.scopes.create()
    ticket = await m.submit("boom", scope=run)
    calls = []

    async def handler(d):
        calls.append(d.attempt)
        raise RuntimeError(f"attempt {d.attempt} failed")

    async with trio.open_nursery() as n:
        n.start_soon(consume, ers, m, run, handler)
        res = await ticket.result(timeout=60)
        await run.cancel()
    assert calls == [1, 2, 3]
    assert (res.state, res.outcome_reason, res.attempt) == ("FAILED", "max_attempts", 3)
    assert res.error == "RuntimeError: attempt 3 failed"


async def test_consume_concurrency_and_returns_when_run_cancelled(autojump_clock, ers):
    m = await ers.mailboxes.ensure("c-conc")
    run = await ers.scopes.create()
    child = await run.child()
    tickets = await m.submit_many(list(range(12)), scope=child)
    running, peak = [0], [0]

    async def handler(d):
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        await trio.sleep(1)
        running[0] -= 1
        return d.input + 100

    result = {}

    async def worker():
        result["stats"] = await consume(ers, m, run, handler, concurrency=4)

    async with trio.open_nursery() as n:
        n.start_soon(worker)
        for t in tickets:
            await t.result(timeout=60)
        await trio.sleep(5)
        assert "stats" not in result  # still serving
        await run.cancel()
        with trio.fail_after(1):
            while "stats" not in result:
                await trio.sleep(0.01)
    assert peak[0] == 4
    assert [(await t.status()).outcome for t in tickets] == [i + 100 for i in range(12)]
    assert result["stats"].completed == 12 and result["stats"].stop_reason == "SCOPE_CANCELLED"


async def test_consume_returns_on_deadline(autojump_clock, ers):
    from datetime import datetime, timedelta, timezone

    m = await ers.mailboxes.ensure("c-deadline")
    run = await ers.scopes.create(deadline=datetime.now(timezone.utc) + timedelta(seconds=50))

    async def handler(d):
        return None

    stats = await consume(ers, m, run, handler, wait=20)
    assert stats.stop_reason == "DEADLINE_EXCEEDED"


async def test_sync_handler_runs_in_a_worker_thread(rs):
    m = await rs.mailboxes.ensure(f"c-sync-{uuid.uuid4().hex[:8]}")
    run = await rs.scopes.create()
    tickets = await m.submit_many([1, 2, 3], scope=run)
    threads = set()

    def handler(d):
        threads.add(threading.get_ident())
        if d.input == 2 and d.attempt == 1:
            raise ValueError("once")
        return d.input * 10

    async with trio.open_nursery() as n:
        n.start_soon(consume, rs, m, run, handler)
        with trio.fail_after(10):
            results = [await t.result(timeout=10) for t in tickets]
        await run.cancel()
    assert [r.outcome for r in results] == [10, 20, 30]
    assert [r.attempt for r in results] == [1, 2, 1]
    assert threading.get_ident() not in threads


async def test_consume_is_exported():
    assert rallypoint.consume is consume


async def _consume_until_done(ers, m, run, handler, tickets, **kw):
    """consume() until every ticket's task is finished, then cancel the run:
    (the tasks' infos, consume's stats)."""
    result = {}

    async def worker():
        result["stats"] = await consume(ers, m, run, handler, **kw)

    async with trio.open_nursery() as n:
        n.start_soon(worker)
        infos = await ers.results(tickets, timeout=300)
        await run.cancel()
    return infos, result["stats"]


async def test_consume_receives_for_its_free_slots_and_coalesces_completes(autojump_clock, ers, monkeypatch):
    """One receive asks for as many deliveries as there are free handler slots, and
    handlers that finish together are completed by one complete_many: 40 tasks with 8
    slots take far fewer requests than 40 receives and 40 completes."""
    from rallypoint import protocol as p

    m = await ers.mailboxes.ensure("c-batch")
    run = await ers.scopes.create()
    tickets = await m.submit_many(list(range(40)), scope=run)
    ops: list[str] = []
    call, call_many = ers._call, ers._call_many

    async def counting_call(op, reply_type):
        ops.append(type(op).__name__)
        return await call(op, reply_type)

    async def counting_call_many(batch, reply_type):
        ops.extend(type(op).__name__ for op in batch)
        return await call_many(batch, reply_type)

    monkeypatch.setattr(ers, "_call", counting_call)
    monkeypatch.setattr(ers, "_call_many", counting_call_many)

    async def handler(d):
        await trio.sleep(1)  # the 8 of a receive finish together
        return d.input + 1

    infos, stats = await _consume_until_done(ers, m, run, handler, tickets, concurrency=8)
    assert [(i.state, i.outcome) for i in infos] == [("SUCCEEDED", k + 1) for k in range(40)]
    assert stats.completed == 40
    receives = [o for o in ops if o == p.Receive.__name__]
    assert 5 <= len(receives) <= 12, ops  # ~40 / 8, plus the last one the cancel answers
    assert p.DeliveryComplete.__name__ not in ops
    assert 5 <= ops.count(p.DeliveryCompleteMany.__name__) <= 10, ops


async def test_consume_completes_large_outcomes_within_the_frame_limit(autojump_clock, ers):
    """Coalesced completes stay under the 1 MiB frame: 30 outcomes of ~60 KiB each
    finishing together are all recorded (none retried for the batch's size)."""
    m = await ers.mailboxes.ensure("c-large")
    run = await ers.scopes.create()
    tickets = await m.submit_many(list(range(30)), scope=run)

    async def handler(d):
        await trio.sleep(1)
        return "x" * 60_000

    infos, stats = await _consume_until_done(ers, m, run, handler, tickets, concurrency=30)
    assert all(i.state == "SUCCEEDED" and i.attempt == 1 for i in infos)
    assert stats.completed == 30 and stats.retried == 0


async def test_one_renewer_keeps_every_long_handler_leased(autojump_clock, ers):
    """Renewals are scheduled by one task for all running handlers: handlers started at
    different times, each running for several leases, all keep their first delivery."""
    m = await ers.mailboxes.ensure("c-renew-many")
    run = await ers.scopes.create()
    tickets = await m.submit_many(list(range(6)), scope=run)

    async def handler(d):
        await trio.sleep(40 + 7 * d.input)  # 3-5 leases of 15 s, staggered
        return d.token

    infos, _ = await _consume_until_done(ers, m, run, handler, tickets, concurrency=6, lease_seconds=15)
    assert [(i.state, i.attempt, i.outcome) for i in infos] == [("SUCCEEDED", 1, 1)] * 6
