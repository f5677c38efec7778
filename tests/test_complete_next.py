"""Complete-and-next (issue 47): ``delivery.complete_next`` settles a delivery and
receives the next ones of its queue in one request, with the fencing, lease and
durability semantics of the complete (or retry / reject) and the receive it replaces.

Under the MockClock (embedded); the re-send after a dropped connection is in
tests/test_reconnect.py, kill -9 of a daemon in tests/test_reconnect_daemon.py, a
failover in tests/test_cluster_daemon.py.
"""

import pytest
import trio
import trio.testing

from rallypoint import protocol as p
from rallypoint.errors import LeaseLostError, ScopeInactiveError, ValidationError

from conftest import wait_parked


def _leased(coord) -> set:
    return set(coord.queues.leased)


async def test_complete_and_next_completes_then_leases_the_next(autojump_clock, ers):
    coord = ers.node.coordinator
    m = await ers.mailboxes.ensure("cn-basic")
    run = await ers.scopes.create()
    first, second, third = await m.submit_many(["a", "b", "c"], scope=run)
    d = await m.receive(run, lease_seconds=10, wait=0)
    assert d.task_id == first.id
    commits = coord.commits
    nxt = await d.complete_and_next("A", max_messages=2)
    assert [x.task_id for x in nxt] == [second.id, third.id]
    assert (nxt.task.state, nxt.task.outcome, nxt.stopped) == ("SUCCEEDED", "A", None)
    assert coord.commits == commits + 2  # the settle, then the deliveries
    assert all(x.lease_seconds == 10 and x.received_for == run.id for x in nxt)
    res = await first.result(timeout=0)
    assert (res.state, res.outcome) == ("SUCCEEDED", "A")
    # the next ones are leased like a receive's: fenced, renewable, completable
    assert _leased(coord) == {second.id, third.id}
    brief = await nxt[0].complete_and_next("B", details=False)
    assert brief == [] and brief.task is None and brief.stopped is None
    assert (await nxt[1].complete("C")).state == "SUCCEEDED"


async def test_the_receive_half_parks_until_work_comes_or_returns_empty_after_its_wait(autojump_clock, ers):
    coord = ers.node.coordinator
    m = await ers.mailboxes.ensure("cn-park")
    run = await ers.scopes.create()
    t = await m.submit("a", scope=run)
    d = await m.receive(run, wait=0)
    got = {}

    async def worker():
        got["next"] = await d.complete_and_next("A", wait=30)

    async with trio.open_nursery() as n:
        n.start_soon(worker)
        await wait_parked(coord, 1)
        # the settle is applied (and durable) while the receive half waits
        assert (await t.result(timeout=0)).state == "SUCCEEDED"
        later = await m.submit("b", scope=run)
    assert [x.task_id for x in got["next"]] == [later.id]
    # nothing ready within the wait: the settled task, no deliveries
    t0 = trio.current_time()
    empty = await got["next"][0].complete_and_next("B", wait=2)
    assert empty == [] and empty.task.state == "SUCCEEDED" and trio.current_time() - t0 >= 1.99


async def test_lease_expired_before_the_settle_is_refused_and_receives_nothing(autojump_clock, ers):
    coord = ers.node.coordinator
    m = await ers.mailboxes.ensure("cn-expired")
    run = await ers.scopes.create()
    t, other = await m.submit_many(["a", "b"], scope=run)
    d = await m.receive(run, lease_seconds=5, wait=0)
    await trio.sleep(5.01)  # the lease runs out: the task is QUEUED again, attempt 2
    assert (await t.status()).state == "QUEUED"
    commits = coord.commits
    with pytest.raises(LeaseLostError) as ei:
        await d.complete_and_next("late", max_messages=10, wait=5)
    assert ei.value.code == "STALE_CLAIM" and d.lost
    # nothing settled, nothing leased: both tasks are still waiting for a receive
    assert coord.commits == commits and not _leased(coord)
    assert {(await x.status()).state for x in (t, other)} == {"QUEUED"}
    # and the same code as a plain complete
    with pytest.raises(LeaseLostError) as ej:
        await d.complete("late")
    assert ej.value.code == ei.value.code


