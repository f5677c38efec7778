"""Admission with requirements and work limits (runstate kernel §7.1-7.4; issue 15 item
5): a task is handed out only when all of its pool units can be taken in the same step
(all or nothing, never over-granted), its grants go back when its delivery ends, and
work limits cap the unfinished tasks of a run. Includes a Hypothesis model of the
decide/apply core (many workers, few units) and a race over TCP."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rallypoint
from rallypoint import protocol as p
from rallypoint.actors import Coordinator
from rallypoint.actors.common import MemoryJournal
from rallypoint.actors.runtime import Park
from rallypoint.client import types as t
from rallypoint.errors import (
    ConflictError,
    LimitError,
    NotFoundError,
    RallypointError,
    ScopeCancelledError,
    ValidationError,
)
from rallypoint.service import Session


# ------------------------------------------------------------------ submit


async def test_requirements_are_checked_at_submission(rs):
    await rs.pools.ensure("adm-gpu", 2)
    mbx = await rs.mailboxes.ensure("adm-jobs")
    run = await rs.scopes.create()
    with pytest.raises(NotFoundError):
        await mbx.submit(1, scope=run, requirements={"pools": {"no-such-pool": 1}})
    with pytest.raises(ValidationError) as ei:
        await mbx.submit(1, scope=run, requirements={"pools": {"adm-gpu": 3}})
    assert "exceeds" in ei.value.message  # could never be admitted
    with pytest.raises(ValidationError):
        await mbx.submit(1, scope=run, requirements={"pools": {"adm-gpu": 0}})
    for i in range(4):
        await rs.pools.ensure(f"adm-p{i}", 1)
    with pytest.raises(ValidationError):  # at most 4 pools
        await mbx.submit(1, scope=run, requirements={"pools": {f"adm-p{i}": 1 for i in range(4)} | {"adm-gpu": 1}})
    with pytest.raises(ValidationError):
        await mbx.submit(1, scope=run, requirements={"pools": {"adm-gpu": "two"}})
    with pytest.raises(ValidationError):
        await mbx.submit(1, scope=run, requirements={"quotas": {}})  # not a requirement type (yet)
    assert (await run.status()).tasks == {}  # nothing was submitted


# ------------------------------------------------------------------ admission


async def test_admit_takes_every_requirement_in_one_step_or_none(rs):
    a = await rs.pools.ensure("aon-a", 2)
    b = await rs.pools.ensure("aon-b", 1)
    mbx = await rs.mailboxes.ensure("aon")
    run = await rs.scopes.create()
    both = await mbx.submit("both", scope=run, requirements={"pools": {"aon-a": 1, "aon-b": 1}})
    first = await mbx.admit(run)
    assert first.task_id == both.id
    assert sorted((g.pool, g.units) for g in first.grants) == [("aon-a", 1), ("aon-b", 1)]
    assert all(g.token > 0 and g.task_id == both.id and g.lease_expires_at is None for g in first.grants)
    again = await mbx.submit("again", scope=run, requirements={"pools": {"aon-a": 1, "aon-b": 1}})
    assert await mbx.admit(run) is None  # b is taken: nothing, and a was not taken either
    assert ((await a.status()).units_used, (await b.status()).units_used) == (1, 1)
    await first.complete("done")  # its grants go back in that step
    assert ((await a.status()).units_used, (await b.status()).units_used) == (0, 0)
    second = await mbx.admit(run)
    assert second.task_id == again.id and len(second.grants) == 2
    await second.complete("done")


async def test_older_tasks_that_cannot_run_are_skipped_not_blocking(rs):
    await rs.pools.ensure("skip-a", 2)
    mbx = await rs.mailboxes.ensure("skip")
    run = await rs.scopes.create()
    big = await mbx.submit("big", scope=run, requirements={"pools": {"skip-a": 2}})
    holder = await mbx.submit("holder", scope=run, requirements={"pools": {"skip-a": 1}})
    d1 = await mbx.admit(run)
    assert d1.task_id == big.id
    plain = await mbx.submit("plain", scope=run)  # no requirements
    d2 = await mbx.admit(run)
    assert d2.task_id == plain.id  # holder (older) cannot run now: skipped, still first in line
    await d1.complete("x")
    d3 = await mbx.admit(run)
    assert d3.task_id == holder.id
    await d3.complete("x")
    await d2.complete("x")


@pytest.mark.parametrize("end", ["complete", "retry", "reject", "cancel", "run_cancel"])
async def test_a_task_gives_its_grants_back_whichever_way_its_delivery_ends(rs, end):
    pool = await rs.pools.ensure(f"end-{end}", 1)
    mbx = await rs.mailboxes.ensure(f"end-{end}")
    run = await rs.scopes.create()
    task = await mbx.submit("x", scope=run, requirements={"pools": {pool.name: 1}})
    d = await mbx.admit(run)
    assert (await pool.status()).units_used == 1
    if end == "complete":
        await d.complete("ok")
    elif end == "retry":
        await d.retry("again")
    elif end == "reject":
        await d.reject("no")
    elif end == "cancel":
        await task.cancel()
    else:
        await run.cancel()
    for _ in range(100):  # (a run's end serves the pool in the step right after)
        if (await pool.status()).units_used == 0:
            break
        await trio.sleep(0.01)
    st = await pool.status()
    assert st.units_used == 0 and st.active_grants == 0
    g = await rs._call(p.GrantStatus(grant_id=d.grants[0].id), t.GrantInfo)
    assert g.state == "RELEASED" and g.end_reason == "delivery_ended"
    if end == "retry":  # back in the queue: admitted again with a new grant
        d2 = await mbx.admit(run)
        assert d2.task_id == task.id and d2.grants[0].id != d.grants[0].id
        await d2.complete("ok")


async def test_a_lost_delivery_lease_gives_the_grants_back(autojump_clock, ers):
    pool = await ers.pools.ensure("lease", 1)
    mbx = await ers.mailboxes.ensure("lease")
    run = await ers.scopes.create()
    await mbx.submit("x", scope=run, requirements={"pools": {"lease": 1}})
    d = await mbx.admit(run, lease_seconds=5)
    assert (await pool.status()).units_used == 1
    await trio.sleep(6)  # the worker died
    assert (await pool.status()).units_used == 0
    d2 = await mbx.admit(run)  # taken over with a new grant
    assert d2.task_id == d.task_id and d2.attempt == 2 and (await pool.status()).units_used == 1


async def test_a_parked_receive_is_woken_when_units_come_back(autojump_clock, ers):
    pool = await ers.pools.ensure("wake", 1)
    mbx = await ers.mailboxes.ensure("wake")
    run = await ers.scopes.create()
    g = await pool.acquire(1, scope=run, lease_seconds=600)
    task = await mbx.submit("x", scope=run, requirements={"pools": {"wake": 1}})
    got = []

    async def worker():
        got.append(await mbx.admit(run, wait=300))

    async with trio.open_nursery() as n:
        n.start_soon(worker)
        await trio.sleep(10)
        assert got == []
        t0 = trio.current_time()
        await g.release()
    assert got[0].task_id == task.id and trio.current_time() - t0 < 0.01


async def test_admission_does_not_take_units_from_under_queued_pool_waiters(autojump_clock, ers):
    pool = await ers.pools.ensure("nobarge", 2)
    mbx = await ers.mailboxes.ensure("nobarge")
    run = await ers.scopes.create()
    g = await pool.acquire(1, scope=run, lease_seconds=600)
    await mbx.submit("x", scope=run, requirements={"pools": {"nobarge": 1}})
    async with trio.open_nursery() as n:
        n.start_soon(functools_partial(pool.acquire, 2, scope=run, wait=600))
        await trio.sleep(1)
        assert await mbx.admit(run) is None  # 1 unit free, but a waiter is first in line
        await g.release()
    assert await mbx.admit(run) is None  # the waiter holds both units now


async def test_units_that_come_back_go_to_the_oldest_task_that_needs_them(rs):
    """Issue 34 item 3, step by step: a task needing all 4 units waits behind 1-unit
    tasks; a younger 1-unit task does not take a unit that comes back (it would starve
    the large one); once all 4 are back the large one gets them, then the younger."""
    pool = await rs.pools.ensure("fifo-4", 4)
    mbx = await rs.mailboxes.ensure("fifo-4")
    run = await rs.scopes.create()
    small = [await mbx.submit(f"s{i}", scope=run, requirements={"pools": {"fifo-4": 1}}) for i in range(4)]
    running = [await mbx.admit(run) for _ in range(4)]
    assert [d.task_id for d in running] == [t.id for t in small]
    big = await mbx.submit("big", scope=run, requirements={"pools": {"fifo-4": 4}})
    young = await mbx.submit("young", scope=run, requirements={"pools": {"fifo-4": 1}})
    assert await mbx.admit(run) is None  # nothing free
    for d in running[:3]:
        await d.complete("ok")
        assert await mbx.admit(run) is None  # 1..3 units free: the big task is first; young waits behind it
        assert (await pool.status()).units_used == 4 - (running.index(d) + 1)
    await running[3].complete("ok")
    d = await mbx.admit(run)
    assert d.task_id == big.id and [(g.pool, g.units) for g in d.grants] == [("fifo-4", 4)]
    await d.complete("ok")
    d = await mbx.admit(run)
    assert d.task_id == young.id
    await d.complete("ok")


async def test_a_large_task_is_not_starved_by_another_queues_stream(autojump_clock, ers):
    """The line is the pool's, not one queue's: once a receive of the large task's queue
    skipped it, receives of another queue sharing the pool take no unit it waits for."""
    await ers.pools.ensure("shared", 2)
    big_q, small_q = await ers.mailboxes.ensure("big-q"), await ers.mailboxes.ensure("small-q")
    run = await ers.scopes.create()
    hold = [await small_q.submit(i, scope=run, requirements={"pools": {"shared": 1}}) for i in range(2)]
    held = [await small_q.admit(run) for _ in hold]
    big = await big_q.submit("big", scope=run, requirements={"pools": {"shared": 2}})
    assert await big_q.admit(run) is None  # skipped: it joins the pool's line
    later = await small_q.submit("later", scope=run, requirements={"pools": {"shared": 1}})
    await held[0].complete("ok")
    assert await small_q.admit(run) is None  # the unit is kept for the older, larger task
    await held[1].complete("ok")
    d = await big_q.admit(run)
    assert d.task_id == big.id
    await d.complete("ok")
    d = await small_q.admit(run)
    assert d.task_id == later.id
    await d.complete("ok")


async def test_a_stream_of_small_tasks_does_not_starve_a_large_one_under_consume(autojump_clock, ers):
    """The issue's run as a deterministic test (MockClock): consume() with 4 handler
    slots over a pool of 4 units, 1-unit tasks in front, a task needing all 4 behind
    them, and a producer adding a 1-unit task every 0.25 s. The large task is handed out
    before any task submitted after it (it was handed out after 86 younger ones)."""
    await ers.pools.ensure("gpu4", 4)
    mbx = await ers.mailboxes.ensure("stream")
    run = await ers.scopes.create()
    started: list[str] = []

    async def handler(d):
        started.append(d.input)
        await trio.sleep(1)
        return None

    for i in range(6):
        await mbx.submit(f"early-{i}", scope=run, requirements={"pools": {"gpu4": 1}})
    big = await mbx.submit("big", scope=run, requirements={"pools": {"gpu4": 4}})

    async def producer():
        for i in range(80):
            await mbx.submit(f"late-{i}", scope=run, requirements={"pools": {"gpu4": 1}})
            await trio.sleep(0.25)

    async with trio.open_nursery() as n:
        n.start_soon(lambda: rallypoint.consume(ers, mbx, run, handler, concurrency=4, wait=1))
        await producer()
        with trio.fail_after(60):
            while "late-79" not in started:
                await trio.sleep(0.5)
        n.cancel_scope.cancel()
    assert (await ers.task(big.id).status()).state == "SUCCEEDED"
    at = started.index("big")
    assert all(x.startswith("early-") for x in started[:at]), started[:at + 1]
    assert sorted(started[:at]) == [f"early-{i}" for i in range(6)]


@pytest.mark.parametrize("crash", [False, True], ids=["clean", "crash"])
async def test_the_oldest_task_keeps_the_units_it_waits_for_across_a_restart(tmp_path, autojump_clock, crash):
    """The admission line is derived (in memory); after a restart -- clean, or what a
    SIGKILL leaves -- the first receive that skips the large task puts it back, before
    any younger task can take a unit it waits for."""
    import shutil

    from rallypoint.clock import Clock
    from test_durability_restart import controlled_time

    live, crashed = tmp_path / "live", tmp_path / "crashed"
    clock = Clock()
    async with controlled_time() as tc:
        async with rallypoint.open_embedded(str(live), durability="fsync", clock=clock) as rs:
            await rs.pools.ensure("gpu", 2)
            mbx = await rs.mailboxes.ensure("jobs")
            run = await rs.scopes.create()
            for i in range(2):
                await mbx.submit(f"s{i}", scope=run, requirements={"pools": {"gpu": 1}})
            running = [await mbx.admit(run, lease_seconds=600) for _ in range(2)]
            big = await mbx.submit("big", scope=run, requirements={"pools": {"gpu": 2}})
            young = await mbx.submit("young", scope=run, requirements={"pools": {"gpu": 1}})
            assert await mbx.admit(run) is None
            await running[0].complete("ok")  # 1 unit back; the line keeps it for big
            if crash:
                j = rs.node.coordinator.journal
                await j.wait_durable(j.last_lsn)
                shutil.copytree(live, crashed)
        await tc.advance(5)
        async with rallypoint.open_embedded(str(crashed if crash else live), durability="fsync", clock=clock) as rs:
            assert rs.node.coordinator.pools.admission_lines == {}  # derived: rebuilt by receives
            mbx = rs.mailbox("jobs")
            other = await rs.mailboxes.ensure("other")
            late = await other.submit("late", scope=run.id, requirements={"pools": {"gpu": 1}})
            assert await mbx.admit(run.id) is None  # big skipped again: back in line; young behind it
            assert await other.admit(run.id) is None  # another queue's younger task waits too
            await rs._call(p.DeliveryComplete(task_id=running[1].task_id, token=running[1].token),
                           t.TaskInfo)
            d = await mbx.admit(run.id)
            assert d.task_id == big.id
            await d.complete("ok")
            assert (await mbx.admit(run.id)).task_id == young.id
            assert (await other.admit(run.id)).task_id == late.id


def functools_partial(fn, *a, **kw):
    import functools

    return functools.partial(fn, *a, **kw)


async def test_consume_runs_tasks_with_requirements_and_gives_units_back(rs):
    pool = await rs.pools.ensure("consume-pool", 2)
    mbx = await rs.mailboxes.ensure("consume-req")
    run = await rs.scopes.create()
    tickets = [await mbx.submit(i, scope=run, requirements={"pools": {"consume-pool": 1}}) for i in range(8)]
    running = 0
    peak = 0

    async def handler(d):
        nonlocal running, peak
        assert [(g.pool, g.units) for g in d.grants] == [("consume-pool", 1)]
        running += 1
        peak = max(peak, running)
        await trio.sleep(0.02)
        running -= 1
        return d.input * 10

    async with trio.open_nursery() as n:
        n.start_soon(lambda: rallypoint.consume(rs, mbx, run, handler, concurrency=5, wait=1))
        infos = await rs.results(tickets, timeout=30)
        await run.cancel()
    assert [i.outcome for i in infos] == [i * 10 for i in range(8)]
    assert peak <= 2  # never more than the pool's units at once
    assert (await pool.status()).units_used == 0


def test_many_workers_few_units_never_over_granted_over_tcp(daemon):
    """8 workers on their own connections race to admit 40 tasks that each need 1 of 3
    units (some also 1 of 1 unit of a second pool) while a watcher polls the pools: the
    pools never report more units used than they have, every task runs once."""

    async def main():
        async with rallypoint.connect(daemon.url) as rs:
            a = await rs.pools.ensure("race-a", 3)
            b = await rs.pools.ensure("race-b", 1)
            mbx = await rs.mailboxes.ensure("race")
            run = await rs.scopes.create()
            for i in range(40):
                req = {"race-a": 1, "race-b": 1} if i % 4 == 0 else {"race-a": 1}
                await mbx.submit(i, scope=run, requirements={"pools": req})
            seen: list[int] = []
            over: list[str] = []
            done = trio.Event()

            async def worker():
                async with rallypoint.connect(daemon.url) as w:
                    wm = w.mailbox("race")
                    while len(seen) < 40:
                        d = await wm.admit(run, wait=0.2)
                        if d is None:
                            continue
                        seen.append(d.input)
                        await trio.sleep(0.005)
                        await d.complete(d.input)

            async def watcher():
                while not done.is_set():
                    for pool in (a, b):
                        st = await pool.status()
                        if st.units_used > st.units_total or sum(g.units for g in st.grants) != st.units_used:
                            over.append(repr(st))
                    await trio.sleep(0.002)

            async with trio.open_nursery() as n:
                n.start_soon(watcher)
                async with trio.open_nursery() as workers:
                    for _ in range(8):
                        workers.start_soon(worker)
                done.set()
            assert over == []
            assert sorted(seen) == list(range(40))  # each task ran exactly once
            assert (await a.status()).units_used == 0 and (await b.status()).units_used == 0

    trio.run(main)


# ------------------------------------------------------------------ work limits


async def test_work_limits_cap_unfinished_tasks_of_a_run(rs):
    mbx = await rs.mailboxes.ensure("wl")
    run = await rs.scopes.create()
    child = await run.child()
    wl = await run.work_limits.ensure("crawl", max_outstanding=2)
    assert (wl.max_outstanding, wl.outstanding, wl.scope_id) == (2, 0, run.id)
    assert (await run.work_limits.ensure("crawl", 2)).id == wl.id
    with pytest.raises(ConflictError):
        await run.work_limits.ensure("crawl", 3)
    t1 = await mbx.submit(1, scope=run, work_limit="crawl", key="k1")
    await mbx.submit(2, scope=child, work_limit="crawl")  # found in the ancestor
    with pytest.raises(LimitError) as ei:
        await mbx.submit(3, scope=run, work_limit="crawl")
    assert ei.value.code == "LIMIT_EXCEEDED" and ei.value.retry_after and ei.value.details["outstanding"] == 2
    again = await mbx.submit(1, scope=run, work_limit="crawl", key="k1")  # idempotent: not counted again
    assert again.id == t1.id
    await mbx.submit(9, scope=run)  # tasks that do not name the limit are not capped
    d = await mbx.receive(run, wait=0)
    await d.complete("ok")  # one of the limited ones finishes (FIFO: t1)
    await mbx.submit(3, scope=run, work_limit="crawl")
    with pytest.raises(LimitError):
        await mbx.submit_many([4, 5], scope=run, work_limit="crawl")
    assert [w.outstanding for w in await run.work_limits.list()] == [2]
    with pytest.raises(NotFoundError):
        await mbx.submit(1, scope=run, work_limit="nope")
    other = await rs.scopes.create()
    with pytest.raises(NotFoundError):  # a limit applies to its run and below only
        await mbx.submit(1, scope=other, work_limit="crawl")


async def test_a_batch_counts_every_task_against_the_limit(rs):
    mbx = await rs.mailboxes.ensure("wl-batch")
    run = await rs.scopes.create()
    await run.work_limits.ensure("batch", 3)
    with pytest.raises(LimitError):
        await mbx.submit_many([1, 2, 3, 4], scope=run, work_limit="batch")
    assert (await run.status()).tasks == {}  # all or nothing
    await mbx.submit_many([1, 2, 3], scope=run, work_limit="batch")
    await run.cancel()  # the run's end cancels them: the count drops
    assert (await run.work_limits.list())[0].outstanding == 0
    with pytest.raises(ScopeCancelledError):
        await run.work_limits.ensure("late", 1)


# ------------------------------------------------------------------ the model


class _RecordingJournal(MemoryJournal):
    """Memory durability that keeps each commit's payload (to replay them)."""

    def __init__(self) -> None:
        super().__init__()
        self.payloads: list[bytes] = []

    def append(self, payload: bytes) -> int:
        self.payloads.append(payload)
        return super().append(payload)


