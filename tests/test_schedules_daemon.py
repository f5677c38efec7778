"""Schedules across a SIGKILL of a real daemon (fsync): a 1-second schedule is killed
between fires, restarted, and every scheduled time from its first fire to the last is
fired exactly once -- no time twice, none missing (the downtime is inside the catch-up
window), and no run without its action record (each run the schedule made is one
action's)."""

from __future__ import annotations

import time

import trio

import rallypoint

from conftest import Daemon


def phase(url: str, fn):
    async def main():
        async with rallypoint.connect(url, reconnect=False) as rs:
            return await fn(rs)

    return trio.run(main)


async def _wait_actions(rs, name: str, n: int, timeout: float = 20.0):
    with trio.fail_after(timeout):
        while True:
            d = await (await rs.schedules.get(name)).describe(next_n=1, recent=100)
            if d.actions >= n:
                return d
            await trio.sleep(0.1)


def test_each_scheduled_time_fires_exactly_once_across_a_sigkill(tmp_path):
    data = str(tmp_path / "data")
    d = Daemon(data, "fsync").start()
    try:
        async def before(rs):
            await rs.mailboxes.ensure("jobs")
            await rs.schedules.create("tick", every=1, mailbox="jobs", input="go", overlap="allow_all",
                                      catchup_window=60, run_name="tick {time}")
            info = await _wait_actions(rs, "tick", 3)
            return info.actions

        n_before = phase(d.url, before)
        d.kill()  # SIGKILL in the second of a fire: no drain, no snapshot
        time.sleep(1.5)  # down for more than one scheduled time
        d = Daemon(data, "fsync").start()

        async def after(rs):
            info = await _wait_actions(rs, "tick", n_before + 4)
            await (await rs.schedules.get("tick")).pause("check")
            info = await (await rs.schedules.get("tick")).describe(next_n=0, recent=100)
            times = sorted(a.scheduled_at for a in info.recent)
            assert len(times) == len(set(times)) == info.actions  # never twice
            gaps = {(b - a).total_seconds() for a, b in zip(times, times[1:])}
            assert gaps == {1.0}, gaps  # none missing: every second from the first to the last
            assert info.skipped == 0
            assert {a.origin for a in info.recent} >= {"scheduled", "catchup"}  # the downtime's times caught up
            runs = [r for r in await rs.scopes.list(roots_only=True, limit=1000) if (r.name or "").startswith("tick ")]
            assert sorted(r.id for r in runs) == sorted(a.run_id for a in info.recent)  # no run without its record
            for a in info.recent[:5]:
                st = await rs.scope(a.run_id).status()
                assert st.tasks == {"QUEUED": 1}  # each with its task

        phase(d.url, after)
    finally:
        d.kill()


def test_the_schedules_cli(tmp_path):
    import json
    import os
    import subprocess
    import sys

    d = Daemon(str(tmp_path / "data"), "fsync").start()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))

    def cli(*args):
        r = subprocess.run([sys.executable, "-m", "rallypoint", "schedules", *args, "--connect", d.url],
                           capture_output=True, text=True, env=env, timeout=60)
        return r.returncode, r.stdout, r.stderr

    try:
        rc, out, err = cli("create", "nightly", "--cron", "0 3 * * *", "--timezone", "Europe/Berlin", "--json")
        assert rc == 0, err
        info = json.loads(out)
        assert info["name"] == "nightly" and info["cron"] == ["0 3 * * *"] and len(info["next_fires"]) == 5
        rc, out, err = cli("create", "bad", "--cron", "0 3 * *  * * *")
        assert rc != 0 and "VALIDATION_FAILED" in (out + err)
        rc, out, err = cli("trigger", "nightly")
        assert rc == 0 and "trigger" in out
        rc, out, err = cli("pause", "nightly", "--note", "freeze")
        assert rc == 0 and "PAUSED (freeze)" in out
        rc, out, err = cli("unpause", "nightly")
        assert rc == 0 and "active" in out
        rc, out, err = cli("ls")
        assert rc == 0 and "nightly" in out and "0 3 * * *" in out
        rc, out, err = cli("describe", "nightly", "--json")
        assert rc == 0 and json.loads(out)["actions"] == 1
        rc, out, err = cli("backfill", "nightly", "--start", "2026-01-01T00:00:00Z", "--end", "2026-01-03T00:00:00Z",
                           "--overlap", "allow_all", "--json")
        assert rc == 0, err
        assert json.loads(out)["actions"] == 3  # 1 and 2 Jan 03:00 Berlin, plus the trigger
        rc, out, err = cli("delete", "nightly")
        assert rc == 0
        rc, out, err = cli("describe", "nightly")
        assert rc != 0 and "NOT_FOUND" in (out + err)
    finally:
        d.kill()


def test_the_blocking_and_asyncio_clients_make_and_read_schedules(tmp_path):
    import asyncio

    d = Daemon(None, "memory").start()
    try:
        with rallypoint.sync.connect(d.url) as rs:  # the blocking client
            s = rs.schedules.create("sync-made", every=3600, overlap="allow_all")
            info = s.trigger()
            assert info.actions == 1 and info.recent[0].origin == "trigger"
            assert [x.name for x in rs.schedules.list()] == ["sync-made"]
            assert s.pause("by sync").paused

        async def under_asyncio():
            async with rallypoint.connect(d.url) as rs:
                s = await rs.schedules.get("sync-made")
                info = await s.describe()
                assert info.paused and info.note == "by sync" and info.actions == 1
                await s.unpause()
                return (await s.trigger()).actions

        assert asyncio.run(under_asyncio()) == 2
    finally:
        d.kill()
