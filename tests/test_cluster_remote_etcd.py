"""A run on shard 1 uses a pool of its space's home shard 0, against a real etcd: 3
shards, the home shard (0, two nodes) and shard 2 as in-process members, shard 1 as two real
``rallypoint serve --cluster --shard 1`` processes (so its leader can be killed -9).

What each test shows: the SDK sends the acquire to the home shard, which links the run
(``run.link`` on shard 1, a remote run on shard 0) over connections authenticated by
the cluster's node secret; the run's cancellation on shard 1 answers its waiter
parked on shard 0 (the outbox), and the units go to the next in line once the grant of
the ended run is released (renewal refused, as on one node); and the same when shard
1's leader is killed -9 after the cancellation was acknowledged and before its
outbox entry reached shard 0: the standby, now leader, delivers it; and the same when
home shard 0's leader hands over to its standby in that window (the receiver's side);
tasks of shard 1 needing the home shard's units: reserved there, then delivered."""

from __future__ import annotations

import uuid

import pytest
import trio

import rallypoint
from rallypoint.actors.sharding import home_slot
from rallypoint.cluster.etcd import EtcdClient
from rallypoint.nodeconfig import StorageOptions
from rallypoint.cluster.member import MemberConfig, ShardMember
from rallypoint.cluster.shardmap import init_cluster
from rallypoint.errors import ScopeCancelledError, UnavailableError
from rallypoint.ids import slot_of
from rallypoint.transport.server import Server

from _cluster import ClusterNode

pytestmark = pytest.mark.timeout(300)

SLOTS = 40  # the space "default" has its home slot on shard 0 (slot i is shard i mod 3)


def test_the_home_shard_of_the_default_space_is_0():
    assert home_slot("default", SLOTS) % 3 == 0


def member(etcd, tmp_path, name, cluster, shard):
    cfg = MemberConfig(etcd=etcd.endpoints, node=name, data_dir=str(tmp_path / name), cluster=cluster, shard=shard,
                       client=("127.0.0.1", 0), replication=("127.0.0.1", 0), isr_timeout_s=0.5,
                       storage=StorageOptions(sync_helper="thread"))
    return ShardMember(cfg, make_server=lambda d: Server(d))


async def wait_until(pred, timeout=120.0, what=""):
    try:
        with trio.fail_after(timeout):
            while not pred():
                await trio.sleep(0.01)
    except trio.TooSlowError:
        raise AssertionError(f"not within {timeout} s: {what}") from None


class Cluster:
    def __init__(self, etcd, tmp_path, name):
        self.etcd = etcd
        self.tmp_path = tmp_path
        self.name = name
        self.members: dict[int, list[ShardMember]] = {}
        self.procs: list[ClusterNode] = []

    async def start(self, nursery):
        async with EtcdClient(self.etcd.endpoints) as client:
            await init_cluster(client, self.name, slots=SLOTS, shards=3)
        for s, names in ((0, ("n0a", "n0b")), (2, ("n2",))):
            for name in names:
                m = member(self.etcd, self.tmp_path, name, self.name, s)
                await nursery.start(m.run)
                self.members.setdefault(s, []).append(m)
        for x in "ab":
            n = ClusterNode(f"n1{x}", str(self.tmp_path), self.etcd.endpoints[0], self.name,
                            extra=["--shard", "1", "--sync-helper", "thread"])
            self.procs.append(n)
            n.start()
            await n.wait_ready()
            if x == "a":
                await n.wait_role("leader")
        await self.procs[1].wait_role("standby")
        def ready():
            home, other = self.leader(0), self.leader(2)
            return (home is not None and other is not None and len(home.leaders) == 3
                    and home.replication is not None and len(home.replication.isr_store.isr) == 2)

        await wait_until(ready, what="three leaders, home shard 0 with its standby in sync")

    def kill_all(self):
        for n in self.procs:
            n.kill()

    def leader(self, shard):
        return next((m for m in self.members[shard] if m.role == "leader"), None)

    @property
    def urls(self):
        return "tcp://" + ",".join([f"127.0.0.1:{m.client_port}" for ms in self.members.values() for m in ms]
                                   + [n.address for n in self.procs])

    def home(self):
        return self.leader(0).node

    def shard_of(self, entity_id):
        return self.members[0][0].slotmap.owners[slot_of(entity_id)]


@pytest.fixture
async def cluster(etcd, tmp_path):
    c = Cluster(etcd, tmp_path, f"r-{uuid.uuid4().hex[:10]}")
    try:
        yield c
    finally:
        c.kill_all()


async def runs_on(rs, cluster, shard, n):
    out = []
    while len(out) < n:
        r = await rs.scopes.create()
        if cluster.shard_of(r.id) == shard:
            out.append(r)
    return out