async def test_a_stale_token_is_fenced_off_and_receives_nothing(autojump_clock, ers):
    coord = ers.node.coordinator
    m = await ers.mailboxes.ensure("cn-stale")
    run = await ers.scopes.create()
    t = await m.submit("a", scope=run)
    a = await m.receive(run, lease_seconds=5, wait=0)
    await trio.sleep(5.01)
    b = await m.receive(run, lease_seconds=30, wait=0)  # B took it over
    assert b.task_id == a.task_id and b.token > a.token
    other = await m.submit("b", scope=run)
    for settle in (lambda: a.complete_and_next("A"), lambda: a.retry_and_next("A"),
                   lambda: a.reject_and_next("A")):
        with pytest.raises(LeaseLostError) as ei:
            await settle()
        assert ei.value.code == "STALE_CLAIM"
    assert (await other.status()).state == "QUEUED" and _leased(coord) == {t.id}
    nxt = await b.complete_and_next("B")
    assert [x.task_id for x in nxt] == [other.id]
    assert (await t.result(timeout=0)).outcome == "B"


async def test_a_cancelled_run_refuses_the_whole_request(autojump_clock, ers):
    coord = ers.node.coordinator
    m = await ers.mailboxes.ensure("cn-cancel")
    run = await ers.scopes.create()
    t, _ = await m.submit_many(["a", "b"], scope=run)
    d = await m.receive(run, wait=0)
    await run.cancel()
    commits = coord.commits
    for settle in (lambda: d.complete_and_next("A"), lambda: d.retry_and_next("A")):
        with pytest.raises(ScopeInactiveError) as ei:
            await settle()
        assert ei.value.code == "SCOPE_CANCELLED"
    assert coord.commits == commits
    with pytest.raises(ScopeInactiveError) as ej:
        await d.complete("A")
    assert ej.value.code == ei.value.code
    assert (await t.status()).state == "CANCELLED"


async def test_a_run_stopped_while_the_receive_half_waits_answers_the_settle(autojump_clock, ers):
    coord = ers.node.coordinator
    m = await ers.mailboxes.ensure("cn-stop")
    parent = await ers.scopes.create()
    t = await m.submit("a", scope=parent)
    d = await m.receive(parent, wait=0)
    got = {}

    async def worker():
        got["next"] = await d.complete_and_next("A", wait=30)

    async with trio.open_nursery() as n:
        n.start_soon(worker)
        await wait_parked(coord, 1)
        await parent.cancel()
    assert got["next"] == [] and got["next"].stopped == "SCOPE_CANCELLED"
    assert (await t.result(timeout=0)).outcome == "A"  # the settle stands


async def test_retry_and_reject_then_next(autojump_clock, ers):
    m = await ers.mailboxes.ensure("cn-retry", max_attempts=2)
    run = await ers.scopes.create()
    t, u = await m.submit_many(["a", "b"], scope=run)
    d = await m.receive(run, wait=0)
    nxt = await d.retry_and_next("boom", max_messages=2)
    # the retried task is QUEUED again at its FIFO place: it comes in the same receive, first
    assert nxt.task.state == "QUEUED" and [x.task_id for x in nxt] == [t.id, u.id]
    assert nxt[0].attempt == 2
    after = await nxt[1].reject_and_next("no")
    assert after.task.state == "FAILED" and after.task.outcome_reason == "rejected" and after == []
    final = await nxt[0].retry_and_next("x")  # its last attempt: FAILED
    assert final.task.state == "FAILED" and final.task.outcome_reason == "max_attempts" and final == []
    v = await m.submit("c", scope=run)
    e = await m.receive(run, wait=0)
    later = await e.retry_and_next("y", delay=60)
    assert later.task.state == "QUEUED" and later == []  # its delay: not ready yet
    assert v.id == e.task_id


