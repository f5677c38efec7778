"""The misconfigurations a cluster refuses (issue 40, "Refuse the misconfigurations"):

- ``cluster init`` over a cluster or shard of the same name (running, stopped, sharded),
  and what ``--force`` does with a stopped one (deletes it, and a node on the deleted
  cluster's data dir is refused before it joins);
- a node that is not a member of its shard's configured replica set (``replicas``
  key: ``replication_factor`` and ``members``, filled first come first served), at
  start and on the leader's replication port; ``cluster remove-node`` making room;
- a second live process under a node's name (its presence key), while a restart right
  after ``kill -9`` still starts (the old key's lease lapses first).

Lease timing (the presence key's wait, its lapse while cut off from etcd) runs on the
in-memory etcd under Trio's MockClock; the rest on a real etcd, with in-process
:class:`ShardMember` nodes or real ``rallypoint serve --cluster`` processes.
"""

from __future__ import annotations

import os
import sys
import uuid

import msgspec
import pytest
import trio
import trio.testing

from rallypoint.cluster.etcd import Compare, EtcdClient, Put
from rallypoint.cluster.leader import NotAMemberError, Replicas, ShardElection
from rallypoint.nodeconfig import StorageOptions
from rallypoint.cluster.member import MemberConfig, ShardMember, StaleDataError
from rallypoint.cluster.presence import DuplicateNodeError, NodeInstance, NodePresence, presence_key
from rallypoint.cluster.shardmap import ClusterExistsError, create_cluster, inventory, read_config
from rallypoint.errors import ConflictError, NotFoundError, ValidationError
from rallypoint.replication import Link, wire
from rallypoint.testing.fake_etcd import FakeEtcd, FakeEtcdClient
from rallypoint.transport.server import Server

from _cluster import ClusterNode

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def cluster_name():
    return f"m-{uuid.uuid4().hex[:10]}"


def member(etcd, tmp_path, name, cluster, *, data_dir=None, **kw) -> ShardMember:
    cfg = MemberConfig(etcd=etcd.endpoints, node=name, data_dir=str(data_dir or tmp_path / name), cluster=cluster,
                       client=("127.0.0.1", 0), replication=("127.0.0.1", 0), isr_timeout_s=0.5,
                       storage=StorageOptions(sync_helper="thread"), **kw)
    return ShardMember(cfg, make_server=lambda d: Server(d))


async def wait_until(pred, timeout=30.0):
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.01)


async def rallypoint_cli(*args: str) -> tuple[int, str, str]:
    """``python -m rallypoint ARGS`` -> (exit code, stdout, stderr)."""
    p = await trio.run_process([sys.executable, "-m", "rallypoint", *args], capture_stdout=True,
                               capture_stderr=True, check=False)
    return p.returncode, p.stdout.decode(), p.stderr.decode()


def errors_of(stderr: str) -> list[str]:
    """The ``rallypoint: ...`` lines (the log lines of the daemon left out)."""
    return [line for line in stderr.splitlines() if line.startswith("rallypoint: ")]


async def two_nodes(nursery, etcd, tmp_path, cluster_name, **kw) -> tuple[ShardMember, ShardMember]:
    """``a`` leads, ``b`` is its in-sync standby."""
    a = member(etcd, tmp_path, "a", cluster_name, **kw)
    await nursery.start(a.run)
    await a.wait_role("leader")
    b = member(etcd, tmp_path, "b", cluster_name, **kw)
    await nursery.start(b.run)
    await wait_until(lambda: a.replication is not None and a.replication.isr_store.isr == ["a", "b"])
    return a, b


# ============================================================ presence (in-memory etcd, MockClock)
async def _fake(nursery) -> FakeEtcd:
    store = FakeEtcd()
    await nursery.start(store.run)
    return store


