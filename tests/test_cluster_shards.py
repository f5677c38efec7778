"""A sharded cluster in one process: 3 shards x 2 nodes against a real etcd, clients
through the SDK's router (rallypoint/client/router.py).

What each test shows: ids route without a lookup (every id names its root run's slot);
a mixed workload spreads over every shard; a node refuses a request of another shard
(WRONG_SHARD) and the SDK goes where it belongs; work queues exist on every shard under
one id; steps that would span two run trees or two shards are refused with a clear
error; one shard's leader lost mid-run: its runs continue on its standby, the other
shards never notice; adding a shard gives it new root runs."""

from __future__ import annotations

import uuid

import pytest
import trio

import rallypoint
from rallypoint.cluster.etcd import EtcdClient
from rallypoint.nodeconfig import StorageOptions
from rallypoint.cluster.member import MemberConfig, ShardMember
from rallypoint.cluster.shardmap import init_cluster, read_map
from rallypoint.errors import ValidationError, WrongShardError
from rallypoint.ids import slot_of
from rallypoint.transport.connection import Connection
from rallypoint.transport.server import Server

pytestmark = pytest.mark.timeout(300)

SLOTS = 64


def member(etcd, tmp_path, name, cluster, shard):
    cfg = MemberConfig(etcd=etcd.endpoints, node=name, data_dir=str(tmp_path / name), cluster=cluster, shard=shard,
                       client=("127.0.0.1", 0), replication=("127.0.0.1", 0), isr_timeout_s=0.5,
                       storage=StorageOptions(sync_helper="thread"))
    return ShardMember(cfg, make_server=lambda d: Server(d))


async def wait_until(pred, timeout=120.0, what=None):
    try:
        with trio.fail_after(timeout):
            while not pred():
                await trio.sleep(0.01)
    except trio.TooSlowError:
        raise AssertionError(f"not within {timeout} s: {what() if what else pred}") from None


@pytest.fixture
def cluster_name():
    return f"s-{uuid.uuid4().hex[:10]}"


async def start_cluster(etcd, tmp_path, cluster, nursery, shards=3, nodes=2):
    async with EtcdClient(etcd.endpoints) as client:
        await init_cluster(client, cluster, slots=SLOTS, shards=shards)
    members: dict[int, list[ShardMember]] = {}
    for s in range(shards):
        for i in range(nodes):
            m = member(etcd, tmp_path, f"n{s}{'ab'[i]}", cluster, s)
            await nursery.start(m.run)
            members.setdefault(s, []).append(m)
    def state():
        return {s: [(m.config.node, m.role, m.replication and m.replication.isr_store.isr, sorted(m.leaders))
                    for m in ms] for s, ms in members.items()}

    for s, ms in members.items():
        await wait_until(lambda ms=ms: any(m.role == "leader" for m in ms), what=state)
        lead = next(m for m in ms if m.role == "leader")
        await wait_until(lambda lead=lead: lead.replication is not None and len(lead.replication.isr_store.isr) == nodes,
                         what=state)
        await wait_until(lambda lead=lead: len(lead.leaders) == shards, what=state)
    return members


def urls(members):
    return "tcp://" + ",".join(f"127.0.0.1:{m.client_port}" for ms in members.values() for m in ms)


def leader(ms):
    return next(m for m in ms if m.role == "leader")


def shard_of(members, entity_id):
    owners = leader(members[0]).slotmap.owners
    return owners[slot_of(entity_id)]