REQS = [{"A": 1}, {"A": 2}, {"B": 1}, {"A": 1, "B": 1}, {"A": 3, "B": 2}, None]
STEP = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 2), st.sampled_from(REQS)),
    st.tuples(st.just("submit"), st.integers(0, 2), st.sampled_from(REQS)),
    st.tuples(st.just("receive"), st.integers(0, 2), st.integers(1, 3)),
    st.tuples(st.just("receive"), st.integers(0, 2), st.integers(1, 3)),
    st.tuples(st.just("settle"), st.integers(0, 40), st.sampled_from(["complete", "retry", "reject", "cancel"])),
    st.tuples(st.just("acquire"), st.sampled_from(["A", "B"]), st.integers(1, 3), st.booleans(), st.integers(0, 2)),
    st.tuples(st.just("release"), st.integers(0, 40)),
    st.tuples(st.just("time"), st.sampled_from([1, 3, 6, 40])),
    st.tuples(st.just("cancel_run"), st.integers(1, 2)),
)


#: every example starts with work waiting: tasks needing most of both pools, in two runs
PREAMBLE = [("submit", 0, {"A": 2}), ("submit", 1, {"A": 2}), ("submit", 0, {"A": 1, "B": 1}),
            ("submit", 2, {"B": 2}), ("submit", 1, None), ("submit", 0, {"A": 3, "B": 2})]