async def test_a_presence_claim_waits_out_the_lease_of_a_killed_holder_then_holds_the_name(autojump_clock):
    async with trio.open_nursery() as n:
        store = await _fake(n)
        old_client = FakeEtcdClient(store)
        old = NodePresence(old_client, "c", 0, "a", ttl_s=2)
        await old.claim()
        n.start_soon(old.keep)
        await trio.sleep(5)  # renewed all along
        old_client.kill()  # kill -9: no revoke, no more renewals
        killed_at = trio.current_time()
        new = NodePresence(FakeEtcdClient(store), "c", 0, "a", ttl_s=2)
        await new.claim()
        waited = trio.current_time() - killed_at
        assert 0 < waited <= 2 + new.margin_s  # the old lease lapsed: at most its TTL after its last renewal
        kv = store.kv[presence_key("c", 0, "a").encode()]
        assert msgspec.json.decode(kv.value, type=NodeInstance).instance == new.me.instance
        assert kv.lease == new.lease_id
        n.cancel_scope.cancel()


async def test_a_presence_claim_is_refused_while_the_holder_renews_its_lease(autojump_clock):
    async with trio.open_nursery() as n:
        store = await _fake(n)
        live = NodePresence(FakeEtcdClient(store), "c", 0, "a", ttl_s=2)
        await live.claim()
        n.start_soon(live.keep)
        dup = NodePresence(FakeEtcdClient(store), "c", 0, "a", ttl_s=2)
        t0 = trio.current_time()
        with pytest.raises(DuplicateNodeError) as e:
            await dup.claim()
        assert trio.current_time() - t0 == pytest.approx(2 + dup.margin_s)  # TTL + margin, no longer
        assert e.value.code == "CONFLICT"
        assert f"pid {os.getpid()}" in e.value.message and "already running" in e.value.message
        assert msgspec.json.decode(store.kv[live.key.encode()].value, type=NodeInstance).instance == live.me.instance
        n.cancel_scope.cancel()


async def test_a_released_presence_key_goes_at_once_so_a_restart_need_not_wait(autojump_clock):
    async with trio.open_nursery() as n:
        store = await _fake(n)
        first = NodePresence(FakeEtcdClient(store), "c", 0, "a", ttl_s=2)
        await first.claim()
        await first.release()  # a graceful stop revokes the lease
        assert first.key.encode() not in store.kv
        t0 = trio.current_time()
        await NodePresence(FakeEtcdClient(store), "c", 0, "a", ttl_s=2).claim()
        assert trio.current_time() == t0
        n.cancel_scope.cancel()


async def test_a_node_cut_off_from_etcd_past_its_presence_ttl_claims_its_name_again(autojump_clock):
    async with trio.open_nursery() as n:
        store = await _fake(n)
        client = FakeEtcdClient(store)
        p = NodePresence(client, "c", 0, "a", ttl_s=2)
        await p.claim()
        n.start_soon(p.keep)
        client.cut()
        await trio.sleep(5)
        assert p.key.encode() not in store.kv  # the lease lapsed at etcd
        client.heal()
        await wait_until(lambda: p.key.encode() in store.kv)
        assert p.claims == 2
        assert msgspec.json.decode(store.kv[p.key.encode()].value, type=NodeInstance).instance == p.me.instance
        n.cancel_scope.cancel()


async def test_a_node_whose_name_was_taken_while_it_was_cut_off_stops_with_duplicate_node_error(autojump_clock):
    async with trio.open_nursery() as n:
        store = await _fake(n)
        client = FakeEtcdClient(store)
        p = NodePresence(client, "c", 0, "a", ttl_s=2)
        await p.claim()
        client.cut()
        other = NodePresence(FakeEtcdClient(store), "c", 0, "a", ttl_s=2)
        await other.claim()  # after the first one's lease lapsed
        n.start_soon(other.keep)
        client.heal()
        with pytest.raises(DuplicateNodeError) as e:
            await p.keep()
        assert "cut off from etcd" in e.value.message
        n.cancel_scope.cancel()


# ============================================================ the replica set (in-memory etcd)
async def test_members_fill_first_come_first_served_then_a_third_node_is_refused_naming_them(autojump_clock):
    async with trio.open_nursery() as n:
        store = await _fake(n)
        election = ShardElection(FakeEtcdClient(store), "c", 0)
        first = await election.join("a")
        assert first.replicas == Replicas(members=["a"], isr=["a"], replication_factor=2)
        second = await election.join("b")
        assert second.replicas == Replicas(members=["a", "b"], isr=["a"], replication_factor=2)  # not in sync yet
        assert (await election.join("a")).replicas.members == ["a", "b"]  # a member again: nothing changes
        with pytest.raises(NotAMemberError) as e:
            await election.join("c")
        assert e.value.code == "CONFLICT"
        assert "its 2 node(s) are a, b" in e.value.message
        assert e.value.details["members"] == ["a", "b"]
        assert (await election.read_replicas()).replicas.members == ["a", "b"]
        n.cancel_scope.cancel()