async def test_a_mixed_workload_spreads_over_every_shard_and_every_id_names_its_root(etcd, tmp_path, cluster_name):
    async with trio.open_nursery() as n:
        members = await start_cluster(etcd, tmp_path, cluster_name, n)
        async with rallypoint.connect(urls(members)) as rs:
            jobs = await rs.mailboxes.ensure("jobs")
            runs = [await rs.scopes.create(name=f"r{i}") for i in range(9)]
            assert {shard_of(members, r.id) for r in runs} == {0, 1, 2}  # new roots go to every shard
            jobs_id = (await jobs.status()).id
            # the queue exists on every shard under one id (its home slot's)
            assert all(leader(ms).node.coordinator.queues.table.get(jobs_id) for ms in members.values())
            tickets = []
            for r in runs:
                child = await r.child(name="c")
                assert slot_of(child.id) == slot_of(r.id)  # ids under a root name its slot
                t = await jobs.submit({"run": r.id}, scope=child, key="k")
                assert slot_of(t.id) == slot_of(r.id)
                tickets.append((r, child, t))
                g = await child.groups.create(mailbox=jobs, condition="FIRST_ACCEPTED")
                assert slot_of(g.id) == slot_of(r.id)
                timer = await child.timers.create(after_seconds=3600)
                assert slot_of(timer.id) == slot_of(r.id)
            done = 0
            for r, child, t in tickets:
                d = await jobs.receive(scope=child, lease_seconds=30, wait=5)
                assert d is not None and d.task_id == t.id
                await d.complete({"ok": 1})
                res = await rs.task(t.id).result(timeout=30)
                assert res.state == "SUCCEEDED"
                done += 1
            # a batch over tasks of every shard is split, and answered in order
            results = await rs.results([t.id for _r, _c, t in tickets], timeout=30)
            assert [x.id for x in results] == [t.id for _r, _c, t in tickets]
            # fan-out reads merge every shard's part
            st = await rs.status()
            assert st.tasks.get("SUCCEEDED", 0) == done
            listed = await rs.scopes.list()
            assert {r.id for r in runs} <= {s.id for s in listed}
        n.cancel_scope.cancel()


async def test_a_node_refuses_another_shards_request_and_the_sdk_goes_there(etcd, tmp_path, cluster_name):
    async with trio.open_nursery() as n:
        members = await start_cluster(etcd, tmp_path, cluster_name, n)
        async with rallypoint.connect(urls(members)) as rs:
            run = await rs.scopes.create(name="somewhere")
            home = shard_of(members, run.id)
            other = next(s for s in members if s != home)
            # straight to a node of another shard: WRONG_SHARD naming the owner
            async with rallypoint.connect(f"tcp://127.0.0.1:{leader(members[other]).client_port}",
                                          reconnect=False, route=False) as direct:
                with pytest.raises(WrongShardError) as e:
                    await direct.scope(run.id).status()
                assert e.value.details["shard"] == home
            # through the router: fine, wherever it connected first
            assert (await rs.scope(run.id).status()).state == "ACTIVE"
            # issue 42, item 13: without reconnection too (it used to turn routing off)
            async with rallypoint.connect(f"tcp://127.0.0.1:{leader(members[other]).client_port}",
                                          reconnect=False) as plain:
                assert (await plain.scope(run.id).status()).state == "ACTIVE"
                assert (await (await plain.scopes.create(name="plain")).status()).state == "ACTIVE"
        n.cancel_scope.cancel()


async def test_steps_across_run_trees_or_shards_are_refused_clearly(etcd, tmp_path, cluster_name):
    async with trio.open_nursery() as n:
        members = await start_cluster(etcd, tmp_path, cluster_name, n)
        async with rallypoint.connect(urls(members)) as rs:
            jobs = await rs.mailboxes.ensure("jobs")
            runs = [await rs.scopes.create() for _ in range(6)]
            a = runs[0]
            same = next(r for r in runs[1:] if shard_of(members, r.id) == shard_of(members, a.id))
            away = next(r for r in runs[1:] if shard_of(members, r.id) != shard_of(members, a.id))
            g = await a.groups.create(mailbox=jobs, condition="FIRST_ACCEPTED")
            t_same = await jobs.submit({}, scope=same)
            with pytest.raises(ValidationError) as e:  # another tree on the same shard
                await g.join_task(t_same.id)
            assert e.value.details.get("cross_tree")
            t_away = await jobs.submit({}, scope=away)
            with pytest.raises(ValidationError) as e:  # another tree on another shard
                await g.join_task(t_away.id)
            assert e.value.details.get("cross_shard")
        n.cancel_scope.cancel()


