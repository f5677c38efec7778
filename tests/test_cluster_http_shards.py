"""The runstate HTTP API of a sharded cluster through ONE node (rallypoint/cluster/httproute.py):
3 shards x 1 node against a real etcd, each node serving ``--http`` as ``serve --cluster``
does (ClusterHttpApp); the unchanged runstate SDK 0.3 is pointed at one node's port only.

What each test shows: runs the SDK makes land on every shard and their tasks are queued,
received and completed through that one port, the space's limit and budget (its home
shard) used by runs of every shard, status read, a run's events watched
(routing inside the node: the whole request forwarded to the owning shard, under the
caller's key); idempotency keys still replay (the answer stored on the shard that applied
the request); a space-wide /events and /watch merge every shard's events with an opaque
cursor; errors keep their HTTP codes; a standby of one shard serves as well (it forwards to
its leader, which routes), and another shard's failover is waited out (503, then its
new leader answers every run it had)."""

from __future__ import annotations

import functools
import json
import uuid

import httpx
import pytest
import trio

from rallypoint.actors.sharding import named_slot
from rallypoint.cluster import keystore
from rallypoint.cluster.etcd import EtcdClient
from rallypoint.cluster.forward import ClusterHttpApp
from rallypoint.nodeconfig import StorageOptions
from rallypoint.cluster.member import MemberConfig, ShardMember
from rallypoint.cluster.shardmap import init_cluster
from rallypoint.http import serve_http
from rallypoint.http.app import HttpApi
from rallypoint.ids import slot_of
from rallypoint.transport.server import Server

from sdk_compat import sdk_python
from test_cluster_shards import SLOTS, leader, wait_until

pytestmark = pytest.mark.timeout(600)

SPACE = "compat"


async def start_http_cluster(etcd, tmp_path, cluster, nursery, shards=3, nodes=1, keys=True):
    """``shards`` one-node shards, each node with its HTTP port (as ``serve --cluster
    --http``), an admin key and a read-only key of space ``compat`` in the cluster's key
    store (none with ``keys=False``: open mode): ``(members, secrets, apps)`` (``secrets``: ``admin``/``reader`` -> secret;
    ``apps``: each shard's ClusterHttpApp)."""
    async with EtcdClient(etcd.endpoints) as client:
        await init_cluster(client, cluster, slots=SLOTS, shards=shards)
        secret = reader = None
        if keys:
            _rec, secret = await keystore.create_key(client, cluster, SPACE, ["admin"])
            _rec, reader = await keystore.create_key(client, cluster, SPACE, ["coordination_read"])
    members: dict[int, list[ShardMember]] = {}
    apps: dict[int, ClusterHttpApp] = {}
    for s in range(shards):
        for i in range(nodes):
            nm = f"h{s}{'abc'[i]}"
            cfg = MemberConfig(etcd=etcd.endpoints, node=nm, data_dir=str(tmp_path / nm), cluster=cluster,
                               shard=s, client=("127.0.0.1", 0), replication=("127.0.0.1", 0), isr_timeout_s=0.5,
                               storage=StorageOptions(sync_helper="thread"))
            m = ShardMember(cfg, make_server=lambda d: Server(d))
            app = ClusterHttpApp(m, lambda node: HttpApi(node.service))
            if i == 0:
                apps[s] = app
            _api, urls = await nursery.start(functools.partial(serve_http, None, "127.0.0.1", 0, api=app))
            cfg.http = ("127.0.0.1", int(urls[0].rsplit(":", 1)[1]))
            await nursery.start(m.run)
            members.setdefault(s, []).append(m)

    def ready():
        for ms in members.values():
            lead = next((m for m in ms if m.role == "leader"), None)
            if lead is None or len(lead.leaders) != shards:
                return False
            if lead.replication is not None and len(lead.replication.isr_store.isr) != nodes:
                return False
            if any(rec.info.http_address is None for rec in lead.leaders.values()):
                return False
            if keys and (lead.node.coordinator.keys.open_mode or len(lead.node.coordinator.keys.by_hash) < 2):
                return False
        return True

    def state():
        return {s: [(m.config.node, m.role, sorted(m.leaders),
                     {k: r.info.http_address for k, r in m.leaders.items()},
                     m.replication and sorted(m.replication.isr_store.isr),
                     m.node is not None and len(m.node.coordinator.keys.by_hash)) for m in ms]
                for s, ms in members.items()}

    await wait_until(ready, what=state)
    return members, {"admin": secret, "reader": reader}, apps


