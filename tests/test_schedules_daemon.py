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
