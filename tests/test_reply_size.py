"""Replies sized before anything is applied (issue 34 item 2): a batch receive leases no
more than its reply carries within the 1 MiB frame; ``task.results`` answers in pages;
``task.submit_many`` and ``delivery.complete_many`` answer the views that fit (ids and
brief answers for the rest) and the SDK splits a batch whose items exceed a frame. The
replayed report: ``consume(concurrency=32)`` over 60 KiB tasks got a 1.9 MB reply,
refused as LIMIT_EXCEEDED, while its 32 tasks stayed leased with an attempt counted
(after two attempts FAILED ``lease_expired`` without reaching a handler)."""

from __future__ import annotations

import msgspec
import pytest
import trio

import rallypoint
from rallypoint import protocol as p
from rallypoint.actors.common import REPLY_BUDGET_BYTES, fit_count
from rallypoint.actors.queue import delivery_bytes, outcome_view_bytes, task_view_bytes
from rallypoint.errors import LimitError
from rallypoint.service import Session
from rallypoint.wire import MAX_FRAME_BYTES

BIG = 60 * 1024  # a 60 KiB payload: within the 64 KiB limit


def big(i: int) -> bytes:
    return bytes([i % 251]) * BIG


def test_fit_count_takes_the_leading_items_that_fit_and_always_one():
    assert fit_count([10, 10, 10], 25) == 2
    assert fit_count([10, 10, 10], 30) == 3
    assert fit_count([100], 10) == 1  # one item always goes
    assert fit_count([], 10) == 0
    assert REPLY_BUDGET_BYTES + 1024 < MAX_FRAME_BYTES  # room for the envelope and the view's own fields


async def test_the_size_bounds_hold_for_the_largest_views(autojump_clock, ers):
    """The bounds the handlers size replies by are upper bounds of the real encodings,
    at their largest: 4-byte characters in a 256-character key, a 128-character
    mailbox name, 4 pools with 128-character names and 2 budgets, subscribers, a
    128-character holder."""
    rs = ers
    coord = rs.node.coordinator
    name = "m" * 128
    pools = ["p" * 127 + str(i) for i in range(4)]
    for pn in pools:
        await rs.pools.ensure(pn, 10)
    for bn in ("b1", "b2"):
        await rs.budgets.ensure(bn, limit=1000)
    mbx = await rs.mailboxes.ensure(name)
    run = await rs.scopes.create()
    key = "\U0001F600" * 256
    tk = await mbx.submit(big(1), scope=run, key=key,
                          requirements={"pools": {pn: 1 for pn in pools}, "budgets": {"b1": 1, "b2": 1}})
    for i in range(3):
        await rs.node.service.call(Session(), p.TaskSubscribe(task_id=tk.id, subscriber_id=str(i) + "\u00e9" * 255))
    t = coord.queues.tasks[tk.id]
    q = coord.queues.table[t.mailbox_id]
    holder = "\U0001F600" * 128  # the longest holder, in 4-byte characters
    bound = delivery_bytes(t, q, holder)
    reply = await rs.node.service.call(Session(), p.Receive(mailbox=name, scope_id=run.id, max_messages=1,
                                                            holder=holder))
    view = msgspec.msgpack.decode(reply, type=p.ReceiveView).deliveries[0]
    assert len(view.grants) == 4 and len(view.reservations) == 2 and view.holder == holder
    assert len(msgspec.msgpack.encode(view)) <= bound
    d_outcome = "\U0001F600" * 10_000
    await rs.node.service.call(Session(), p.DeliveryComplete(task_id=t.id, token=t.token,
                                                            outcome=msgspec.Raw(msgspec.msgpack.encode(d_outcome))))
    assert len(msgspec.msgpack.encode(coord.queues.task_view(t))) <= task_view_bytes(t)
    raw = await rs.node.service.call(Session(), p.TaskResults(task_ids=[t.id], brief=True))
    out = msgspec.msgpack.decode(raw, type=p.TaskListView).outcomes[0]
    assert len(msgspec.msgpack.encode(out)) <= outcome_view_bytes(t)


async def _tasks(rs, name: str, n: int, **kw):
    mbx = await rs.mailboxes.ensure(name, **kw)
    run = await rs.scopes.create()
    tickets = [await mbx.submit(big(i), scope=run) for i in range(n)]
    return mbx, run, tickets