def base_of(members, shard=0) -> str:
    return f"http://127.0.0.1:{leader(members[shard]).config.http[1]}/v1/spaces/{SPACE}"


def shard_of(members, entity_id: str) -> int:
    return leader(members[0]).slotmap.owners[slot_of(entity_id)]


def names_on_every_shard(members, per_shard: int = 2) -> list[str]:
    """Run names whose named slots fall ``per_shard`` on each shard."""
    owners = leader(members[0]).slotmap.owners
    got: dict[int, list[str]] = {}
    i = 0
    while any(len(got.get(s, [])) < per_shard for s in members):
        name = f"run-{i}"
        s = owners[named_slot(SPACE, name, len(owners))]
        if len(got.setdefault(s, [])) < per_shard:
            got[s].append(name)
        i += 1
    return [n for s in sorted(got) for n in got[s]]


SDK03 = r'''
import json, os, threading
import runstate

out = {"runs": {}}
for name in json.loads(os.environ["RUN_NAMES"]):
    rs = runstate.Runstate(run=name, worker="w-" + name)
    @rs.queue("jobs", attempts=2, concurrency=1)
    def double(doc):
        return {"n": doc["n"] * 2}
    stop = threading.Event()
    server = threading.Thread(target=rs.serve, kwargs={"signal": stop})
    server.start()
    try:
        r1 = double({"n": 1})
        job = double.send({"n": 5})
        r2 = job.result(timeout="20s")
    finally:
        stop.set(); server.join(60)
    # the space's limit and budget (its home shard) used by a run of any shard
    rs.setup(limits={"search": {"max": 100, "per": "60s"}})
    @rs.limit("search", max=100, per="60s")
    def search(q):
        return q.upper()
    @rs.budget("spend", reserve=0.10, limit=100)
    def ask(p):
        return p
    used = [search("a"), ask("b")]
    st = rs.status()
    # the run's events (GET /watch?scopeId=...: the run's shard)
    seen = []
    for ev in rs.events(types=["task.completed"]):
        seen.append(ev.type)
        if len(seen) >= 2:
            break
    out["runs"][name] = {"id": rs.run_id(), "results": [r1["n"], r2["n"]], "status": [st.run.name, st.run.state],
                         "events": seen, "stopped": not server.is_alive(), "used": used}
print(json.dumps(out))
'''


