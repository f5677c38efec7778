"""A filtered watch's cursor advances over what the server scanned (issue 34 item 5).

The replayed report: a watch on ``task.failed``, fully caught up, saw 300 unrelated
events under ``--retain-events 100``; the daemon restarted; the SDK resumed from its
last *matching* cursor and got CURSOR_EXPIRED. Now every push carries the position the
server scanned up to (``wire.Push.cursor``), a filtered watch is told its position by
pushes without events (at most one every ``PROGRESS_S``), the SDK's ``EventStream``
resumes from it, and HTTP's ``/watch`` answers it as ``nextCursor`` after a hold."""

from __future__ import annotations

import signal
import socket
import threading

import httpx
import pytest
import trio

import rallypoint
from rallypoint.actors.watch import PROGRESS_S
from rallypoint.errors import CursorExpiredError

from conftest import Daemon
from sdk_compat import HttpDaemon


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _fail_a_task(rs, mbx, run) -> str:
    t = await mbx.submit({"fail": True}, scope=run)
    d = await mbx.receive(run, wait=10)
    assert d.task_id == t.id
    await d.reject("boom")
    return t.id


async def _newest(rs) -> int:
    return (await rs.events.list(limit=1)).newest


async def _until(cond, timeout: float = 20) -> None:
    """Wait (polling the condition) until ``cond()`` holds."""
    with trio.fail_after(timeout):
        while not cond():
            await trio.sleep(0.02)


@pytest.mark.not_in_cluster("a whole space's watch has a cursor per shard (a vector string), not one number "
                             "(the per-shard form: tests/test_shard_events_merge.py)")
async def test_a_filtered_watch_is_told_how_far_the_server_scanned(rs):
    """Caught up on ``task.failed``, it sees no event while 120 unrelated ones happen,
    yet its cursor moves to the newest; every event it does see comes exactly once."""
    mbx = await rs.mailboxes.ensure("wc-told", max_attempts=1)
    run = await rs.scopes.create()
    async with rs.events.watch(types="task.failed", start="now") as stream:
        failed = await _fail_a_task(rs, mbx, run)
        first = await stream.next(timeout=10)
        assert (first.type, first.id) == ("task.failed", failed) and stream.cursor >= first.seq
        got: list = []

        async def reader():
            got.append(await stream.next())

        async with trio.open_nursery() as n:
            n.start_soon(reader)
            noise = await rs.mailboxes.ensure("wc-told-noise")
            await noise.submit_many([{"i": i} for i in range(100)], scope=run, details=False)
            for _ in range(20):
                await rs.scopes.create()
            newest = await _newest(rs)
            assert newest >= first.seq + 120
            await _until(lambda: stream.cursor >= newest)  # told, without a match
            assert got == []
            second = await _fail_a_task(rs, mbx, run)
            await _until(lambda: got)
        assert [(e.type, e.id) for e in got] == [("task.failed", second)]
        assert stream.cursor >= got[0].seq


async def test_position_pushes_come_at_most_every_progress_s(autojump_clock):
    """A filtered watch over a busy space gets its position at most every PROGRESS_S
    (s), not once per commit, and the last one no later than PROGRESS_S after the
    last event."""
    async with rallypoint.open_embedded() as rs:
        coord = rs.node.coordinator
        mbx = await rs.mailboxes.ensure("wc-rate")
        run = await rs.scopes.create()
        async with rs.events.watch(types="task.failed", start="now") as stream:
            got: list = []

            async def reader():
                got.append(await stream.next())

            async with trio.open_nursery() as n:
                n.start_soon(reader)
                frames0 = coord.watchers.push_frames
                start = trio.current_time()
                for i in range(200):  # 200 commits over 2 s
                    await mbx.submit({"i": i}, scope=run)
                    await trio.sleep(0.01)
                newest = await _newest(rs)
                await _until(lambda: stream.cursor >= newest, timeout=PROGRESS_S + 1)
                elapsed = trio.current_time() - start
                frames = coord.watchers.push_frames - frames0
                assert 1 <= frames <= elapsed / PROGRESS_S + 2, (frames, elapsed)
                assert got == []
                n.cancel_scope.cancel()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
async def test_a_filtered_watch_resumes_after_a_restart_without_cursor_expired(sig, tmp_path):
    data, port = str(tmp_path / "data"), free_port()
    args = (data, "fsync", ["--listen", f"127.0.0.1:{port}", "--retain-events", "100"])
    daemons = [Daemon(*args).start()]
    try:
        async with rallypoint.connect(daemons[0].url, reconnect=rallypoint.Reconnect(timeout=30)) as rs:
            mbx = await rs.mailboxes.ensure("wc-restart", max_attempts=1)
            run = await rs.scopes.create()
            async with rs.events.watch(types="task.failed", start="now") as stream:
                await _fail_a_task(rs, mbx, run)
                first = await stream.next(timeout=10)
                got: list = []

                async def reader():
                    got.append(await stream.next())

                async with trio.open_nursery() as n:
                    n.start_soon(reader)
                    noise = await rs.mailboxes.ensure("wc-restart-noise")
                    for k in range(3):  # 300 unrelated events
                        await noise.submit_many([{"i": i} for i in range(100)], scope=run, details=False)
                    newest = await _newest(rs)
                    assert (await rs.events.list(limit=1)).oldest > first.seq  # the match is no longer kept
                    await _until(lambda: stream.cursor >= newest)
                    rc = await trio.to_thread.run_sync(daemons[0].stop, sig)
                    assert rc == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
                    daemons.append(await trio.to_thread.run_sync(Daemon(*args).start))
                    with pytest.raises(CursorExpiredError):  # resuming from the last match would fail
                        await rs.events.list(cursor=first.seq)
                    after = await _fail_a_task(rs, mbx, run)
                    await _until(lambda: got, timeout=30)
                assert [(e.type, e.id) for e in got] == [("task.failed", after)]
                assert stream.resumed >= 1 and rs._transport.reconnects >= 1
    finally:
        for d in daemons:
            d.kill()


def test_http_watch_answers_the_position_scanned_during_its_hold(tmp_path):
    """GET /watch held on a filter: the events that happen meanwhile and do not match
    still move ``nextCursor`` past them."""
    d = HttpDaemon(str(tmp_path / "d"), open_mode=True).start()
    try:
        base = f"{d.base_url}/v1/spaces/default"
        cursor = httpx.get(f"{base}/events", params={"limit": 1}).json()["newest"]
        out: dict = {}

        def hold():  # (a thread: httpx's blocking client)
            out["page"] = httpx.get(f"{base}/watch", params={"types": "task.failed", "cursor": cursor,
                                                             "waitSeconds": 3}, timeout=30).json()

        th = threading.Thread(target=hold)
        th.start()
        for i in range(5):
            httpx.post(f"{base}/scopes", json={"name": f"unrelated-{i}"})
        th.join()
        newest = httpx.get(f"{base}/events", params={"limit": 1}).json()["newest"]
        page = out["page"]
        assert page["events"] == []
        assert int(page["nextCursor"]) == newest >= int(cursor) + 5
    finally:
        d.stop()