async def test_a_batch_receive_leases_only_what_its_reply_carries(daemon):
    async with rallypoint.connect(daemon.url) as rs:
        mbx, run, tickets = await _tasks(rs, "rs-receive", 32)
        got = await mbx.receive(run, max_messages=32, wait=0)
        assert 8 <= len(got) < 32  # as many as fit in 1 MiB, not LIMIT_EXCEEDED
        leased = {d.task_id for d in got}
        assert [tk.id for tk in tickets[:len(got)]] == [d.task_id for d in got]  # the oldest first
        for tk in tickets:
            info = await tk.status()
            if tk.id in leased:
                assert (info.state, info.attempt) == ("RUNNING", 1)
            else:  # never leased: still on its first attempt, first in line
                assert (info.state, info.attempt) == ("QUEUED", 1)
        raw = await rs._transport.call(p.Receive(mailbox="rs-receive", scope_id=run.id, max_messages=32))
        nxt = msgspec.msgpack.decode(raw, type=p.ReceiveView).deliveries
        assert nxt[0].task_id == tickets[len(got)].id


async def test_consume_with_32_slots_over_60_kib_tasks_completes_every_task_on_its_first_attempt(daemon):
    async with rallypoint.connect(daemon.url) as rs:
        mbx, run, tickets = await _tasks(rs, "rs-consume", 64, max_attempts=2)
        seen: list[int] = []

        async def handler(d):
            seen.append(len(d.input))
            return {"n": len(d.input)}

        async def worker():
            await rallypoint.consume(rs, mbx, run, handler, concurrency=32, wait=1)

        async with trio.open_nursery() as n:
            n.start_soon(worker)
            infos = await rs.results(tickets, timeout=120)
            await run.cancel()
        assert [(i.state, i.attempt, i.outcome) for i in infos] == [("SUCCEEDED", 1, {"n": BIG})] * 64
        assert len(seen) == 64


async def test_results_over_large_outcomes_answers_in_pages(daemon):
    """rs.results over 100 outcomes of 60 KiB (6 MB): every one, over TCP, both forms."""
    async with rallypoint.connect(daemon.url) as rs:
        mbx = await rs.mailboxes.ensure("rs-results")
        run = await rs.scopes.create()
        tickets = await mbx.submit_many(list(range(100)), scope=run, details=False)
        for _ in range(100):
            d = await mbx.receive(run, wait=5)
            await d.complete(big(d.input))
        outcomes = await rs.results(tickets, timeout=30, details=False)
        assert [o.outcome for o in outcomes] == [big(i) for i in range(100)]
        infos = await rs.results(tickets, timeout=30)
        assert [(i.id, i.outcome) for i in infos] == [(tk.id, big(k)) for k, tk in enumerate(tickets)]
        # the raw op: one page, the leading ones that fit
        raw = await rs._transport.call(p.TaskResults(task_ids=[tk.id for tk in tickets], brief=True))
        page = msgspec.msgpack.decode(raw, type=p.TaskListView).outcomes
        assert 8 <= len(page) < 100 and [o.id for o in page] == [tk.id for tk in tickets[:len(page)]]


async def test_submit_many_splits_a_batch_over_the_frame_limit(daemon):
    """submit_many of 40 x 30 KB: was refused naming field `body`; now sent in parts,
    with or without details, and with keys a re-sent batch makes nothing twice."""
    payloads = [bytes([i]) * 30_000 for i in range(40)]
    async with rallypoint.connect(daemon.url) as rs:
        mbx = await rs.mailboxes.ensure("rs-submit")
        run = await rs.scopes.create()
        tickets = await mbx.submit_many(payloads, scope=run)
        assert [tk.info.input for tk in tickets] == payloads  # every view, some fetched after the reply
        brief = await mbx.submit_many(payloads, scope=run, details=False)
        assert len({tk.id for tk in brief} | {tk.id for tk in tickets}) == 80
        keys = [f"k-{i}" for i in range(40)]
        keyed = await mbx.submit_many(payloads, scope=run, keys=keys)
        again = await mbx.submit_many(payloads, scope=run, keys=keys)
        assert [tk.id for tk in again] == [tk.id for tk in keyed]
        assert (await mbx.status()).queued == 120


