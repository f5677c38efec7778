"""Quotas, budgets and messages across a SIGKILL of a real daemon (fsync): windows and
their used units, waiters, reservations, usage keys and message leases survive;
nothing is granted or charged twice; waiters keep being served after the restart."""

from __future__ import annotations

import time
from datetime import datetime, timezone

import pytest
import trio

import rallypoint
from rallypoint import protocol as p
from rallypoint.client import types as t
from rallypoint.errors import AllowanceExhaustedError

from conftest import Daemon


def phase(url: str, fn):
    async def main():
        async with rallypoint.connect(url, reconnect=False) as rs:
            return await fn(rs)

    return trio.run(main)


def test_quota_windows_and_waiters_survive_a_sigkill(tmp_path):
    data = str(tmp_path / "data")
    d = Daemon(data, "fsync").start()
    try:
        async def before(rs):
            run = await rs.scopes.create()
            q = await rs.quotas.ensure("q", units_limit=1, window_seconds=2)
            first = await q.take(scope=run)
            w1 = await q.enqueue(scope=run, ttl=60)
            g1 = await w1.wait(timeout=5)  # granted by the serve at the next boundary
            assert g1.state == "GRANTED"
            w2 = await q.enqueue(scope=run, ttl=60)
            w3 = await q.enqueue(scope=run, ttl=60)
            day = await rs.quotas.ensure("day", units_limit=3, window_seconds=86_400)
            await day.take(3, scope=run)
            short = await day.enqueue(scope=run, ttl=1)  # expires while the daemon is down
            return {"run": run.id, "first": first.consumption_id, "w1": (w1.id, g1.consumption_id),
                    "w2": w2.id, "w3": w3.id, "day_window": (await day.status()).window_start, "short": short.id}

        s = phase(d.url, before)
        d.kill()  # SIGKILL: no drain, no snapshot
        time.sleep(1.2)
        d = Daemon(data, "fsync").start()

        async def after(rs):
            q = rs.quota("q")
            g1 = await q.waiter(s["w1"][0]).status()
            assert (g1.state, g1.consumption_id) == ("GRANTED", s["w1"][1])  # the same grant, not a new one
            g2 = await q.waiter(s["w2"]).wait(timeout=10)
            g3 = await q.waiter(s["w3"]).wait(timeout=10)
            assert g2.state == g3.state == "GRANTED"
            windows = [g1.window_start, g2.window_start, g3.window_start]
            assert windows == sorted(windows) and len(set(windows)) == 3  # one unit per window, in line order
            cids = {s["first"], g1.consumption_id, g2.consumption_id, g3.consumption_id}
            assert len(cids) == 4
            st = await q.status()
            assert (st.consumed_total, st.waiting) == (4, 0)  # every unit taken exactly once
            short = await rs.quota("day").waiter(s["short"]).status()
            assert (short.state, short.end_reason) == ("EXPIRED", "ttl")  # its TTL was re-armed
            day = await rs.quota("day").status()
            if day.window_start == s["day_window"]:  # (unless the day rolled meanwhile)
                assert day.used == 3
                with pytest.raises(AllowanceExhaustedError):
                    await rs.quota("day").take(scope=rs.scope(s["run"]))

        phase(d.url, after)
    finally:
        d.kill()