async def test_the_request_is_validated_before_anything_changes(autojump_clock, ers):
    coord = ers.node.coordinator
    m = await ers.mailboxes.ensure("cn-valid")
    a = await ers.scopes.create()
    b = await ers.scopes.create()
    child = await a.child()
    t = await m.submit("a", scope=a)
    d = await m.receive(a, wait=0)
    commits = coord.commits
    with pytest.raises(ValidationError) as ei:
        await d.complete_and_next("A", scope=b)  # not the task's run nor an ancestor
    assert ei.value.details["field"] == "scope_id"
    with pytest.raises(ValidationError):
        await d.complete_and_next("A", max_messages=101)
    with pytest.raises(ValidationError) as ei:
        await ers._call(p.DeliveryCompleteNext(task_id=d.task_id, token=d.token, scope_id=a.id, settle="maybe"),
                        p.CompleteNextView)
    assert ei.value.details["field"] == "settle"
    assert coord.commits == commits and (await t.status()).state == "RUNNING"
    with pytest.raises(ValidationError):
        await d.complete_and_next("A", scope=child)  # a descendant of the task's run
    assert (await d.complete_and_next("A", scope=a)).task.state == "SUCCEEDED"


async def test_an_ancestor_receives_its_subtree(autojump_clock, ers):
    m = await ers.mailboxes.ensure("cn-tree")
    root = await ers.scopes.create()
    kid = await root.child()
    t = await m.submit("a", scope=kid)
    u = await m.submit("b", scope=root)
    d = await m.receive(root, wait=0)
    assert d.task_id == t.id and d.received_for == root.id
    nxt = await d.complete_and_next("A")
    assert [x.task_id for x in nxt] == [u.id]


# ------------------------------------------------------------------ consume() uses it

class _OpCounter:
    """Counts the requests a client sends, by op tag (wraps its transport's call)."""

    def __init__(self, rs) -> None:
        self.counts: dict[str, int] = {}
        tr = rs._transport
        inner_call, inner_many = tr.call, tr.call_many

        async def call(op):
            tag = type(op).__struct_config__.tag
            self.counts[tag] = self.counts.get(tag, 0) + 1
            return await inner_call(op)

        async def call_many(ops):
            for op in ops:
                tag = type(op).__struct_config__.tag
                self.counts[tag] = self.counts.get(tag, 0) + 1
            return await inner_many(ops)

        tr.call, tr.call_many = call, call_many


@pytest.mark.parametrize("concurrency", [1, 3])
async def test_consume_completes_and_receives_in_one_request(autojump_clock, ers, concurrency):
    import rallypoint

    coord = ers.node.coordinator
    m = await ers.mailboxes.ensure(f"cn-consume-{concurrency}")
    run = await ers.scopes.create()
    n_tasks = 12
    counter = _OpCounter(ers)
    seen = []

    async def handler(d):
        seen.append(d.input)
        await trio.sleep(0.01 * (d.input % 3))
        return d.input * 2

    out = {}

    async def worker():
        out["stats"] = await rallypoint.consume(ers, m, run, handler, concurrency=concurrency, wait=30,
                                                handle_signals=False)

    async with trio.open_nursery() as n:
        n.start_soon(worker)
        tickets = []
        for i in range(n_tasks):  # one at a time: the worker is waiting in a complete_next
            tickets.append(await m.submit(i, scope=run))
            await trio.testing.wait_all_tasks_blocked()
        infos = await ers.results(tickets)
        await run.cancel()
    s = out["stats"]
    assert [(i.state, i.outcome) for i in infos] == [("SUCCEEDED", 2 * k) for k in range(n_tasks)]
    assert (s.completed, s.lost, s.received) == (n_tasks, 0, n_tasks)
    c = counter.counts
    # every complete rode with a receive; receives alone only before the first and
    # while a complete_next was already on its way
    assert c.get("delivery.complete_next", 0) + c.get("delivery.complete_many", 0) >= n_tasks
    if concurrency == 1:
        assert c.get("delivery.complete_next") == n_tasks and "delivery.complete_many" not in c
        assert c.get("delivery.receive") == 1
    else:
        assert c.get("delivery.complete_next", 0) >= 1
    assert not coord.queues.leased

# async handlers: a plain function runs in a worker thread (consume's to_thread), and while
# it runs every Trio task is blocked, so the autojump clock may jump to a time-out meanwhile
async def _echo(d):
    return d.input


async def _plus_one(d):
    return d.input + 1



async def test_consume_without_complete_and_next_keeps_two_requests(autojump_clock, ers):
    import rallypoint

    m = await ers.mailboxes.ensure("cn-consume-off")
    run = await ers.scopes.create()
    counter = _OpCounter(ers)
    out = {}

    async def worker():
        out["stats"] = await rallypoint.consume(ers, m, run, _echo, wait=30, handle_signals=False,
                                                complete_and_next=False)

    async with trio.open_nursery() as n:
        n.start_soon(worker)
        tickets = [await m.submit(i, scope=run) for i in range(3)]
        await ers.results(tickets)
        await run.cancel()
    assert out["stats"].completed == 3 and "delivery.complete_next" not in counter.counts