async def scenario(cluster, nursery, *, kill: str | None) -> int:
    """``kill``: None, ``"run"`` (kill -9 of shard 1's leader) or ``"home"`` (home
    shard 0's leader hands over to its standby), while the run's end is undelivered.
    Returns how many of shard 1's outbox entries the home shard applied."""
    await cluster.start(nursery)
    async with rallypoint.connect(cluster.urls) as rs:
        pool = await rs.pools.ensure("gpu", 1)
        holder, doomed = await runs_on(rs, cluster, 1, 2)
        (local,) = await runs_on(rs, cluster, 0, 1)
        grant = await pool.acquire(scope=holder, lease_seconds=60)  # the home shard links the run
        assert cluster.home().coordinator.runs.table[holder.id].remote_shard == 1
        answers: dict[str, object] = {}

        async def acquire(name, run):
            try:
                answers[name] = await pool.acquire(scope=run, wait=120, lease_seconds=60)
            except Exception as e:  # noqa: BLE001 (the answer is the test's)
                answers[name] = e

        nursery.start_soon(acquire, "doomed", doomed)
        def line():
            home = cluster.home().coordinator
            return [w.scope_id for w in home.pools.line(home.pools.get("default", "gpu"))]

        await wait_until(lambda: line() == [doomed.id], what=f"the doomed run's waiter ({line()})")
        nursery.start_soon(acquire, "local", local)
        await wait_until(lambda: line() == [doomed.id, local.id], what=f"the local waiter ({line()})")

        held = []
        if kill:  # the home shard refuses deliveries until one side's leader is gone
            old_home = cluster.leader(0)
            service = cluster.home().service
            submit = service.submit

            def holding(session, body, sink, rid):
                if session.node and b"outbox.deliver" in bytes(body):
                    held.append(rid)
                    sink.deliver(rid, UnavailableError("held by the test"), 0)
                    return
                submit(session, body, sink, rid)

            service.submit = holding
        await doomed.cancel()  # acknowledged by shard 1: journaled and in its standby
        if kill:
            await wait_until(lambda: len(held) >= 2, what="a delivery tried and held")
            assert "doomed" not in answers and line() == [doomed.id, local.id]
            if kill == "run":
                old, standby = cluster.procs
                old.kill()  # kill -9 of shard 1's leader, its outbox entry undelivered
                await standby.wait_role("leader", timeout=60)
                service.submit = submit  # the home shard takes deliveries again: from the new leader
            else:
                old_home.stop()  # the home shard's leader hands over; its standby has the remote runs
                await wait_until(lambda: cluster.leader(0) not in (None, old_home), what="a new home leader")
        await wait_until(lambda: "doomed" in answers, what="the doomed waiter's answer")
        assert isinstance(answers["doomed"], ScopeCancelledError), answers["doomed"]
        assert line() == [local.id]
        await holder.cancel()  # (on the new leader after the kill: the link survived it)
        home = cluster.home().coordinator
        await wait_until(lambda: home.runs.table[holder.id].state == "CANCELLED", what="the holder's end")
        with pytest.raises(ScopeCancelledError):
            await grant.renew()  # as on one node: an ended run's grant is not renewed
        await grant.release()
        await wait_until(lambda: "local" in answers, what="the local waiter's grant")
        assert not isinstance(answers["local"], Exception), answers["local"]
        assert (await pool.status()).units_used == 1  # the local run's unit, the rest released
        # every outbox entry of shard 1 reached shard 0, applied once each
        assert home.outbox.received(1) == 2
        return home.outbox.received(1)


async def test_a_run_of_shard_1_cancelled_answers_its_pool_waiter_on_home_shard_0(cluster, nursery):
    assert await scenario(cluster, nursery, kill=None) == 2  # each entry of shard 1's outbox applied once
    nursery.cancel_scope.cancel()


async def test_the_same_across_a_kill_9_of_shard_1s_leader_before_its_outbox_was_delivered(cluster, nursery):
    assert await scenario(cluster, nursery, kill="run") == 2  # each entry of shard 1's outbox applied once
    nursery.cancel_scope.cancel()


async def test_the_same_across_a_handover_of_home_shard_0s_leader_before_the_outbox_reached_it(cluster, nursery):
    assert await scenario(cluster, nursery, kill="home") == 2  # each entry of shard 1's outbox applied once
    nursery.cancel_scope.cancel()


async def test_a_task_of_shard_1_needing_units_of_home_shard_0_is_reserved_there_then_delivered(cluster, nursery):
    await cluster.start(nursery)
    async with rallypoint.connect(cluster.urls) as rs:
        pool = await rs.pools.ensure("gpu", 1)
        jobs = await rs.mailboxes.ensure("jobs")
        (run,) = await runs_on(rs, cluster, 1, 1)
        first = await jobs.submit({"i": 1}, scope=run, requirements={"pools": {"gpu": 1}})
        second = await jobs.submit({"i": 2}, scope=run, requirements={"pools": {"gpu": 1}})
        d1 = await jobs.receive(scope=run, lease_seconds=30, wait=20)
        assert d1 is not None and d1.task_id == first.id and [g.units for g in d1.grants] == [1]
        assert (await pool.status()).units_used == 1  # the grant is the home shard's
        assert await jobs.receive(scope=run, lease_seconds=30, wait=0.5) is None  # no units for the second
        await d1.complete({"ok": 1})  # its end reaches shard 0 through shard 1's outbox: the unit goes back
        d2 = await jobs.receive(scope=run, lease_seconds=30, wait=20)
        assert d2 is not None and d2.task_id == second.id
        await d2.complete({"ok": 2})
        home = cluster.home().coordinator
        await wait_until(lambda: home.pools.view(home.pools.get("default", "gpu")).units_used == 0,
                         what="the second delivery's unit back")
    nursery.cancel_scope.cancel()