async def test_two_nodes_racing_for_the_last_place_one_joins_the_other_is_refused(autojump_clock):
    async with trio.open_nursery() as n:
        store = await _fake(n)
        await ShardElection(FakeEtcdClient(store), "c", 0).join("a")
        outcomes: dict[str, str] = {}

        async def join(name):
            try:
                await ShardElection(FakeEtcdClient(store), "c", 0).join(name)
                outcomes[name] = "joined"
            except NotAMemberError:
                outcomes[name] = "refused"

        async with trio.open_nursery() as race:
            race.start_soon(join, "b")
            race.start_soon(join, "x")
        assert sorted(outcomes.values()) == ["joined", "refused"]
        winner = next(k for k, v in outcomes.items() if v == "joined")
        assert (await ShardElection(FakeEtcdClient(store), "c", 0).read_replicas()).replicas.members == \
            sorted(["a", winner])
        n.cancel_scope.cancel()


async def test_replicas_1_makes_a_one_node_shard_and_a_differing_replicas_flag_is_refused(autojump_clock):
    async with trio.open_nursery() as n:
        store = await _fake(n)
        election = ShardElection(FakeEtcdClient(store), "c", 0)
        assert (await election.join("a", replication_factor=1)).replicas.replication_factor == 1
        with pytest.raises(NotAMemberError):
            await election.join("b")
        with pytest.raises(ValidationError, match="has 1 node"):
            await election.join("a", replication_factor=2)
        with pytest.raises(ValidationError, match="must be 1 or 2"):
            await ShardElection(FakeEtcdClient(store), "c", 1).join("a", replication_factor=3)
        n.cancel_scope.cancel()


async def test_an_in_sync_set_update_keeps_the_members_etcd_holds(autojump_clock):
    # members are etcd's: a leader's in-sync set write never adds or drops one
    from rallypoint.cluster.leader import LeaderInfo

    async with trio.open_nursery() as n:
        store = await _fake(n)
        election = ShardElection(FakeEtcdClient(store), "c", 0)
        await election.join("a")
        async with election.campaign(LeaderInfo("a", "h:1", "h:2")) as lead:
            await ShardElection(FakeEtcdClient(store), "c", 0).join("b")  # joins while a leads
            rec = await lead.update_isr(["a"])
            assert rec.replicas.members == ["a", "b"]
            with pytest.raises(ValidationError):
                await lead.update_isr(["a", "z"])  # not a member
        n.cancel_scope.cancel()


async def test_a_leader_asked_to_put_a_removed_member_in_sync_ends_that_session_and_stays_leader(autojump_clock):
    from rallypoint.cluster.leader import LeaderInfo
    from rallypoint.cluster.member import EtcdIsr
    from rallypoint.replication import LinkClosed

    async with trio.open_nursery() as n:
        store = await _fake(n)
        election = ShardElection(FakeEtcdClient(store), "c", 0)
        await election.join("a")
        await election.join("b")
        async with election.campaign(LeaderInfo("a", "h:1", "h:2")) as lead:
            isr = EtcdIsr(lead, ["a", "b"], ["a"])  # b linked and catching up...
            await ShardElection(FakeEtcdClient(store), "c", 0).remove_member("b")  # ...when it is removed
            with pytest.raises(LinkClosed, match="not written"):
                await isr.set_isr(["a", "b"])
            assert lead.is_leader_now()
            assert (await election.read_replicas()).replicas == Replicas(members=["a"], isr=["a"])
            assert await isr.set_isr(["a"])
        n.cancel_scope.cancel()