async def test_a_drain_while_the_receive_half_waits_counts_the_complete_once(autojump_clock, ers):
    # SIGINT (a _Stopper here) while the last complete_next waits for work: the wait is
    # cancelled, the task's status shows the complete was applied, and it is counted
    # completed once (not lost, not completed again).
    import rallypoint
    from rallypoint.client.consume import _Stopper

    coord = ers.node.coordinator
    m = await ers.mailboxes.ensure("cn-drain")
    run = await ers.scopes.create()
    stop = _Stopper()
    counter = _OpCounter(ers)
    out = {}

    async def worker():
        out["stats"] = await rallypoint.consume(ers, m, run, _plus_one, wait=30, _stop=stop,
                                                handle_signals=False)

    async with trio.open_nursery() as n:
        n.start_soon(worker)
        t = await m.submit(1, scope=run)
        assert (await t.result(timeout=10)).outcome == 2
        await wait_parked(coord, 1)  # the complete_next's receive half
        stop.request("SIGINT")
    s = out["stats"]
    assert (s.completed, s.lost, s.received, s.stop_reason) == (1, 0, 1, "SIGINT")
    assert counter.counts.get("delivery.complete_next") == 1 and "delivery.complete_many" not in counter.counts


# ------------------------------------------------------------------ the blocking and asyncio clients

def test_the_blocking_client_completes_and_receives_in_one_call(daemon):
    import rallypoint.sync

    with rallypoint.sync.connect(daemon.url) as rs:
        m = rs.mailboxes.ensure("cn-sync")
        run = rs.scopes.create()
        a, b = m.submit_many(["a", "b"], scope=run)
        d = m.receive(run, wait=0)
        nxt = d.complete_and_next("A")
        assert [x.task_id for x in nxt] == [b.id] and nxt.task.outcome == "A" and nxt.stopped is None
        last = nxt[0].retry_and_next("boom", max_messages=3)  # b comes back for attempt 2
        assert [(x.task_id, x.attempt) for x in last] == [(b.id, 2)]
        assert last[0].complete("B").state == "SUCCEEDED"
        with pytest.raises(LeaseLostError):
            d.complete_and_next("again")


def test_the_asyncio_client_completes_and_receives_in_one_call(daemon):
    import asyncio

    import rallypoint

    async def main():
        asyncio.get_running_loop()  # really asyncio
        async with rallypoint.connect(daemon.url) as rs:
            m = await rs.mailboxes.ensure("cn-asyncio")
            run = await rs.scopes.create()
            a, b = await m.submit_many(["a", "b"], scope=run)
            d = await m.receive(run, wait=0)
            nxt = await d.complete_and_next({"x": 1}, max_messages=2)
            assert [x.task_id for x in nxt] == [b.id] and nxt.task.outcome == {"x": 1}
            assert (await nxt[0].complete_and_next("B", wait=0.2)) == []

    asyncio.run(main())


async def test_the_next_deliveries_share_one_frame_with_the_settled_task(autojump_clock, ers):
    # A batch of large inputs: the receive half leases only what fits in the reply next
    # to the settled task's view (its input and outcome, up to 64 KiB each); the rest
    # stays ready, first in line.
    from rallypoint.wire import MAX_FRAME_BYTES

    coord = ers.node.coordinator
    m = await ers.mailboxes.ensure("cn-frame")
    run = await ers.scopes.create()
    big = "x" * 60_000
    tickets = await m.submit_many([big] * 30, scope=run)
    d = await m.receive(run, wait=0)
    nxt = await d.complete_and_next("y" * 60_000, max_messages=100)
    assert 1 <= len(nxt) < 29
    views = p.CompleteNextView(deliveries=[coord.queues.delivery_view(coord.queues.tasks[x.task_id]) for x in nxt])
    assert len(p.encoder.encode(views)) + 2 * 60_000 < MAX_FRAME_BYTES  # (+ the task's input and outcome)
    states = [(await t.status()).state for t in tickets[1:]]
    assert states.count("RUNNING") == len(nxt) and states.count("QUEUED") == 29 - len(nxt)


