"""Schedules through a failover of a replicated shard of real ``rallypoint serve
--cluster`` processes (tests/_cluster.py, a real etcd): the leader is killed -9 while a
1-second schedule fires; the standby takes over from the same journal and every
scheduled time from the first fire to the last is fired exactly once -- none twice,
none missing (the takeover is inside the catch-up window), no run without its record."""

from __future__ import annotations

import pytest
import trio

import rallypoint

from test_cluster_daemon import cluster_name, leader_pair, nodes, wait_isr  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(240)


async def _describe(rs):
    return await (await rs.schedules.get("tick")).describe(next_n=0, recent=100)


async def _wait_actions(rs, n: int, timeout: float = 60.0):
    with trio.fail_after(timeout):
        while True:
            try:
                d = await _describe(rs)
                if d.actions >= n:
                    return d
            except rallypoint.UnavailableError:
                pass
            await trio.sleep(0.1)


async def test_each_scheduled_time_fires_exactly_once_across_a_failover(nodes, etcd, cluster_name):
    a, b = await leader_pair(nodes, etcd, cluster_name)
    async with rallypoint.connect(f"tcp://{a.address},{b.address}") as rs:
        await rs.mailboxes.ensure("jobs")
        await rs.schedules.create("tick", every=1, mailbox="jobs", overlap="allow_all", catchup_window=60,
                                  run_name="tick {time}")
        d = await _wait_actions(rs, 3)
        a.kill()  # kill -9 of the leader in the second of a fire
        await b.wait_role("leader")
        d = await _wait_actions(rs, d.actions + 4)
        await (await rs.schedules.get("tick")).pause("check")
        d = await _describe(rs)
        times = sorted(x.scheduled_at for x in d.recent)
        assert len(times) == len(set(times)) == d.actions  # none twice
        assert {(y - x).total_seconds() for x, y in zip(times, times[1:])} == {1.0}  # none missing
        assert d.skipped == 0
        runs = [r for r in await rs.scopes.list(roots_only=True, limit=1000) if (r.name or "").startswith("tick ")]
        assert sorted(r.id for r in runs) == sorted(x.run_id for x in d.recent)  # no run without its record
