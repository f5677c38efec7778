"""Issue 30's acceptance test, on loopback against a real etcd: 3 shards x 2 real
``rallypoint serve --cluster --shard S`` processes (durability fsync), reached through
``rallypoint.connect`` with every node's address (the SDK's router).

What it shows: a mixed workload -- root runs on every shard, each with tasks submitted,
received and completed, a task group (FIRST_ACCEPTED), a join set with a child task and a
delay, a timer, a claim, a pool grant, a quota take and a budget reservation settled (the
last four live on the space's home shard: runs of the other shards use them remotely),
and a watch over the space -- goes on across a kill -9 of the leader of a shard that is
not the home shard, taken while tasks of its runs are leased: its runs continue on its
standby (the client follows), the other shards' leaders keep their epochs (they never
noticed), the watch sees events of every shard (the victim's from its new leader too),
and every acknowledged operation is there afterwards, read back through the router."""

from __future__ import annotations

import uuid

import pytest
import trio

import rallypoint
from rallypoint.actors.sharding import home_slot
from rallypoint.cluster.etcd import EtcdClient
from rallypoint.cluster.leader import ShardElection
from rallypoint.cluster.shardmap import init_cluster, read_map
from rallypoint.ids import slot_of

from _cluster import ClusterNode

pytestmark = pytest.mark.timeout(300)

SLOTS = 64
RUNS_PER_SHARD = 2


async def wait_until(pred, timeout=60.0, what=""):
    try:
        with trio.fail_after(timeout):
            while not pred():
                await trio.sleep(0.01)
    except trio.TooSlowError:
        raise AssertionError(f"not within {timeout} s: {what() if callable(what) else what}") from None


async def shard_state(etcd, name, shard):
    """``(leader node, epoch, isr)`` of ``shard`` as etcd has them."""
    async with EtcdClient(etcd.endpoints) as client:
        el = ShardElection(client, name, shard)
        lead, reps = await el.read_leader(), await el.read_replicas()
    return (lead.info.node if lead else None, lead.epoch if lead else None,
            sorted(reps.replicas.isr) if reps else None)


async def test_three_shards_of_two_survive_a_kill_9_of_one_leader_mid_workload(etcd, tmp_path):
    name = f"acc-{uuid.uuid4().hex[:10]}"
    async with EtcdClient(etcd.endpoints) as client:
        await init_cluster(client, name, slots=SLOTS, shards=3)
        owners = (await read_map(client, name)).owners
    home = owners[home_slot("default", SLOTS)]
    victim = (home + 1) % 3  # not the home shard
    others = [s for s in range(3) if s != victim]
    nodes = {s: [ClusterNode(f"n{s}{x}", str(tmp_path), etcd.endpoints[0], name,
                             extra=["--shard", str(s), "--sync-helper", "thread"]) for x in "ab"]
             for s in range(3)}
    try:
        # node a of each shard leads (it starts first), b is its in-sync standby
        for s in range(3):
            nodes[s][0].start()
        for s in range(3):
            await nodes[s][0].wait_ready()
            await nodes[s][0].wait_role("leader")
        for s in range(3):
            nodes[s][1].start()
        for s in range(3):
            await nodes[s][1].wait_ready()
            await nodes[s][1].wait_role("standby")
        states = {}
        for s in range(3):
            with trio.fail_after(60):
                while (st := await shard_state(etcd, name, s))[2] != [f"n{s}a", f"n{s}b"]:
                    await trio.sleep(0.02)
            assert st[0] == f"n{s}a"
            states[s] = st
        roles = {n.name: n.role_lines() for s in others for n in nodes[s]}
        url = "tcp://" + ",".join(n.address for s in range(3) for n in nodes[s])
        await workload(url, owners, nodes, victim, others, home)
        # the other shards never noticed: same leaders, same epochs, no new role
        for s in others:
            assert await shard_state(etcd, name, s) == states[s]
            assert nodes[s][0].role_lines()[-1].role == "leader"
            assert {n.name: n.role_lines() for n in nodes[s]} == {n.name: roles[n.name] for n in nodes[s]}
        lead, epoch, _isr = await shard_state(etcd, name, victim)
        assert lead == f"n{victim}b" and epoch > states[victim][1]
    finally:
        for s in range(3):
            for n in nodes[s]:
                n.kill()