def check_invariants(coord: Coordinator) -> None:
    pools, queues = coord.pools, coord.queues
    by_task: dict[str, dict[str, int]] = {}
    for pool in pools.table.values():
        active = [g for g in pools.grants.values() if g.pool_id == pool.id and g.state == "ACTIVE"]
        used = sum(g.units for g in active)
        assert used == pools.used.get(pool.id, 0), "derived count drifted"
        assert used <= pool.units_total, f"over-granted: {used} > {pool.units_total}"
        free = pool.units_total - used
        if pool.waiters:  # FIFO served: the head does not fit, or nothing would be waiting
            assert pool.waiters[0].units > free, "a waiter that fits was left waiting"
        for w in pool.waiters:
            assert coord.runs.inactive_error(w.scope_id) is None, "a waiter of an inactive run stayed"
        for g in active:
            if g.task_id is not None:
                by_task.setdefault(g.task_id, {})
                by_task[g.task_id][g.pool_id] = by_task[g.task_id].get(g.pool_id, 0) + g.units
    for task in queues.tasks.values():
        holds = by_task.get(task.id, {})
        if task.state == "RUNNING" and task.requirements is not None:
            assert holds == task.requirements.pools, "a running task does not hold exactly what it requires"
        else:
            assert holds == {}, f"a {task.state} task still holds grants"