async def test_one_shards_leader_lost_its_runs_go_on_the_others_never_notice(etcd, tmp_path, cluster_name):
    async with trio.open_nursery() as n:
        members = await start_cluster(etcd, tmp_path, cluster_name, n)
        async with rallypoint.connect(urls(members)) as rs:
            jobs = await rs.mailboxes.ensure("jobs")
            runs = [await rs.scopes.create() for _ in range(6)]
            by_shard = {}
            for r in runs:
                by_shard.setdefault(shard_of(members, r.id), []).append(r)
            victim = 0
            others = [s for s in members if s != victim]
            epochs = {s: leader(members[s]).epoch for s in others}
            tickets = [await jobs.submit({"i": i}, scope=r, key=f"k{i}") for i, r in enumerate(runs)]
            old = leader(members[victim])
            old.stop()  # a hand-over on shard 0 only
            await wait_until(lambda: any(m.role == "leader" and m is not old for m in members[victim]))
            for r, t in zip(runs, tickets):
                d = await jobs.receive(scope=r, lease_seconds=30, wait=10)
                assert d is not None and d.task_id == t.id  # every acknowledged submit is there
                await d.complete({"ok": True})
            assert {s: leader(members[s]).epoch for s in others} == epochs  # untouched
        n.cancel_scope.cancel()


async def test_adding_a_shard_gives_it_empty_slots_and_new_root_runs(etcd, tmp_path, cluster_name):
    import subprocess
    import sys

    async with trio.open_nursery() as n:
        members = await start_cluster(etcd, tmp_path, cluster_name, n, shards=2)
        async with rallypoint.connect(urls(members)) as rs:
            before = [await rs.scopes.create() for _ in range(4)]
        args = [sys.executable, "-m", "rallypoint", "cluster", "add-shard", "--cluster", etcd.endpoints[0],
                "--cluster-name", cluster_name]
        out = await trio.to_thread.run_sync(lambda: subprocess.run(args, capture_output=True, text=True, timeout=60))
        assert out.returncode == 0, out.stderr
        assert "shard 2 owns" in out.stdout
        async with EtcdClient(etcd.endpoints) as client:
            m = await read_map(client, cluster_name)
        moved = [x for x, o in enumerate(m.owners) if o == 2]
        assert moved and all(slot_of(r.id) not in moved for r in before)  # only empty slots moved
        for i in range(2):
            nm = member(etcd, tmp_path, f"n2{'ab'[i]}", cluster_name, 2)
            await n.start(nm.run)
            members.setdefault(2, []).append(nm)
        await wait_until(lambda: any(x.role == "leader" for x in members[2]))
        await wait_until(lambda: all(len(leader(ms).leaders) == 3 for ms in members.values()))
        async with rallypoint.connect(urls(members)) as rs:
            after = [await rs.scopes.create() for _ in range(6)]
            assert 2 in {shard_of(members, r.id) for r in after}
            for r in before + after:
                assert (await rs.scope(r.id).status()).state == "ACTIVE"
        n.cancel_scope.cancel()


async def test_cluster_status_without_a_shard_shows_every_shard(etcd, tmp_path, cluster_name):
    # issue 42, item 7: `rallypoint status` over a cluster showed shard 0's cluster lines
    # whichever node you asked; no command showed every shard's health at once
    import json
    import subprocess
    import sys

    async with trio.open_nursery() as n:
        members = await start_cluster(etcd, tmp_path, cluster_name, n)
        base = [sys.executable, "-m", "rallypoint", "cluster", "status", "--cluster", etcd.endpoints[0],
                "--cluster-name", cluster_name]
        out = await trio.to_thread.run_sync(lambda: subprocess.run(base + ["--json"], capture_output=True,
                                                                   text=True, timeout=60))
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert [s["shard"] for s in doc["shards"]] == [0, 1, 2]
        for s in doc["shards"]:
            lead = leader(members[s["shard"]])
            assert s["leader"]["node"] == lead.config.node and s["leader"]["epoch"] == lead.epoch
            assert sorted(s["isr"]) == sorted(m.config.node for m in members[s["shard"]])
            assert s["node"]["standby"]["state"] == "in_sync" and s["node"]["leading_for_s"] >= 0
        human = await trio.to_thread.run_sync(lambda: subprocess.run(base, capture_output=True, text=True,
                                                                     timeout=60))
        assert human.returncode == 0, human.stderr
        lines = human.stdout.splitlines()
        assert lines[0].endswith("3 shard(s)") and lines[1].split()[:3] == ["shard", "leader", "epoch"]
        assert [ln.split()[0] for ln in lines[2:]] == ["0", "1", "2"]
        assert all("in_sync" in ln for ln in lines[2:])
        n.cancel_scope.cancel()