@pytest.mark.parametrize("where", ["fake", "real"])
async def test_a_compare_over_a_range_holds_only_if_every_key_of_it_holds(where, request):
    async def check(client, root):
        r = await client.txn([], [Put(root + "x", "1"), Put(root + "y", "2")])
        rev = r.revision
        assert (await client.txn([Compare.mod_revision(root, "<", rev + 1, prefix=True)])).succeeded
        assert not (await client.txn([Compare.mod_revision(root, "<", rev, prefix=True)])).succeeded
        await client.put(root + "y", "3")  # one key written later: the range compare fails
        assert not (await client.txn([Compare.mod_revision(root, "<", rev + 1, prefix=True)])).succeeded
        # a range with no key is judged as one missing key (revision 0)
        assert (await client.txn([Compare.create_revision(root + "none/", "==", 0, prefix=True)])).succeeded

    root = f"/t-{uuid.uuid4().hex[:8]}/"
    if where == "fake":
        await check(FakeEtcdClient(FakeEtcd()), root)
    else:
        etcd = request.getfixturevalue("etcd")
        async with EtcdClient(etcd.endpoints) as client:
            await check(client, root)


# ============================================================ cluster init (real etcd)
async def test_cluster_init_over_a_running_two_node_shard_is_refused_saying_what_runs_even_with_force(
        etcd, tmp_path, cluster_name):
    async with trio.open_nursery() as n:
        a, b = await two_nodes(n, etcd, tmp_path, cluster_name)
        for force in ([], ["--force"]):
            rc, out, err = await rallypoint_cli("cluster", "init", "--cluster", etcd.endpoints[0],
                                                "--cluster-name", cluster_name, *force)
            assert rc == 1, (out, err)
            [line] = errors_of(err)
            assert "CONFLICT" in line and f"a replicated shard named {cluster_name!r}" in line
            assert f"shard 0: members a, b (2 of 2), in sync a, b, leader a at epoch {a.epoch}, running a, b" in line
            assert ("Refused even with --force: shard(s) 0 are running" in line) == bool(force)
        async with EtcdClient(etcd.endpoints) as client:
            assert await read_config(client, cluster_name) is None  # nothing written
        assert a.role == "leader" and a.replication.isr_store.isr == ["a", "b"]
        n.cancel_scope.cancel()


async def test_cluster_init_over_a_stopped_shard_is_refused_and_force_replaces_it_cleanly(
        etcd, tmp_path, cluster_name):
    async with trio.open_nursery() as n:
        a, b = await two_nodes(n, etcd, tmp_path, cluster_name)
        old_epoch = a.epoch
        a.stop()
        await a.wait_role("stopped")
        await b.wait_role("leader")
        b.stop()
        await b.wait_role("stopped")
    async with EtcdClient(etcd.endpoints) as client:
        inv = await inventory(client, cluster_name)
    assert not inv.running and [s.members for s in inv.shards] == [["a", "b"]]

    rc, out, err = await rallypoint_cli("cluster", "init", "--cluster", etcd.endpoints[0], "--cluster-name",
                                        cluster_name, "--slots", "64", "--shards", "2")
    assert rc == 1
    [line] = errors_of(err)
    assert "shard 0: members a, b (2 of 2)" in line and "no leader, stopped" in line and "add --force" in line

    rc, out, err = await rallypoint_cli("cluster", "init", "--cluster", etcd.endpoints[0], "--cluster-name",
                                        cluster_name, "--slots", "64", "--shards", "2", "--force")
    assert rc == 0, err
    assert "cluster init --force: deleted a replicated shard" in out and "shard 0: members a, b" in out
    assert "64 slots over 2 shard(s) of 2 node(s)" in out
    async with EtcdClient(etcd.endpoints) as client:
        inv = await inventory(client, cluster_name)
        assert inv.config.slots == 64 and inv.shards == []  # the old shard's keys are gone
        reinit = (await client.get(f"/rallypoint/{cluster_name}/reinit")).mod_revision
        assert reinit > old_epoch

    # a node on a data dir of the deleted cluster is refused, and leaves no trace in etcd
    stale = member(etcd, tmp_path, "a", cluster_name)
    with pytest.raises(StaleDataError) as e:
        await stale.run()
    assert f"its newest epoch, {b.epoch}," in e.value.message or f"its newest epoch, {old_epoch}," in e.value.message
    assert "empty data dir" in e.value.message
    async with EtcdClient(etcd.endpoints) as client:
        assert (await inventory(client, cluster_name)).shards == []

    # the new cluster's nodes, on empty data dirs, lead and follow (nothing hangs)
    async with trio.open_nursery() as n:
        fresh = tmp_path / "new"
        x = member(etcd, tmp_path, "x", cluster_name, data_dir=fresh / "x")
        y = member(etcd, tmp_path, "y", cluster_name, data_dir=fresh / "y")
        await n.start(x.run)
        await x.wait_role("leader")
        await n.start(y.run)
        await wait_until(lambda: x.replication is not None and x.replication.isr_store.isr == ["x", "y"])
        assert x.epoch > reinit
        n.cancel_scope.cancel()