async def _model(steps) -> None:
    journal = _RecordingJournal()
    coord = Coordinator(journal=journal)
    s = Session()
    d = coord.decide
    d(s, p.PoolEnsure(name="A", units_total=3))
    d(s, p.PoolEnsure(name="B", units_total=2))
    d(s, p.MailboxEnsure(name="m", max_attempts=3))
    root = d(s, p.ScopeCreate(name="root")).id
    runs = [root, d(s, p.ScopeCreate(parent_id=root)).id, d(s, p.ScopeCreate(name="other")).id]
    tasks: list[str] = []
    grants: list[tuple[str, int]] = []
    clock = trio.lowlevel.current_clock()
    for step in PREAMBLE + steps:
        kind = step[0]
        try:
            if kind == "submit":
                req = None if step[2] is None else p.Requirements(pools=step[2])
                tasks.append(d(s, p.TaskSubmit(mailbox="m", scope_id=runs[step[1]], requirements=req)).id)
            elif kind == "receive":
                r = d(s, p.Receive(mailbox="m", scope_id=runs[step[1]], lease_ms=5_000, max_messages=step[2]))
                for dv in r.deliveries:
                    assert sum(1 for g in dv.grants) == len(coord.queues.tasks[dv.task_id].requirements.pools
                                                            if coord.queues.tasks[dv.task_id].requirements else {})
            elif kind == "settle" and tasks:
                task = coord.queues.tasks[tasks[step[1] % len(tasks)]]
                what = step[2]
                if what == "cancel":
                    d(s, p.TaskCancel(task_id=task.id))
                elif task.state == "RUNNING":
                    op = {"complete": p.DeliveryComplete, "retry": p.DeliveryRetry, "reject": p.DeliveryReject}[what]
                    d(s, op(task_id=task.id, token=task.token))
            elif kind == "acquire":
                r = d(s, p.PoolAcquire(pool=step[1], scope_id=runs[step[4]], units=min(step[2], 3 if step[1] == "A" else 2),
                                       lease_ms=5_000, wait_ms=30_000 if step[3] else 0))
                if not isinstance(r, Park) and r.grant is not None:
                    grants.append((r.grant.id, r.grant.token))
            elif kind == "release" and grants:
                gid, token = grants[step[1] % len(grants)]
                d(s, p.GrantRelease(grant_id=gid, token=token))
            elif kind == "release" and tasks:  # a task's grant, given back early
                pass
            elif kind == "time":
                clock.jump(step[1])
            elif kind == "cancel_run":
                d(s, p.ScopeCancel(scope_id=runs[step[1]]))
        except RallypointError:
            pass
        coord.before_batch()  # what the actor runtime does before every batch: fire what is due
        # grants served to durable waiters (their requests are not parked in this model)
        for pool in coord.pools.table.values():
            for (pid, _rid), gid in coord.pools.by_request.items():
                if pid == pool.id and all(gid != x for x, _ in grants):
                    grants.append((gid, coord.pools.grants[gid].token))
        check_invariants(coord)
    # replaying the journal into a fresh coordinator gives the same pools and grants
    fresh = Coordinator()
    for payload in journal.payloads:
        fresh.replay(payload)
    assert fresh.pools.table == coord.pools.table and fresh.pools.grants == coord.pools.grants
    assert fresh.pools.used == coord.pools.used
    assert {k: v.state for k, v in fresh.queues.tasks.items()} == {k: v.state for k, v in coord.queues.tasks.items()}
    check_invariants(fresh)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(STEP, min_size=10, max_size=60))