async def test_a_batch_completes_and_receives_in_one_round_trip(autojump_clock, ers):
    from rallypoint.client.api import complete_many_and_next

    coord = ers.node.coordinator
    m = await ers.mailboxes.ensure("cn-batch")
    run = await ers.scopes.create()
    tickets = await m.submit_many(list(range(8)), scope=run)
    ds = await m.receive(run, wait=0, max_messages=4)
    counter = _OpCounter(ers)
    commits = coord.commits
    out, nxt = await m.complete_many_and_next([(d, d.input * 10) for d in ds], max_messages=4)
    assert out == [None] * 4 and [x.task_id for x in nxt] == [t.id for t in tickets[4:]]
    # one frame: the complete_many of the first three, the complete_next of the last
    assert counter.counts == {"delivery.complete_many": 1, "delivery.complete_next": 1}
    assert coord.commits == commits + 3  # the three, the last, the deliveries
    assert [(await t.result(timeout=0)).outcome for t in tickets[:4]] == [0, 10, 20, 30]
    # a refused last item receives nothing; the others are judged on their own
    stale = nxt[3]
    await stale.complete("first")
    out, after = await complete_many_and_next(ers, [(d, "x") for d in nxt])
    assert out[:3] == [None] * 3 and out[3].code == "STALE_CLAIM" and after == [] and stale.lost
    # items of several runs: complete_many, then the last one's complete_and_next
    other = await ers.scopes.create()
    t1 = await m.submit("r1", scope=run)
    t2 = await m.submit("r2", scope=other)
    d1 = await m.receive(run, wait=0)
    d2 = await m.receive(other, wait=0)
    out, more = await complete_many_and_next(ers, [(d1, 1), (d2, 2)])
    assert out == [None, None] and more == []
    assert [(await t.result(timeout=0)).outcome for t in (t1, t2)] == [1, 2]


def test_the_blocking_consume_completes_and_receives_in_one_request(daemon):
    import threading

    import rallypoint.sync

    with rallypoint.sync.connect(daemon.url) as rs:
        m = rs.mailboxes.ensure("cn-sync-consume")
        run = rs.scopes.create()
        tickets = m.submit_many([1, 2, 3], scope=run)
        seen = []
        counter = _OpCounter(rs._obj)

        def handler(d):  # (a plain function: called in a worker thread with a blocking delivery)
            seen.append(d.input)
            return d.input * 10

        def stop_when_done():
            for t in tickets:
                rs.task(t.id).result(timeout=30)
            run.cancel()

        th = threading.Thread(target=stop_when_done)
        th.start()
        stats = rallypoint.sync.consume(rs, m, run, handler, wait=5, handle_signals=False)
        th.join()
    assert stats.completed == 3 and sorted(seen) == [1, 2, 3]
    assert counter.counts.get("delivery.complete_next", 0) >= 1


async def test_a_waiting_producer_gets_the_result_from_the_complete_next_itself(autojump_clock, ers):
    # Results pushed: a producer parked on task.result / task.results is answered by
    # the step that applies the worker's complete_next (no poll, no second request).
    coord = ers.node.coordinator
    m = await ers.mailboxes.ensure("cn-push")
    run = await ers.scopes.create()
    one, *batch = await m.submit_many(["a", "b", "c"], scope=run)
    d = await m.receive(run, wait=0)
    counter = _OpCounter(ers)
    got = {}

    async def producer():
        got["one"] = await one.result(timeout=30)
        got["at"] = trio.current_time()

    async def batch_producer():
        got["batch"] = await ers.results(batch, timeout=30)

    async with trio.open_nursery() as n:
        n.start_soon(producer)
        n.start_soon(batch_producer)
        await wait_parked(coord, 2)
        t0 = trio.current_time()
        nxt = await d.complete_and_next("A", max_messages=2)
        await nxt[0].complete_and_next("B")
        await nxt[1].complete("C")
    assert got["one"].outcome == "A" and got["at"] == t0  # answered by that step: no time passed
    assert [i.outcome for i in got["batch"]] == ["B", "C"]
    assert counter.counts["task.result"] == 1 and counter.counts["task.results"] == 1
