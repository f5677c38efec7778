"""Workers that survive (issue 12, item 5), against a real daemon process: a consume()
worker keeps its leases and finishes every task across a daemon restart, whether the
daemon was killed (SIGKILL) or drained (SIGTERM)."""

from __future__ import annotations

import signal
import socket

import pytest
import trio

import rallypoint

from conftest import Daemon


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
async def test_consume_finishes_every_task_across_a_daemon_restart(sig, tmp_path):
    data, port = str(tmp_path / "data"), free_port()
    args = (data, "fsync", ["--listen", f"127.0.0.1:{port}"])
    daemons = [Daemon(*args).start()]
    n_tasks = 12
    try:
        # The lease (30 s) outlasts the restart: the held deliveries keep theirs. Tasks
        # 0-5 before the restart (4 and 5 held across it), 6-11 after it.
        async with rallypoint.connect(daemons[0].url, reconnect=rallypoint.Reconnect(timeout=30)) as rs:
            mbx = await rs.mailboxes.ensure("restart-jobs")
            run = await rs.scopes.create(name="restart")
            keys = [f"k{i}" for i in range(n_tasks)]
            tickets = await mbx.submit_many(range(6), scope=run, keys=keys[:6])
            both_held, restarted = trio.Event(), trio.Event()
            held, handled, renewed = [], [], {}

            async def handler(d):
                handled.append((d.input, d.attempt))
                if d.input in (4, 5):  # these two span the restart, leased
                    held.append(d.input)
                    if len(held) == 2:
                        both_held.set()
                    await restarted.wait()
                    before = d.lease_expires_at
                    renewed[d.input] = (before, await d.renew())  # renewals resume
                return d.input * 10

            result = {}

            async def worker():
                result["stats"] = await rallypoint.consume(rs, mbx, run, handler, concurrency=3, lease_seconds=30)

            async with trio.open_nursery() as n:
                n.start_soon(worker)
                with trio.fail_after(20):
                    await both_held.wait()
                    # 0-3 done, 4 and 5 held, the third worker's receive in flight
                    await trio.testing.wait_all_tasks_blocked()
                    assert len(handled) == 6
                    rc = await trio.to_thread.run_sync(daemons[0].stop, sig)
                    assert rc == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
                    daemons.append(await trio.to_thread.run_sync(Daemon(*args).start))
                restarted.set()
                tickets += await mbx.submit_many(range(6, n_tasks), scope=run, keys=keys[6:])
                with trio.fail_after(60):
                    infos = await rs.results(tickets)
                await run.cancel()
            s = result["stats"]
            assert [(i.state, i.outcome) for i in infos] == [("SUCCEEDED", k * 10) for k in range(n_tasks)]
            # The held ones kept their lease across the restart: first attempt, renewed.
            assert infos[4].attempt == infos[5].attempt == 1
            assert all(after > before for before, after in renewed.values()) and len(renewed) == 2
            assert sorted({k for k, _ in handled}) == list(range(n_tasks))
            assert (s.completed, s.lost, s.stop_reason) == (n_tasks, 0, "SCOPE_CANCELLED")
            assert s.received == s.completed + s.retried + s.released + s.lost
            assert rs._transport.reconnects >= 1
    finally:
        for d in daemons:
            d.kill()


def test_reconnecting_consume_under_asyncio(tmp_path):
    # The same client under asyncio (anyio): a worker holding a delivery across a
    # SIGKILL restart completes it, and serves work submitted after the restart.
    import anyio

    data, port = str(tmp_path / "data"), free_port()
    args = (data, "fsync", ["--listen", f"127.0.0.1:{port}"])
    daemons = [Daemon(*args).start()]

    async def main():
        import asyncio

        asyncio.get_running_loop()  # really asyncio
        async with rallypoint.connect(daemons[0].url, reconnect=rallypoint.Reconnect(timeout=30)) as rs:
            mbx = await rs.mailboxes.ensure("asyncio-jobs")
            run = await rs.scopes.create()
            first = await mbx.submit("held", scope=run, key="held")
            held, restarted = anyio.Event(), anyio.Event()

            async def handler(d):
                if d.input == "held":
                    held.set()
                    await restarted.wait()
                return d.input.upper()

            stats = {}

            async def worker():
                stats["s"] = await rallypoint.consume(rs, mbx, run, handler, concurrency=2)

            async with anyio.create_task_group() as tg:
                tg.start_soon(worker)
                with anyio.fail_after(20):
                    await held.wait()
                    await anyio.to_thread.run_sync(daemons[0].stop, signal.SIGKILL)
                    daemons.append(await anyio.to_thread.run_sync(Daemon(*args).start))
                restarted.set()
                later = await mbx.submit("later", scope=run, key="later")
                with anyio.fail_after(30):
                    infos = await rs.results([first, later])
                await run.cancel()
            assert [(i.state, i.outcome, i.attempt) for i in infos] == [("SUCCEEDED", "HELD", 1), ("SUCCEEDED", "LATER", 1)]
            assert (stats["s"].completed, stats["s"].lost) == (2, 0)
            assert rs._transport.reconnects == 1

    try:
        anyio.run(main, backend="asyncio")
    finally:
        for d in daemons:
            d.kill()


async def test_complete_next_across_a_sigkill_between_its_halves(tmp_path):
    # Complete-and-next (issue 47) against a real daemon killed with SIGKILL between the
    # halves: the settle was journaled (fsync) and the receive half parked when the
    # daemon dies. After the restart the re-sent request finds the task SUCCEEDED with
    # its outcome (recovered from the journal: completed once, attempt 1), receives
    # anew, and gets the task submitted after the restart; the delivery held across
    # the kill keeps its lease and completes with its token.
    from conftest import wait_parked_remote

    data, port = str(tmp_path / "data"), free_port()
    args = (data, "fsync", ["--listen", f"127.0.0.1:{port}"])
    daemons = [Daemon(*args).start()]
    try:
        async with rallypoint.connect(daemons[0].url, reconnect=rallypoint.Reconnect(timeout=30)) as rs:
            mbx = await rs.mailboxes.ensure("cn-kill")
            run = await rs.scopes.create(name="cn-kill")
            a, held_t = await mbx.submit_many(["a", "held"], scope=run, keys=["a", "held"])
            d, held = await mbx.receive(run, wait=0, max_messages=2)
            got = {}

            async def worker():
                got["next"] = await d.complete_and_next("A", wait=30)

            async with trio.open_nursery() as n:
                n.start_soon(worker)
                with trio.fail_after(20):
                    await wait_parked_remote(rs, 1)
                    rc = await trio.to_thread.run_sync(daemons[0].stop, signal.SIGKILL)
                    assert rc == -signal.SIGKILL
                    daemons.append(await trio.to_thread.run_sync(Daemon(*args).start))
                    b = await mbx.submit("b", scope=run, key="b")
            nxt = got["next"]
            assert [x.task_id for x in nxt] == [b.id] and nxt[0].attempt == 1
            assert (nxt.task.state, nxt.task.outcome) == ("SUCCEEDED", "A") and not d.lost
            res = await a.result(timeout=0)
            assert (res.state, res.outcome, res.attempt) == ("SUCCEEDED", "A", 1)
            assert (await held.complete("H")).state == "SUCCEEDED"  # its lease survived
            assert (await nxt[0].complete("B")).outcome == "B"
            assert rs._transport.reconnects >= 1
    finally:
        for dm in daemons:
            dm.kill()
