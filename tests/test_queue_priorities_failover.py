"""Priorities and fair shares through a failover of a replicated shard of real
``rallypoint serve --cluster`` processes (tests/_cluster.py, a real etcd; issue 44): the
queues of :func:`test_queue_priorities.seed_scheduling` (weights 3:1 on the queue, aging,
a run's priority, a moved task, keys 1:1:1 with uneven backlogs, a burst key against
one-task keys) are set on the leader, the leader is killed -9, and the standby that
takes over from the replicated journal gives the same weights, priorities, backlogs and
order (:func:`test_queue_priorities.check_scheduling`)."""

from __future__ import annotations

import pytest

import rallypoint

from test_cluster_daemon import cluster_name, leader_pair, nodes  # noqa: F401 (fixtures)
from test_queue_priorities import check_scheduling, seed_scheduling

pytestmark = pytest.mark.timeout(240)


async def test_priorities_keys_weights_and_order_survive_a_failover(nodes, etcd, cluster_name):
    a, b = await leader_pair(nodes, etcd, cluster_name)
    async with rallypoint.connect(a.url, reconnect=False) as rs:
        ids = await seed_scheduling(rs)
    before = len(b.role_lines(b.starts))
    a.kill()  # kill -9 of the leader: every acknowledged op was replicated to b
    await b.wait_role("leader", after=before)
    async with rallypoint.connect(b.url, reconnect=False) as rs:
        await check_scheduling(rs, ids)