async def test_a_refused_part_of_a_split_submit_many_says_how_many_were_submitted(daemon):
    payloads = [bytes([i]) * 30_000 for i in range(40)]
    keys = [f"part-{i}" for i in range(40)]
    async with rallypoint.connect(daemon.url) as rs:
        mbx = await rs.mailboxes.ensure("rs-submit-part", backlog_limit=36)
        run = await rs.scopes.create()
        with pytest.raises(LimitError) as ei:
            await mbx.submit_many(payloads, scope=run, keys=keys)
        done = ei.value.details["submitted"]
        assert 20 <= done < 40 and (await mbx.status()).queued == done
        for _ in range(10):  # make room, then send the whole batch again: nothing twice
            await (await mbx.receive(run, wait=5)).complete(None)
        tickets = await mbx.submit_many(payloads, scope=run, keys=keys)
        assert len({tk.id for tk in tickets}) == 40
        assert (await mbx.status()).queued == 30  # 40 tasks, 10 of them completed


async def test_complete_many_with_views_over_large_tasks(daemon):
    """20 deliveries of 60 KiB inputs completed with 60 KiB outcomes in one call: the
    request is split by the SDK, the views that do not fit the reply are fetched."""
    async with rallypoint.connect(daemon.url) as rs:
        mbx, run, tickets = await _tasks(rs, "rs-complete", 20)
        ds = []
        while len(ds) < 20:
            ds.append(await mbx.receive(run, wait=5))
        out = await rs.mailbox("rs-complete").complete_many([(d, big(k)) for k, d in enumerate(ds)])
        assert [(i.id, i.state, i.outcome) for i in out] == [(d.task_id, "SUCCEEDED", big(k)) for k, d in enumerate(ds)]
        # the raw op: views while they fit, brief answers after
        mbx2, run2, _ = await _tasks(rs, "rs-complete-raw", 20)
        items = []
        for _ in range(20):
            d = await mbx2.receive(run2, wait=5)
            items.append(p.CompleteItem(task_id=d.task_id, token=d.token, outcome=msgspec.Raw(msgspec.msgpack.encode(7))))
        raw = await rs._transport.call(p.DeliveryCompleteMany(items=items))
        answers = msgspec.msgpack.decode(raw, type=p.SettledListView).items
        assert all(a.error is None for a in answers)
        with_view = [a for a in answers if a.task is not None]
        assert 8 <= len(with_view) < 20 and answers[:len(with_view)] == with_view


async def test_a_worker_holding_large_tasks_across_a_sigkill_finishes_every_one_on_its_first_attempt(tmp_path):
    """The kill -9 form: consume(concurrency=32) holds 20 tasks of 60 KiB (received in
    batches that fit a frame), the daemon is SIGKILLed and restarted on its data dir; the
    held leases survive, 20 more tasks arrive; every task is SUCCEEDED on attempt 1,
    none FAILED ``lease_expired`` without reaching the handler."""
    import signal
    import socket

    from conftest import Daemon

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = (str(tmp_path / "data"), "fsync", ["--listen", f"127.0.0.1:{port}"])
    daemons = [Daemon(*args).start()]
    try:
        async with rallypoint.connect(daemons[0].url, reconnect=rallypoint.Reconnect(timeout=30)) as rs:
            mbx = await rs.mailboxes.ensure("rs-kill", max_attempts=2)
            run = await rs.scopes.create()
            tickets = await mbx.submit_many([big(i) for i in range(20)], scope=run, keys=[f"a{i}" for i in range(20)])
            restarted, all_held = trio.Event(), trio.Event()
            handled: list[int] = []

            async def handler(d):
                handled.append(d.input[0])
                if len(handled) == 20:
                    all_held.set()
                if len(handled) <= 20:
                    await restarted.wait()
                return len(d.input)

            async def worker():
                await rallypoint.consume(rs, mbx, run, handler, concurrency=32, lease_seconds=30)

            async with trio.open_nursery() as n:
                n.start_soon(worker)
                with trio.fail_after(30):
                    await all_held.wait()
                    await trio.testing.wait_all_tasks_blocked()  # the next receive parked: nothing leased
                daemons[0].proc.send_signal(signal.SIGKILL)
                await trio.to_thread.run_sync(daemons[0].proc.wait)
                daemons.append(await trio.to_thread.run_sync(Daemon(*args).start))
                restarted.set()
                tickets += await mbx.submit_many([big(i) for i in range(20, 40)], scope=run,
                                                 keys=[f"a{i}" for i in range(20, 40)])
                with trio.fail_after(60):
                    infos = await rs.results(tickets)
                await run.cancel()
            assert [(i.state, i.attempt, i.outcome) for i in infos] == [("SUCCEEDED", 1, BIG)] * 40
            assert sorted(handled) == [i % 251 for i in range(40)] and len(handled) == 40
    finally:
        for d in daemons:
            d.kill()