def test_budget_reservations_and_usage_keys_survive_a_sigkill(tmp_path):
    data = str(tmp_path / "data")
    d = Daemon(data, "fsync").start()
    try:
        async def before(rs):
            run = await rs.scopes.create()
            b = await rs.budgets.ensure("b", limit=1000)
            a = await b.reserve(300, scope=run, key="job-a")
            await a.settle(100, "step-1", final=False)
            stale = await b.reserve(200, scope=run, settle_within_seconds=1)
            return {"run": run.id, "a": a.id, "stale": stale.id}

        s = phase(d.url, before)
        d.kill()
        d = Daemon(data, "fsync").start()

        async def after(rs):
            b = rs.budget("b")
            a = await b.reservation(s["a"]).status()
            assert (a.state, a.remaining_minor, a.settled_minor) == ("ACTIVE", 200, 100)
            again = await b.reservation(s["a"]).settle(100, "step-1", final=False)
            assert again.replayed  # the usage key survived: not charged twice
            same = await b.reserve(300, scope=rs.scope(s["run"]), key="job-a")
            assert same.id == s["a"]  # the reservation key survived: not reserved twice
            deadline = trio.current_time() + 10
            while (st := await b.reservation(s["stale"]).status()).state != "STALE":
                assert trio.current_time() < deadline, st
                await trio.sleep(0.05)
            assert st.remaining_minor == 200  # settle-by re-armed; marked, not refunded
            bs = await b.status()
            assert (bs.settled_minor, bs.reserved_minor, bs.available_minor) == (100, 400, 500)
            s2 = await b.reservation(s["a"]).settle(150, "step-2")
            assert s2.charged_minor == 150 and s2.reservation.state == "SETTLED"
            assert (await b.status()).available_minor == 1000 - 250 - 200

        phase(d.url, after)
    finally:
        d.kill()


def test_message_leases_and_queue_survive_a_sigkill(tmp_path):
    data = str(tmp_path / "data")
    d = Daemon(data, "fsync").start()
    try:
        async def before(rs):
            run = await rs.scopes.create()
            inbox = await rs.mailboxes.ensure("in", mode="INBOX")
            ms = [await inbox.send({"n": i}, scope=run) for i in range(3)]
            dl = await inbox.receive(run, lease_seconds=30, wait=0)
            return {"run": run.id, "ids": [m.id for m in ms], "held": dl.message_id, "token": dl.token}

        s = phase(d.url, before)
        d.kill()
        d = Daemon(data, "fsync").start()

        async def after(rs):
            held = await rs.message(s["held"]).status()
            assert held.state == "RUNNING"  # the lease is kept (extended by the downtime)
            done = await rs._call(p.DeliveryComplete(task_id=s["held"], token=s["token"],
                                                     outcome=p.NIL), t.TaskInfo)
            assert done.state == "ACKED"
            got = await rs.mailbox("in").receive(rs.scope(s["run"]), wait=0, max_messages=10)
            assert [x.message_id for x in got] == s["ids"][1:] and all(x.attempt == 1 for x in got)

        phase(d.url, after)
    finally:
        d.kill()




async def test_a_waiting_take_survives_a_sigkill_and_is_granted_once(tmp_path):
    """A ``take(wait=...)`` parked on the server when the daemon is SIGKILLed: the
    reconnecting client sends its keyed request again, finds the same durable waiter,
    and returns its grant once the window rolls -- one grant, one consumption id."""
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    data = str(tmp_path / "data")
    args = (data, "fsync", ["--listen", f"127.0.0.1:{port}"])
    daemons = [Daemon(*args).start()]
    try:
        async with rallypoint.connect(daemons[0].url, reconnect=rallypoint.Reconnect(timeout=30)) as rs:
            run = await rs.scopes.create()
            q = await rs.quotas.ensure("restart", units_limit=1, window_seconds=4)
            st = await q.status()  # start in a fresh window, so the wait below is ~4 s
            await trio.sleep((st.window_end - datetime.now(timezone.utc)).total_seconds() + 0.05)
            await q.take(scope=run)  # the window's one unit: the next take waits for the next window
            got = {}

            async def taker():
                got["grant"] = await q.take(scope=run, wait=60)

            async with trio.open_nursery() as n:
                n.start_soon(taker)
                with trio.fail_after(10):
                    while (await q.status()).waiting != 1:
                        await trio.sleep(0.02)
                daemons[0].kill()  # the keyed take is parked on the server, in flight
                daemons.append(Daemon(*args).start())
            g = got["grant"]
            assert g.state == "GRANTED"
            w = await q.waiter(g.waiter_id).status()
            assert w.consumption_id == g.consumption_id
            st = await q.status()
            assert (st.consumed_total, st.waiting) == (2, 0)  # one grant for the waiting take, not two
            assert rs._transport.reconnects >= 1
    finally:
        for d in daemons:
            d.kill()