async def test_cluster_init_over_an_existing_sharded_cluster_is_refused(etcd, cluster_name):
    endpoint = etcd.endpoints[0]
    rc, _out, err = await rallypoint_cli("cluster", "init", "--cluster", endpoint, "--cluster-name", cluster_name,
                                         "--slots", "64", "--shards", "3")
    assert rc == 0, err
    rc, _out, err = await rallypoint_cli("cluster", "init", "--cluster", endpoint, "--cluster-name", cluster_name,
                                         "--slots", "16", "--shards", "1")
    assert rc == 1
    [line] = errors_of(err)
    assert f"cluster {cluster_name!r} (64 slots over 3 shard(s) of 2 node(s)); no shard has started yet" in line
    async with EtcdClient(etcd.endpoints) as client:
        assert (await read_config(client, cluster_name)).slots == 64  # untouched
        with pytest.raises(ClusterExistsError):
            await create_cluster(client, cluster_name, slots=16)


async def test_cluster_init_replicas_1_gives_every_shard_one_node(etcd, tmp_path, cluster_name):
    async with EtcdClient(etcd.endpoints) as client:
        await create_cluster(client, cluster_name, slots=8, shards=1, replication_factor=1)
    async with trio.open_nursery() as n:
        a = member(etcd, tmp_path, "a", cluster_name)
        await n.start(a.run)
        await a.wait_role("leader")
        assert a.replica_set.replicas.replication_factor == 1
        with pytest.raises(NotAMemberError, match="its 1 node"):
            await member(etcd, tmp_path, "b", cluster_name).run()
        assert not (tmp_path / "b").exists()
        n.cancel_scope.cancel()


# ============================================================ a node that is not a member
async def test_a_third_node_is_refused_at_start_naming_the_members_before_it_opens_its_data_dir(
        etcd, tmp_path, cluster_name):
    async with trio.open_nursery() as n:
        a, b = await two_nodes(n, etcd, tmp_path, cluster_name)
        rc, _out, err = await rallypoint_cli(
            "serve", "--cluster", etcd.endpoints[0], "--cluster-name", cluster_name, "--node", "c",
            "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--data-dir", str(tmp_path / "c"))
        assert rc == 2
        [line] = errors_of(err)
        assert line == (f"rallypoint: node 'c' is not a member of shard 0 of cluster {cluster_name!r}: its 2 node(s) "
                        "are a, b (the set in etcd is full); start one of them, or remove a dead member with "
                        "`rallypoint cluster remove-node --shard 0 NAME` first")
        assert not (tmp_path / "c").exists()
        assert a.replication.isr_store.isr == ["a", "b"] and a.replication.peer.node == "b"
        n.cancel_scope.cancel()


async def test_the_leaders_replication_port_refuses_a_standby_that_is_not_a_member(etcd, tmp_path, cluster_name):
    async with trio.open_nursery() as n:
        a, b = await two_nodes(n, etcd, tmp_path, cluster_name)
        sessions = a.replication.stats["sessions"]
        # a peer with the cluster secret (it authenticates) but not a member
        from rallypoint.replication.auth import LinkAuth

        auth = LinkAuth(a.secret, cluster=cluster_name, shard=0)
        link = await auth.connect(await trio.open_tcp_stream("127.0.0.1", a.replication_port), wire.Hello(
            version=wire.LINK_VERSION, cluster=cluster_name, shard=0, node="c", last_lsn=0, last_epoch=0,
            snapshot_lsn=0), leader="a", epoch=a.epoch)
        answer = await link.receive()
        await link.aclose()
        assert isinstance(answer, wire.Refuse)
        assert answer.message == f"node 'c' is not a member of shard 0 of cluster {cluster_name!r} (its members: a, b)"
        assert a.replication.stats["sessions"] == sessions  # no session, no frame
        assert a.replication.peer.node == "b" and a.replication.isr_store.isr == ["a", "b"]
        n.cancel_scope.cancel()


