"""A replicated shard of real ``rallypoint serve --cluster`` processes against a real etcd
(issue 29, "Done means"): kill -9 of the leader under load, SIGSTOP of the leader past
its lease, the replication link cut, kill -9 of the standby, the leader cut off from
etcd (split brain), a graceful SIGTERM hand-over, and the runstate SDK 0.3 ``serve()``
worker through a failover.

Each test runs two nodes (tests/_cluster.py: their own data dirs, fixed loopback ports)
in a cluster of its own on the module's etcd, and waits on conditions: READY and ROLE
lines, the ISR in etcd, task states; never a fixed sleep. Links are cut with
:class:`rallypoint.testing.proxy.Proxy` (one proxy class for every link: it runs in the
test's Trio loop, and its ``hold``/``blackhole``/``reset`` modes cover each partition).

What the checks mean:

- an *acknowledged* operation is one whose call returned to the client; the test keeps
  a log of them and finds every one on the node that leads at the end;
- *nothing done twice*: each task's handler runs once, except where the lease rules
  allow another run (its lease ran out, so the earlier run's completion was refused
  STALE_CLAIM: counted by ``consume`` as ``lost``); a task's delivery tokens only grow;
- journals *agree*: on every LSN both nodes hold, the same bytes
  (``rallypoint.persistence.journal.read_journal``).

``RALLYPOINT_SLOW=1`` runs the long forms (more kill cycles).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections import defaultdict

import pytest
import trio

import rallypoint
from rallypoint.cluster.etcd import EtcdClient
from rallypoint.cluster.leader import ShardElection
from rallypoint.persistence.journal import read_journal
from rallypoint.testing.proxy import Proxy

from _cluster import ClusterNode

pytestmark = pytest.mark.timeout(240)

SLOW = bool(os.environ.get("RALLYPOINT_SLOW"))


@pytest.fixture
def cluster_name():
    return f"d-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def nodes(etcd, tmp_path, cluster_name):
    """A factory of nodes of this test's cluster; every node is killed at the end."""
    made: list[ClusterNode] = []

    def make(name: str, **kw) -> ClusterNode:
        kw.setdefault("etcd", etcd.endpoints[0])
        n = ClusterNode(name, str(tmp_path), kw.pop("etcd"), cluster_name, **kw)
        made.append(n)
        return n

    yield make
    for n in made:
        if n.running():
            n.resume()  # a paused process cannot die of SIGKILL until it is reaped... it can; be sure
            n.kill()


async def replicas(etcd, cluster_name: str):
    async with EtcdClient(etcd.endpoints) as client:
        rec = await ShardElection(client, cluster_name, 0).read_replicas()
    return rec.replicas if rec is not None else None


async def wait_isr(etcd, cluster_name: str, isr: list[str], timeout: float = 60.0) -> None:
    """Wait until etcd's replicas key has exactly this in-sync set."""
    with trio.fail_after(timeout):
        while True:
            r = await replicas(etcd, cluster_name)
            if r is not None and sorted(r.isr) == sorted(isr):
                return
            await trio.sleep(0.02)


async def leader_pair(nodes, etcd, cluster_name, **kw) -> tuple[ClusterNode, ClusterNode]:
    """Node ``a`` leads (it starts first), node ``b`` is its in-sync standby."""
    a = nodes("a", **kw.get("a", {}))
    b = nodes("b", **kw.get("b", {}))
    a.start()
    await a.wait_ready()
    await a.wait_role("leader")
    b.start()
    await b.wait_ready()
    await b.wait_role("standby")
    await wait_isr(etcd, cluster_name, ["a", "b"])
    return a, b


def journals_agree(x: ClusterNode, y: ClusterNode) -> tuple[int, int, int]:
    """Assert both journals hold the same bytes at every LSN both hold; returns
    ``(common LSNs, x's last LSN, y's last LSN)``."""
    jx, jy = dict(read_journal(x.data_dir)), dict(read_journal(y.data_dir))
    common = set(jx) & set(jy)
    bad = [lsn for lsn in sorted(common) if bytes(jx[lsn]) != bytes(jy[lsn])]
    assert not bad, f"journals differ at LSNs {bad[:10]} (of {len(common)} common)"
    return len(common), max(jx, default=0), max(jy, default=0)