def test_model_admission_and_pools_never_over_grant(steps):
    """Random submits (with and without requirements), receives by several runs,
    settles, explicit grants with and without waiting, releases, time passing (leases
    running out) and run cancellations: after every step no pool has more units granted
    than it has, every RUNNING task holds exactly what it requires and nothing else
    holds task grants, no waiter that fits is left waiting, no waiter of an inactive run
    is left; the journal replays to the same state."""
    trio.run(_model, steps, clock=trio.testing.MockClock())


async def test_a_completing_task_gives_its_grants_back_when_its_worker_completes(rs):
    """A task with its own run (``delivery.run()``) stays RUNNING, completing, while its
    run's join sets close: its worker is done, so its grants go back at once."""
    pool = await rs.pools.ensure("completing", 1)
    mbx = await rs.mailboxes.ensure("completing")
    run = await rs.scopes.create()
    task = await mbx.submit("parent", scope=run, requirements={"pools": {"completing": 1}})
    d = await mbx.admit(run)
    own = await d.run()
    js = await own.join_sets.create()
    await js.submit(mbx, "child", cancellable=False)
    await d.complete("parent done")
    info = await task.status()
    assert info.state == "RUNNING" and info.completing
    st = await pool.status()
    assert st.units_used == 0 and st.active_grants == 0  # given back with the delivery
    child = await mbx.receive(run, wait=0)
    assert child.input == "child" and child.grants == []
    await child.complete("ok")
    assert (await task.result(timeout=10)).state == "SUCCEEDED"
    assert (await pool.status()).units_used == 0