async def test_remove_node_lets_a_new_name_take_a_dead_members_place(etcd, tmp_path, cluster_name):
    endpoint = etcd.endpoints[0]
    async with trio.open_nursery() as n:
        a, b = await two_nodes(n, etcd, tmp_path, cluster_name)
        cli = ("cluster", "remove-node", "--cluster", endpoint, "--cluster-name", cluster_name)
        rc, _o, err = await rallypoint_cli(*cli, "b")
        assert rc == 1 and "is running" in err
        rc, _o, err = await rallypoint_cli(*cli, "z")
        assert rc == 1 and "'z' is not a member of shard 0: its members are a, b" in err
        b.stop()  # b is gone for good
        await b.wait_role("stopped")
        await wait_until(lambda: a.replication.isr_store.isr == ["a"])
        rc, out, err = await rallypoint_cli(*cli, "a")
        assert rc == 1 and "leads shard 0" in err
        rc, out, err = await rallypoint_cli(*cli, "b")
        assert rc == 0, err
        assert "members now a (1 of 2)" in out
        c = member(etcd, tmp_path, "c", cluster_name)
        await n.start(c.run)
        await wait_until(lambda: a.replication.isr_store.isr == ["a", "c"])
        with pytest.raises(NotAMemberError, match="are a, c"):
            await member(etcd, tmp_path, "b", cluster_name).run()
        n.cancel_scope.cancel()


async def test_remove_node_refuses_to_take_the_only_in_sync_node_of_a_stopped_shard(etcd, tmp_path, cluster_name):
    async with trio.open_nursery() as n:
        a = member(etcd, tmp_path, "a", cluster_name)
        await n.start(a.run)
        await a.wait_role("leader")
        a.stop()
        await a.wait_role("stopped")
    async with EtcdClient(etcd.endpoints) as client:
        election = ShardElection(client, cluster_name, 0)
        with pytest.raises(ConflictError, match="only in-sync node"):
            await election.remove_member("a")
        with pytest.raises(NotFoundError):
            await ShardElection(client, cluster_name, 5).remove_member("a")


# ============================================================ one live process per name
async def test_a_second_process_under_a_live_nodes_name_is_refused(etcd, tmp_path, cluster_name):
    async with trio.open_nursery() as n:
        a, b = await two_nodes(n, etcd, tmp_path, cluster_name)
        rc, _out, err = await rallypoint_cli(
            "serve", "--cluster", etcd.endpoints[0], "--cluster-name", cluster_name, "--node", "b",
            "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "b-again"))
        assert rc == 2
        [line] = errors_of(err)
        assert line.startswith(f"rallypoint: node 'b' of shard 0 of cluster {cluster_name!r} is already running "
                               f"(pid {os.getpid()} on host ")
        assert "two processes may not share a --node name" in line
        assert not (tmp_path / "b-again").exists()
        assert a.replication.peer.node == "b" and a.replication.isr_store.isr == ["a", "b"]
        n.cancel_scope.cancel()


@pytest.fixture
def processes(etcd, tmp_path, cluster_name):
    made: list[ClusterNode] = []

    def make(name: str) -> ClusterNode:
        node = ClusterNode(name, str(tmp_path), etcd.endpoints[0], cluster_name)
        made.append(node)
        return node

    yield make
    for node in made:
        node.kill()


async def test_a_kill_9_then_an_immediate_restart_of_the_same_node_starts(etcd, processes, cluster_name):
    a, b = processes("a"), processes("b")
    a.start()
    await a.wait_role("leader")
    b.start()
    await b.wait_role("standby")
    for victim, other in ((b, a), (a, b)):  # the standby, then the leader
        victim.kill()
        victim.start()  # at once: its presence key (and, for a leader, its leader key) still lives
        await victim.wait_ready()
        await victim.wait_role("standby")
        async with EtcdClient(etcd.endpoints) as client:
            with trio.fail_after(60):
                while sorted((await ShardElection(client, cluster_name, 0).read_replicas()).replicas.isr) != ["a", "b"]:
                    await trio.sleep(0.02)
        assert other.running()
    await b.wait_role("leader")  # it took over from a