class Load:
    """Producers submitting keyed tasks and ``consume()`` workers, through one client
    that follows the leader; a log of every acknowledged submission, and per task the
    handler runs and the (attempt, token) of each delivery a handler saw."""

    def __init__(self, rs, mailbox, run, *, producers: int = 2, lease_seconds: float = 10) -> None:
        self.rs = rs
        self.mailbox = mailbox
        self.run = run
        self.producers = producers
        self.lease_seconds = lease_seconds
        self.acked: dict[str, tuple[str, int]] = {}  # key -> (task id, input)
        self.ack_times: list[tuple[float, int]] = []  # (monotonic s, epoch of the connection)
        self.runs: dict[str, int] = defaultdict(int)
        self.deliveries: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.errors: list[BaseException] = []
        self.stats = None
        self.stop = trio.Event()

    def epoch(self) -> int:
        return self.rs._transport.server_info.epoch

    async def producer(self, p: int) -> None:
        n = 0
        while not self.stop.is_set():
            key = f"p{p}-{n}"
            try:
                t = await self.mailbox.submit({"key": key, "n": n}, key=key, scope=self.run)
            except rallypoint.RallypointError as e:  # not acknowledged: not in the log
                self.errors.append(e)
                await trio.sleep(0.05)
                continue
            self.acked[key] = (t.id, n)
            self.ack_times.append((time.monotonic(), self.epoch()))
            n += 1

    async def handler(self, d):
        key = d.input["key"]
        self.runs[key] += 1
        self.deliveries[key].append((d.attempt, d.token))
        return {"done": key}

    async def worker(self) -> None:
        self.stats = await rallypoint.consume(self.rs, self.mailbox, self.run, self.handler, concurrency=4,
                                              lease_seconds=self.lease_seconds, wait=5)

    async def wait_acked(self, n: int, *, epoch_above: int = 0, timeout: float = 60.0) -> None:
        """Wait until ``n`` more submissions are acknowledged (by a leader of an epoch
        above ``epoch_above``)."""
        have = sum(1 for _t, e in self.ack_times if e > epoch_above)
        with trio.fail_after(timeout):
            while sum(1 for _t, e in self.ack_times if e > epoch_above) < have + n:
                await trio.sleep(0.01)

    async def finish(self, timeout: float = 90.0) -> list:
        """(Producers stopped.) Wait for every acknowledged task's result, end the run
        (the workers stop), then check: every acknowledged task ended SUCCEEDED with its
        own outcome, handled once (or again only after its lease ran out); tokens only
        grow. Returns the TaskInfos, in key order."""
        keys = sorted(self.acked)
        with trio.fail_after(timeout):
            infos = await self.rs.results([self.acked[k][0] for k in keys])
            await self.run.cancel()
            while self.stats is None:
                await trio.sleep(0.01)
        assert self.stats.completed + self.stats.lost >= len(keys), self.stats
        bad = [(k, i.state, i.outcome) for k, i in zip(keys, infos)
               if (i.state, i.outcome) != ("SUCCEEDED", {"done": k})]
        assert not bad, f"{len(bad)} acknowledged tasks not done right: {bad[:5]}"
        twice = {k: v for k, v in self.runs.items() if v > 1}
        lost = self.stats.lost
        # a second run is allowed only when the first one's lease ran out (its
        # completion refused STALE_CLAIM: consume counts it as lost)
        assert len(twice) <= lost, f"handled more than once: {twice} (leases lost: {lost})"
        for k, ds in self.deliveries.items():
            tokens = [tok for _a, tok in ds]
            assert tokens == sorted(set(tokens)), f"{k}: delivery tokens went backwards or repeated: {ds}"
        for k, i in zip(keys, infos):
            if k in self.deliveries:
                assert i.attempt >= len(self.deliveries[k]), (k, i.attempt, self.deliveries[k])
        return infos


# ============================================================================ 1. kill -9 of the leader
async def _kill_leader_under_load(nodes, etcd, cluster_name, cycles: int) -> None:
    a, b = await leader_pair(nodes, etcd, cluster_name)
    url = f"tcp://{a.address},{b.address}"
    async with rallypoint.connect(url, reconnect=rallypoint.Reconnect(timeout=60)) as rs:
        jobs = await rs.mailboxes.ensure("jobs")
        run = await rs.scopes.create(name="under-load")
        load = Load(rs, jobs, run)
        async with trio.open_nursery() as n:
            for p in range(load.producers):
                n.start_soon(load.producer, p)
            n.start_soon(load.worker)
            leader, standby = a, b
            for cycle in range(cycles):
                await load.wait_acked(20)
                old_epoch = load.epoch()
                before = len(standby.role_lines(standby.starts))
                leader.kill()
                took = await standby.wait_role("leader", after=before)
                assert took.epoch > old_epoch
                # writes go on, acknowledged by the new leader's epoch
                await load.wait_acked(20, epoch_above=old_epoch)
                assert load.epoch() == took.epoch
                if cycle + 1 < cycles:
                    # the killed node comes back as a standby (truncating what it wrote
                    # that no one acknowledged) and catches up into the ISR
                    leader.start()
                    await leader.wait_ready()
                    await leader.wait_role("standby")
                    await wait_isr(etcd, cluster_name, ["a", "b"])
                    leader, standby = standby, leader
            load.stop.set()
            await load.finish()
        assert rs._transport.reconnects >= cycles
    # every acknowledged op is on the node that leads now, seen through its own port
    async with rallypoint.connect(standby.url, reconnect=False) as direct:
        keys = sorted(load.acked)
        infos = await direct.results([load.acked[k][0] for k in keys])
        assert all(i.state == "SUCCEEDED" for i in infos)
    assert not [e for e in load.errors if not isinstance(e, rallypoint.UnavailableError)], load.errors[:3]


async def test_kill_9_of_the_leader_under_load_loses_no_acknowledged_op(nodes, etcd, cluster_name):
    await _kill_leader_under_load(nodes, etcd, cluster_name, cycles=1)


@pytest.mark.slow
@pytest.mark.skipif(not SLOW, reason="long form: set RALLYPOINT_SLOW=1")
async def test_kill_9_of_the_leader_again_and_again(nodes, etcd, cluster_name):
    await _kill_leader_under_load(nodes, etcd, cluster_name, cycles=8)