async def test_pool_and_budget_requirements_are_taken_together_or_not_at_all(rs):
    """The two requirement kinds in one step: a task needing a GPU and 400 of a 500
    budget is not admitted while only the GPU is free -- and the GPU is not taken -- then
    is, once a rejected delivery's reservation is voided; a success settles in full what
    the worker did not settle itself."""
    gpu = await rs.pools.ensure("both-gpu", 2)
    spend = await rs.budgets.ensure("both-spend", limit=500)
    mbx = await rs.mailboxes.ensure("both")
    run = await rs.scopes.create()
    req = {"pools": {"both-gpu": 1}, "budgets": {"both-spend": 400}}
    t1 = await mbx.submit(1, scope=run, requirements=req)
    t2 = await mbx.submit(2, scope=run, requirements=req)
    d1 = await mbx.admit(run)
    assert d1.task_id == t1.id and len(d1.grants) == 1 and len(d1.reservations) == 1
    assert (await gpu.status()).units_used == 1 and (await spend.status()).available_minor == 100
    assert await mbx.admit(run) is None  # the GPU is free, the money is not: neither is taken
    assert (await gpu.status()).units_used == 1
    await d1.reject("no")  # the reservation is voided, the GPU released
    d2 = await mbx.admit(run)
    assert d2.task_id == t2.id and (await spend.status()).available_minor == 100
    await d2.reservations[0].settle(150, final=False)  # the worker knows part of the real cost
    await d2.complete("ok")  # what is left is settled in full: the reservation was the most it may cost
    st = await spend.status()
    assert (st.settled_minor, st.available_minor) == (400, 100)
    assert (await gpu.status()).units_used == 0