async def run_sdk(py: str, base: str, secret: str, script: str, env: dict, timeout: float = 300):
    import os
    import subprocess

    e = {k: v for k, v in os.environ.items() if not k.startswith(("RUNSTATE_", "PYTHONPATH"))}
    e.update(RUNSTATE_BASE_URL=base.rsplit("/v1/", 1)[0], RUNSTATE_API_KEY=secret, RUNSTATE_SPACE_ID=SPACE,
             NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost", **env)
    r = await trio.to_thread.run_sync(functools.partial(
        subprocess.run, [py, "-c", script], capture_output=True, text=True, timeout=timeout, env=e))
    assert r.returncode == 0, f"SDK script exited {r.returncode}:\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    return json.loads([ln for ln in r.stdout.splitlines() if ln.strip()][-1])


@pytest.fixture
def cluster_name():
    return f"hs-{uuid.uuid4().hex[:10]}"


async def test_the_runstate_sdk_through_one_node_reaches_every_shard(etcd, tmp_path, cluster_name):
    py = await trio.to_thread.run_sync(sdk_python, "0.3.0")
    async with trio.open_nursery() as n:
        members, secrets, apps = await start_http_cluster(etcd, tmp_path, cluster_name, n)
        secret = secrets["admin"]
        base = base_of(members, 0)
        names = names_on_every_shard(members)
        out = await run_sdk(py, base, secret, SDK03, {"RUN_NAMES": json.dumps(names)})
        runs = out["runs"]
        assert {shard_of(members, r["id"]) for r in runs.values()} == {0, 1, 2}  # every shard has runs
        for name, r in runs.items():
            assert r["results"] == [2, 10], (name, r)
            assert r["status"] == [name, "running"], (name, r)
            assert r["events"] == ["task.completed", "task.completed"], (name, r)
            assert r["stopped"]
            assert r["used"] == ["A", "b"], (name, r)
        # each run's tasks were applied on its own shard, and the node routed the others
        for name, r in runs.items():
            s = shard_of(members, r["id"])
            assert r["id"] in leader(members[s]).node.coordinator.runs.table
        assert apps[0]._local.router.forwarded > 0  # (node 0 sent the other shards' requests there)
        n.cancel_scope.cancel()


async def test_keys_replay_where_applied_events_merge_and_errors_keep_their_codes(etcd, tmp_path, cluster_name):
    import re

    async with trio.open_nursery() as n:
        members, secrets, apps = await start_http_cluster(etcd, tmp_path, cluster_name, n)
        secret = secrets["admin"]
        base = base_of(members, 0)
        h = {"authorization": f"Bearer {secret}"}
        async with httpx.AsyncClient(timeout=60) as c:
            # new runs with an Idempotency-Key: spread by key, a retry replays the stored answer
            runs: list[str] = []
            for i in range(9):
                kh = {**h, "idempotency-key": f"create-{i}"}
                first = await c.post(f"{base}/scopes", json={"name": f"r{i}"}, headers=kh)
                again = await c.post(f"{base}/scopes", json={"name": f"r{i}"}, headers=kh)
                assert first.status_code == again.status_code == 200, first.text
                assert again.json() == first.json() and again.headers.get("idempotent-replayed") == "true"
                runs.append(first.json()["id"])
                # the answer is stored on the shard that applied it, and only there
                owner = shard_of(members, first.json()["id"])
                for s, ms in members.items():
                    stored = leader(ms).node.coordinator.idempotency._live(SPACE, f"create-{i}")
                    assert (stored is not None) == (s == owner), (i, s, owner)
            assert {shard_of(members, r) for r in runs} == {0, 1, 2}
            # a work queue (defined on every shard through its home), a keyed task on each run
            q = await c.put(f"{base}/mailboxes/by-name/jobs", json={"mode": "WORK"}, headers=h)
            assert q.status_code == 200, q.text
            qid = q.json()["id"]
            for i, r in enumerate(runs):
                kh = {**h, "idempotency-key": f"task-{i}"}
                body = {"scopeId": r, "mailboxId": qid, "taskKey": f"t{i}", "input": {"i": i}}
                t1 = await c.post(f"{base}/tasks", json=body, headers=kh)
                t2 = await c.post(f"{base}/tasks", json=body, headers=kh)
                assert t1.status_code == 200 and t2.json() == t1.json(), t1.text
                assert t2.headers.get("idempotent-replayed") == "true"
            lst = await c.get(f"{base}/mailboxes", headers=h)
            (jobs,) = [m for m in lst.json()["mailboxes"] if m["id"] == qid]
            # space-wide events: every shard's, merged, with an opaque cursor naming each shard
            page = (await c.get(f"{base}/events", params={"limit": 1000}, headers=h)).json()
            ids = [e["eventId"] for e in page["events"]]
            assert {i.split(":")[0] for i in ids} == {"0", "1", "2"} and len(set(ids)) == len(ids)
            assert re.fullmatch(r"0:\d+,1:\d+,2:\d+", page["nextCursor"])
            paged, cursor = [], None
            while True:  # small pages resume exactly: every event once
                params = {"limit": 7, **({"cursor": cursor} if cursor else {})}
                pg = (await c.get(f"{base}/events", params=params, headers=h)).json()
                paged += [e["eventId"] for e in pg["events"]]
                if not pg["events"]:
                    break
                cursor = pg["nextCursor"]
            assert sorted(paged) == sorted(ids)
            # a merged event reads as the run's shard itself gives it (a run's page: its shard's)
            one = (await c.get(f"{base}/events", params={"scopeId": runs[1], "limit": 1000}, headers=h)).json()
            merged = {e["eventId"]: e for e in page["events"]}
            assert one["events"] and all(merged[e["eventId"]] == e for e in one["events"])
            # a watch from the end holds until any shard has an event: a run of shard 2 cancelled
            victim = next(r for r in runs if shard_of(members, r) == 2)
            got: dict = {}

            async def watch():
                w = await c.get(f"{base}/watch", params={"cursor": page["nextCursor"], "waitSeconds": 30,
                                                         "types": "scope.cancelled"}, headers=h)
                got.update(w.json())

            async with trio.open_nursery() as wn:
                wn.start_soon(watch)
                cancel = await c.post(f"{base}/scopes/{victim}/cancel", json={}, headers=h)
                assert cancel.status_code == 200, cancel.text
            assert [e["eventId"].split(":")[0] for e in got["events"]] == ["2"], got
            assert got["events"][0]["scopeId"] == victim
            before = dict(x.split(":") for x in page["nextCursor"].split(","))
            after = dict(x.split(":") for x in got["nextCursor"].split(","))
            assert int(after["2"]) > int(before["2"])
            # errors keep their HTTP codes, wherever the request went
            from rallypoint.ids import IdGenerator

            gen = IdGenerator()
            owners = leader(members[0]).slotmap.owners
            missing = gen.new("scp", slot=owners.index(1))  # a run of shard 1 that does not exist
            r = await c.get(f"{base}/scopes/{missing}", headers=h)
            assert r.status_code == 404 and r.json()["error"]["code"] == "NOT_FOUND"
            r = await c.get(f"{base}/events", params={"cursor": "17"}, headers=h)  # not a cursor of this cluster
            assert r.status_code == 410 and r.json()["error"]["code"] == "CURSOR_EXPIRED"
            r = await c.get(f"{base}/scopes/{runs[1]}", headers={"authorization": "Bearer nope"})
            assert r.status_code == 401
            r = await c.post(f"{base}/tasks", json={"scopeId": victim, "mailboxId": qid, "taskKey": "late"}, headers=h)
            assert r.status_code == 409 and r.json()["error"]["code"] == "SCOPE_CANCELLED", r.text
            # the caller's identity reaches the owning shard: a read-only key reads everywhere, writes nowhere
            rh = {"authorization": "Bearer " + secrets["reader"]}
            far = next(r for r in runs if shard_of(members, r) != 0 and r != victim)
            assert (await c.get(f"{base}/scopes/{far}", headers=rh)).status_code == 200
            assert (await c.get(f"{base}/mailboxes", headers=rh)).status_code == 200  # fan-out under that key
            r = await c.post(f"{base}/scopes/{far}/cancel", json={}, headers=rh)
            assert r.status_code == 403 and r.json()["error"]["code"] == "FORBIDDEN", r.text
            r = await c.put(f"{base}/mailboxes/by-name/other", json={"mode": "WORK"}, headers=rh)
            assert r.status_code == 403, r.text
        # what node 0 routed is on its /metrics
        from prometheus_client import generate_latest

        from rallypoint.metrics import ClusterMetrics

        cm = ClusterMetrics(leader(members[0]))
        cm.http_app = apps[0]
        text = generate_latest(cm.registry()).decode()
        got = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^rallypoint_cluster_http_routed_total\{how="(\w+)"\} (\S+)$', text, re.M)}
        assert got["forwarded"] == apps[0].routed()["forwarded"] > 0 and got["native"] > 0, text
        assert re.search(r"^rallypoint_cluster_http_route_connections_total [1-9]", text, re.M), text
        n.cancel_scope.cancel()


async def test_through_a_standby_and_across_another_shards_failover(etcd, tmp_path, cluster_name):
    async with trio.open_nursery() as n:
        members, secrets, _apps = await start_http_cluster(etcd, tmp_path, cluster_name, n, nodes=2)
        h = {"authorization": "Bearer " + secrets["admin"]}
        standby = next(m for m in members[0] if m.role != "leader")
        base = f"http://127.0.0.1:{standby.config.http[1]}/v1/spaces/{SPACE}"  # a standby of shard 0
        async with httpx.AsyncClient(timeout=60) as c:
            runs = []
            for i in range(9):  # a standby forwards to its leader, which routes
                r = await c.post(f"{base}/scopes", json={"name": f"f{i}"}, headers={**h, "idempotency-key": f"f{i}"})
                assert r.status_code == 200, r.text
                runs.append(r.json()["id"])
            assert {shard_of(members, r) for r in runs} == {0, 1, 2}
            victim = 1
            on_victim = [r for r in runs if shard_of(members, r) == victim]
            others = [r for r in runs if shard_of(members, r) != victim]
            old = leader(members[victim])
            old.stop()  # shard 1 hands over to its standby
            await wait_until(lambda: any(m.role == "leader" and m is not old for m in members[victim]))

            last: list = []

            async def answered(run: str) -> bool:
                r = await c.get(f"{base}/scopes/{run}", headers=h)
                last[:] = [r.status_code, r.text[:300]]
                if r.status_code == 503:  # the routing node has not seen the new leader yet: the SDK retries
                    return False
                assert r.status_code == 200, r.text
                return True

            for run in on_victim:  # every run of shard 1 is there after its failover
                try:
                    with trio.fail_after(60):
                        while not await answered(run):
                            await trio.sleep(0.05)
                except trio.TooSlowError:
                    raise AssertionError(f"run {run} of shard {victim} not answered in 60 s: {last}") from None
            for run in others:  # the other shards answer as before
                assert (await c.get(f"{base}/scopes/{run}", headers=h)).status_code == 200
        n.cancel_scope.cancel()


async def test_open_mode_serves_any_space_over_every_shard(etcd, tmp_path, cluster_name):
    # no key: the path's space is used, also on the native connections a fan-out takes
    async with trio.open_nursery() as n:
        members, _secrets, _apps = await start_http_cluster(etcd, tmp_path, cluster_name, n, keys=False)
        base = f"http://127.0.0.1:{leader(members[0]).config.http[1]}/v1/spaces/dev"
        async with httpx.AsyncClient(timeout=60) as c:
            q = await c.put(f"{base}/mailboxes/by-name/jobs", json={"mode": "WORK"})
            assert q.status_code == 200, q.text
            runs = [(await c.post(f"{base}/scopes", json={"name": f"d{i}"})).json()["id"] for i in range(6)]
            assert {shard_of(members, r) for r in runs} == {0, 1, 2}
            for i, r in enumerate(runs):
                t = await c.post(f"{base}/tasks", json={"scopeId": r, "mailboxId": q.json()["id"], "taskKey": f"t{i}"})
                assert t.status_code == 200, t.text
            (jobs,) = (await c.get(f"{base}/mailboxes")).json()["mailboxes"]
            assert jobs["name"] == "jobs"
            page = (await c.get(f"{base}/events", params={"limit": 1000})).json()
            assert {e["eventId"].split(":")[0] for e in page["events"]} == {"0", "1", "2"}
            # the space "default" saw none of it
            assert (await c.get(f"http://127.0.0.1:{leader(members[0]).config.http[1]}/v1/spaces/default/mailboxes"
                                )).json()["mailboxes"] == []
        n.cancel_scope.cancel()


SDK02_WATCH = r'''
import asyncio, json
from runstate import AsyncRunstate

async def main():
    rs = AsyncRunstate(holder="watch-02")
    made = [(await rs.scopes.create(name=f"w{i}")).id for i in range(12)]
    seen, cursors = [], []
    async def watch():
        async for ev in rs.events.watch(types=["scope.created"], wait_seconds=5):
            seen.append(ev["aggregateId"]); cursors.append(ev["cursor"])
            if set(made) <= set(seen):
                return
    await asyncio.wait_for(watch(), 60)
    # a second watch from the last cursor sees only what came after it: one more run
    late = (await rs.scopes.create(name="late")).id
    after = []
    async for ev in rs.events.watch(cursor=cursors[-1], types=["scope.created"], wait_seconds=5):
        after.append(ev["aggregateId"])
        break
    print(json.dumps({"made": made, "seen": seen, "cursor": cursors[-1], "late": late, "after": after}))

asyncio.run(main())
'''


async def test_the_02_sdk_watches_the_whole_space_through_one_node(etcd, tmp_path, cluster_name):
    py = await trio.to_thread.run_sync(sdk_python, "0.2.0")
    async with trio.open_nursery() as n:
        members, secrets, _apps = await start_http_cluster(etcd, tmp_path, cluster_name, n)
        out = await run_sdk(py, base_of(members, 0), secrets["admin"], SDK02_WATCH, {})
        # (0.2 sends a random Idempotency-Key: its new runs go where their keys hash)
        assert len({shard_of(members, r) for r in out["made"]}) >= 2
        assert set(out["made"]) <= set(out["seen"]) and len(set(out["seen"])) == len(out["seen"])
        assert out["cursor"].count(":") == 3  # the vector cursor, passed back as the SDK got it
        assert out["after"] == [out["late"]]
        n.cancel_scope.cancel()