async def workload(url, owners, nodes, victim, others, home):
    def shard_of(entity_id):
        return owners[slot_of(entity_id)]

    acked: dict[str, dict] = {"tasks": {}, "groups": {}, "joinsets": {}, "timers": {}, "claims": {}}
    events: list = []
    async with rallypoint.connect(url) as rs, trio.open_nursery() as nursery:
        jobs = await rs.mailboxes.ensure("jobs")
        votes = await rs.mailboxes.ensure("votes")
        kids = await rs.mailboxes.ensure("kids")
        pool = await rs.pools.ensure("gpu", 100)
        quota = await rs.quotas.ensure("api", units_limit=1000, window_seconds=3600)
        budget = await rs.budgets.ensure("llm", limit=1_000_000)

        watching = trio.Event()

        async def watch():
            async with rs.events.watch(start="now") as stream:
                watching.set()
                async for ev in stream:
                    events.append(ev)

        nursery.start_soon(watch)
        await watching.wait()

        runs: dict[int, list] = {0: [], 1: [], 2: []}
        while min(len(v) for v in runs.values()) < RUNS_PER_SHARD:
            r = await rs.scopes.create()
            if len(runs[shard_of(r.id)]) < RUNS_PER_SHARD:
                runs[shard_of(r.id)].append(r)
        every = [r for s in range(3) for r in runs[s]]

        # ---- before the kill: every kind on every run; one task done, one leased
        state: dict[str, dict] = {}
        for i, r in enumerate(every):
            x: dict = {}
            t1 = await jobs.submit({"i": i, "n": 1}, scope=r, key=f"t1-{i}")
            t2 = await jobs.submit({"i": i, "n": 2}, scope=r, key=f"t2-{i}")
            assert shard_of(t1.id) == shard_of(t2.id) == shard_of(r.id)
            d = await jobs.receive(scope=r, lease_seconds=120, wait=10)
            assert d is not None and d.task_id == t1.id
            await d.complete({"done": t1.id})
            acked["tasks"][t1.id] = {"done": t1.id}
            x["leased"] = await jobs.receive(scope=r, lease_seconds=120, wait=10)  # t2, leased over the kill
            assert x["leased"] is not None and x["leased"].task_id == t2.id
            g = await r.groups.create(votes, "FIRST_ACCEPTED")
            x["group"], x["member"] = g, await g.submit({"vote": i}, key=f"m-{i}")
            js = await r.join_sets.create()
            x["js"], x["child"] = js, await js.submit(kids, {"kid": i}, key=f"k-{i}")
            x["delay"] = await js.submit_delay(0.2)
            x["timer"] = await r.timers.create(after_seconds=0.5)
            x["claim"] = await r.claims.acquire(f"claim-{i}", lease_seconds=120, holder=f"w{i}")
            x["grant"] = await r.pools.acquire(pool, 2, lease_seconds=120)
            assert (await quota.take(3, scope=r)).granted
            x["res"] = await budget.reserve(500, scope=r, holder=f"w{i}")
            state[r.id] = x
        assert (await pool.status()).units_used == 2 * len(every)

        # ---- kill -9 of the victim's leader, tasks of its runs leased
        old, standby = nodes[victim]
        old.kill()

        async def finish(i, r):
            x = state[r.id]
            t2 = x["leased"].task_id
            await x["leased"].complete({"done": t2})  # its lease survived the kill
            acked["tasks"][t2] = {"done": t2}
            t3 = await jobs.submit({"i": i, "n": 3}, scope=r, key=f"t3-{i}")  # new work on the run
            d = await jobs.receive(scope=r, lease_seconds=60, wait=20)
            assert d is not None and d.task_id == t3.id
            await d.complete({"done": t3.id})
            acked["tasks"][t3.id] = {"done": t3.id}
            g = x["group"]
            d = await votes.receive(scope=g.scope_id, lease_seconds=60, wait=20)
            assert d is not None and d.task_id == x["member"].id
            await d.complete({"vote": i})
            acked["tasks"][d.task_id] = {"vote": i}
            await g.accept(x["member"])
            assert (await g.wait(timeout=30)).outcome == "SUCCESS"
            acked["groups"][g.id] = x["member"].id
            d = await kids.receive(scope=r, lease_seconds=60, wait=20)
            assert d is not None and d.task_id == x["child"]
            await d.complete({"kid": i})
            acked["tasks"][d.task_id] = {"kid": i}
            js = x["js"]
            got = dict([await js.join_next(timeout=30), await js.join_next(timeout=30)])
            assert got == {x["child"]: {"kid": i}, x["delay"]: None}
            acked["joinsets"][js.id] = 2
            await x["timer"].wait(timeout=30)
            acked["timers"][x["timer"].id] = "ACKED"
            await x["claim"].complete({"claimed": i})
            acked["claims"][f"claim-{i}"] = {"claimed": i}
            s = await x["res"].settle(120, f"use-{i}")
            assert s.charged_minor == 120

        # the other shards go on at once, their runs' home-shard entities too ...
        for i, r in enumerate(every):
            if shard_of(r.id) != victim:
                await finish(i, r)
        # ... and the victim's runs continue on its standby: the client follows
        await standby.wait_role("leader", timeout=60)
        for i, r in enumerate(every):
            if shard_of(r.id) == victim:
                await finish(i, r)
        for x in state.values():
            await x["grant"].release()  # (acknowledged releases too)

        # the watch saw every shard, the victim's events from its new leader too
        def completed():
            return {e.id for e in events if e.type == "task.completed"}

        await wait_until(lambda: set(acked["tasks"]) <= completed(),
                         what=lambda: set(acked["tasks"]) - completed())
        assert {e.shard for e in events} == {0, 1, 2}
        nursery.cancel_scope.cancel()

    # ---- afterwards, through a new router connection: every acknowledged operation
    async with rallypoint.connect(url) as rs:
        assert {shard_of(t) for t in acked["tasks"]} == {0, 1, 2}
        results = await rs.results(list(acked["tasks"]), timeout=30)
        assert {x.id: (x.state, x.outcome) for x in results} == {
            t: ("SUCCEEDED", v) for t, v in acked["tasks"].items()}
        for r in every:
            x = state[r.id]
            g = await rs.scope(r.id).groups.by_id(x["group"].id).status()
            assert (g.state, g.outcome) == ("FINALIZED", "SUCCESS")
            assert [(m.task_id, m.task_state, m.verdict) for m in g.members] == [
                (acked["groups"][g.id], "SUCCEEDED", "ACCEPTED")]
            js = await rs.scope(r.id).join_sets.by_id(x["js"].id).status()
            assert (js.submitted, js.finished, js.consumed) == (2, 2, acked["joinsets"][js.id])
            tm = await rs.scope(r.id).timers.get(x["timer"].id).status()
            assert tm.state == acked["timers"][tm.id]
        for key, result in acked["claims"].items():
            c = await rs.claims.status(key)
            assert (c.state, c.generation, c.result) == ("COMPLETED", 1, result)
        p = await (await rs.pools.get("gpu")).status()
        assert (p.units_used, p.active_grants) == (0, 0)
        b = await rs.budgets.ensure("llm", limit=1_000_000)
        bs = await b.status()
        n = len(every)
        assert (bs.settled_minor, bs.reserved_minor, bs.open_reservations) == (120 * n, 0, 0)
        q = await rs.quotas.ensure("api", units_limit=1000, window_seconds=3600)
        qs = await q.status()
        assert qs.consumed_total == 3 * n
        # the space-wide entities are the home shard's (the other shards' runs used them remotely)
        assert {shard_of(x.id) for x in (p, bs, qs, c)} == {home}
