"""Two nodes of one replicated shard in one process, against a real etcd: who leads,
what a standby answers, a graceful hand-over, a leader cut off from its standby, and
a deposed leader that rejoins. (Crashes of real processes: tests/test_cluster_daemon.py.)"""

from __future__ import annotations

import uuid

import pytest
import trio

import rallypoint
from rallypoint.nodeconfig import StorageOptions
from rallypoint.cluster.member import MemberConfig, ShardMember
from rallypoint.errors import NotLeaderError, UnavailableError
from rallypoint.persistence.journal import read_journal
from rallypoint.transport.connection import Connection
from rallypoint.transport.server import Server

pytestmark = pytest.mark.timeout(90)


def member(etcd, tmp_path, name, cluster, **kw):
    cfg = MemberConfig(etcd=etcd.endpoints, node=name, data_dir=str(tmp_path / name), cluster=cluster,
                       client=("127.0.0.1", 0), replication=("127.0.0.1", 0), isr_timeout_s=0.5,
                       storage=StorageOptions(sync_helper="thread"), **kw)
    return ShardMember(cfg, make_server=lambda d: Server(d))


async def wait_until(pred, timeout=30.0):
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.01)


@pytest.fixture
def cluster_name(request):
    return f"t-{uuid.uuid4().hex[:10]}"


async def test_one_node_leads_the_other_follows_and_a_graceful_stop_hands_over(etcd, tmp_path, cluster_name):
    a = member(etcd, tmp_path, "a", cluster_name)
    b = member(etcd, tmp_path, "b", cluster_name)
    async with trio.open_nursery() as n:
        await n.start(a.run)
        await a.wait_role("leader")  # the first node creates the shard and leads it
        await n.start(b.run)
        await b.wait_role("standby")
        await wait_until(lambda: a.replication.isr_store.isr == ["a", "b"])
        # a standby answers the handshake NOT_LEADER, naming the leader...
        with pytest.raises(NotLeaderError) as e:
            await Connection.open(f"tcp://127.0.0.1:{b.client_port}")
        assert e.value.details["leader"]["node"] == "a"
        assert e.value.details["leader"]["address"] == f"127.0.0.1:{a.client_port}"
        # ...and the SDK goes there
        async with rallypoint.connect(f"tcp://127.0.0.1:{b.client_port}", reconnect=False) as rs:
            assert rs._transport.server_info.epoch == a.epoch
            await rs.scopes.create(name="redirected")
        async with rallypoint.connect(f"tcp://127.0.0.1:{a.client_port}", reconnect=False) as rs:
            run = await rs.scopes.create(name="before")
            jobs = await rs.mailboxes.ensure("jobs")
            task = await jobs.submit({"n": 1}, scope=run)
            assert rs._transport.server_info.epoch == a.epoch
            epoch_a = a.epoch
        a.stop()  # graceful: b must hold every record, then a resigns
        await b.wait_role("leader")
        assert b.epoch > epoch_a
        async with rallypoint.connect(f"tcp://127.0.0.1:{b.client_port}", reconnect=False) as rs:
            st = await rs.task(task.id).status()
            assert st.state == "QUEUED"
            assert (await rs.scope(run.id).status()).state == "ACTIVE"
        await a.wait_role("stopped")
        n.cancel_scope.cancel()
    ja, jb = dict(read_journal(str(tmp_path / "a"))), dict(read_journal(str(tmp_path / "b")))
    assert all(ja[lsn] == jb[lsn] for lsn in set(ja) & set(jb))
    assert max(ja) <= max(jb)


async def test_a_leader_cut_off_from_its_standby_shrinks_the_isr_and_goes_on(etcd, tmp_path, cluster_name):
    a = member(etcd, tmp_path, "a", cluster_name)
    b = member(etcd, tmp_path, "b", cluster_name)
    async with trio.open_nursery() as n:
        await n.start(a.run)
        await a.wait_role("leader")
        await n.start(b.run)
        await wait_until(lambda: a.replication.isr_store.isr == ["a", "b"])
        async with rallypoint.connect(f"tcp://127.0.0.1:{a.client_port}", reconnect=False) as rs:
            await rs.scopes.create(name="in-sync")
            # the standby stops: a keeps acknowledging once the ISR in etcd says a alone
            b_scope = b.standby
            assert b_scope is not None
            n2_cancel = trio.CancelScope()
            b.stop()
            await b.wait_role("stopped")
            await rs.scopes.create(name="alone")
            assert a.replication.isr_store.isr == ["a"]
            replicas = await _read_replicas(etcd, cluster_name)
            assert replicas.isr == ["a"] and "b" in replicas.members
            del n2_cancel
        n.cancel_scope.cancel()


async def test_min_insync_2_refuses_writes_until_the_standby_is_in_sync(etcd, tmp_path, cluster_name):
    a = member(etcd, tmp_path, "a", cluster_name, min_insync=2)
    b = member(etcd, tmp_path, "b", cluster_name, min_insync=2)
    async with trio.open_nursery() as n:
        await n.start(a.run)
        await a.wait_role("leader")
        async with rallypoint.connect(f"tcp://127.0.0.1:{a.client_port}", reconnect=False) as rs:
            with pytest.raises(UnavailableError):
                await rs.scopes.create(name="alone")
            await n.start(b.run)
            await wait_until(lambda: a.replication.isr_store.isr == ["a", "b"])
            await rs.scopes.create(name="replicated")
        n.cancel_scope.cancel()


async def _read_replicas(etcd, cluster_name):
    from rallypoint.cluster.etcd import EtcdClient
    from rallypoint.cluster.leader import ShardElection

    async with EtcdClient(etcd.endpoints) as client:
        rec = await ShardElection(client, cluster_name, 0).read_replicas()
    return rec.replicas


async def test_a_client_given_every_address_follows_the_leader_and_consume_goes_on(etcd, tmp_path, cluster_name):
    a = member(etcd, tmp_path, "a", cluster_name)
    b = member(etcd, tmp_path, "b", cluster_name)
    runs: dict[int, int] = {}
    async with trio.open_nursery() as n:
        await n.start(a.run)
        await a.wait_role("leader")
        await n.start(b.run)
        await wait_until(lambda: a.replication.isr_store.isr == ["a", "b"])
        # the standby first: its NOT_LEADER names the leader, the client goes there
        url = f"tcp://127.0.0.1:{b.client_port},127.0.0.1:{a.client_port}"
        async with rallypoint.connect(url) as rs:
            assert rs._transport.server_info.epoch == a.epoch
            run = await rs.scopes.create(name="work")
            jobs = await rs.mailboxes.ensure("jobs")
            tickets = [await jobs.submit({"i": i}, scope=run, key=f"k{i}") for i in range(40)]
            handed = trio.Event()

            async def handler(d):
                i = d.input["i"]
                runs[i] = runs.get(i, 0) + 1
                if i == 10:
                    a.stop()  # a graceful hand-over while deliveries are in flight
                    await b.wait_role("leader")
                    handed.set()
                return {"i": i}

            async def worker():
                await rallypoint.consume(rs, jobs, run, handler, concurrency=4, lease_seconds=10, wait=1)

            n.start_soon(worker)
            await handed.wait()
            for i, t in enumerate(tickets):
                res = await rs.task(t.id).result(timeout=60)
                assert (res.state, res.outcome) == ("SUCCEEDED", {"i": i})
            assert rs._transport.server_info.epoch == b.epoch
            assert sorted(runs) == list(range(40))
            assert all(v == 1 for v in runs.values()), runs  # nothing done twice
            await run.cancel()
        n.cancel_scope.cancel()


async def test_cluster_status_and_server_status_show_leader_epoch_isr_and_the_standby(etcd, tmp_path, cluster_name):
    import json
    import subprocess
    import sys

    a = member(etcd, tmp_path, "a", cluster_name)
    b = member(etcd, tmp_path, "b", cluster_name)
    async with trio.open_nursery() as n:
        await n.start(a.run)
        await a.wait_role("leader")
        await n.start(b.run)
        await wait_until(lambda: a.replication.isr_store.isr == ["a", "b"])
        async with rallypoint.connect(f"tcp://127.0.0.1:{a.client_port}", reconnect=False) as rs:
            st = await rs.status()
        c = st.cluster
        assert (c.node, c.role, c.epoch, c.isr, c.members) == ("a", "leader", a.epoch, ["a", "b"], ["a", "b"])
        assert c.standby.node == "b" and c.standby.state == "in_sync" and 0 < c.lease_time_left_s <= 2
        args = [sys.executable, "-m", "rallypoint", "cluster", "status", "--cluster", etcd.endpoints[0],
                "--cluster-name", cluster_name]
        out = await trio.to_thread.run_sync(lambda: subprocess.run(args, capture_output=True, text=True, timeout=60))
        assert out.returncode == 0, out.stderr
        assert f"leader      a at 127.0.0.1:{a.client_port}" in out.stdout and f"epoch {a.epoch}" in out.stdout
        assert "in sync     a b" in out.stdout and "standby     b: in_sync" in out.stdout
        out = await trio.to_thread.run_sync(
            lambda: subprocess.run(args + ["--json"], capture_output=True, text=True, timeout=60))
        (doc,) = json.loads(out.stdout)["shards"]  # every shard (one here)
        assert doc["leader"]["node"] == "a" and doc["isr"] == ["a", "b"] and doc["node"]["standby"]["node"] == "b"
        assert doc["node"]["leading_for_s"] >= 0
        # Prometheus: each node's role, epoch and its side of replication
        from prometheus_client import generate_latest
        from rallypoint.metrics import ClusterMetrics

        ta = generate_latest(ClusterMetrics(a).registry()).decode()
        tb = generate_latest(ClusterMetrics(b).registry()).decode()
        assert 'rallypoint_cluster_role{role="leader"} 1.0' in ta and f"rallypoint_cluster_epoch {float(a.epoch)}" in ta
        assert "rallypoint_cluster_standby_in_sync 1.0" in ta and "rallypoint_cluster_isr_size 2.0" in ta
        assert 'rallypoint_cluster_role{role="standby"} 1.0' in tb and "rallypoint_cluster_applied_lsn" in tb
        n.cancel_scope.cancel()


async def _http_member(etcd, tmp_path, name, cluster_name, nursery):
    """A member with its HTTP port served as `serve --cluster --http` does."""
    import functools

    from rallypoint.cluster.forward import ClusterHttpApp
    from rallypoint.http import serve_http
    from rallypoint.http.app import HttpApi

    m = member(etcd, tmp_path, name, cluster_name)
    app = ClusterHttpApp(m, lambda node: HttpApi(node.service))
    _api, urls = await nursery.start(functools.partial(serve_http, None, "127.0.0.1", 0, api=app))
    m.config.http = ("127.0.0.1", int(urls[0].rsplit(":", 1)[1]))
    await nursery.start(m.run)
    return m, app, urls[0]


async def test_every_node_serves_http_a_standby_forwards_to_the_leader(etcd, tmp_path, cluster_name):
    import httpx

    async with trio.open_nursery() as n:
        a, app_a, url_a = await _http_member(etcd, tmp_path, "a", cluster_name, n)
        await a.wait_role("leader")
        b, app_b, url_b = await _http_member(etcd, tmp_path, "b", cluster_name, n)
        await b.wait_role("standby")
        await wait_until(lambda: a.replication.isr_store.isr == ["a", "b"])
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.post(f"{url_b}/v1/spaces/default/scopes", json={"name": "via-b"})
            assert r.status_code in (200, 201), r.text
            run_id = r.json()["id"]
            assert run_id in a.node.coordinator.runs.table  # made on the leader
            await wait_until(lambda: app_b.forwarded == 1)
            assert app_a.forwarded == 0 and app_b.failed == 0
            # an error answer comes back unchanged
            r = await http.get(f"{url_b}/v1/spaces/default/scopes/scp_nope")
            assert r.status_code == 404 and r.json()["error"]["code"] == "NOT_FOUND"
            a.stop()
            await b.wait_role("leader")
            # the same base URL, now served by b itself
            r = await http.get(f"{url_b}/v1/spaces/default/scopes/{run_id}")
            assert r.status_code == 200 and r.json()["id"] == run_id
            assert app_b.forwarded == 2  # served by b itself: no forward since
        n.cancel_scope.cancel()


async def test_a_leader_past_its_self_fence_deadline_answers_not_leader_before_its_fence_task_runs(
        etcd, tmp_path, cluster_name):
    # SCALE-OUT.md §4.4 layer 2: a process resumed after a stop past its lease reads the
    # requests that waited in its socket in the same batch in which its fence task wakes;
    # the client port checks the deadline at each request, so none is answered from the
    # stale state (found by tests/test_cluster_daemon.py: a read was answered)
    from rallypoint.testing.proxy import Proxy

    async with trio.open_nursery() as n:
        host, port = etcd.endpoints[0].rsplit("//", 1)[1].split(":")
        proxy = Proxy(host, int(port))
        pport = await n.start(proxy.run)
        cfg = MemberConfig(etcd=[f"http://127.0.0.1:{pport}"], node="a", data_dir=str(tmp_path / "a"),
                           cluster=cluster_name, client=("127.0.0.1", 0), replication=("127.0.0.1", 0),
                           storage=StorageOptions(sync_helper="thread"))
        a = ShardMember(cfg, make_server=lambda d: Server(d))
        await n.start(a.run)
        await a.wait_role("leader")
        async with rallypoint.connect(f"tcp://127.0.0.1:{a.client_port}", reconnect=False) as rs:
            run = await rs.scopes.create(name="before")
            # etcd out of reach (no keepalive answer moves the deadline), then the
            # deadline passes while the fence task still sleeps towards the old one
            proxy.set_mode("hold")
            await trio.testing.wait_all_tasks_blocked(0.05)
            lead = a.leadership
            lead._fence_deadline = trio.current_time() - 0.001
            assert lead.lost_reason is None  # the fence task has not run
            with pytest.raises(NotLeaderError) as e:
                await rs.scope(run.id).status()
            assert e.value.details["leader"] is None and e.value.details["epoch"] == lead.epoch
            with pytest.raises(NotLeaderError):
                await rs.scopes.create(name="after")
            with pytest.raises(NotLeaderError):
                await Connection.open(f"tcp://127.0.0.1:{a.client_port}")
            assert lead.lost_reason is None
        n.cancel_scope.cancel()


async def test_a_client_refused_not_leader_by_a_fenced_leader_sends_the_request_to_the_new_leader(
        etcd, tmp_path, cluster_name):
    # NOT_LEADER is a refusal before anything was applied: the client goes to the leader
    # and sends the request there, even one it may not re-send after a dropped connection
    from rallypoint.testing.proxy import Proxy

    async with trio.open_nursery() as n:
        host, port = etcd.endpoints[0].rsplit("//", 1)[1].split(":")
        proxy = Proxy(host, int(port))
        pport = await n.start(proxy.run)
        cfg = MemberConfig(etcd=[f"http://127.0.0.1:{pport}"], node="a", data_dir=str(tmp_path / "a"),
                           cluster=cluster_name, client=("127.0.0.1", 0), replication=("127.0.0.1", 0),
                           isr_timeout_s=0.5, storage=StorageOptions(sync_helper="thread"))
        a = ShardMember(cfg, make_server=lambda d: Server(d))
        b = member(etcd, tmp_path, "b", cluster_name)
        await n.start(a.run)
        await a.wait_role("leader")
        await n.start(b.run)
        await wait_until(lambda: a.replication.isr_store.isr == ["a", "b"])
        async with rallypoint.connect(f"tcp://127.0.0.1:{a.client_port},127.0.0.1:{b.client_port}") as rs:
            run = await rs.scopes.create(name="before")
            epoch_a = rs._transport.server_info.epoch
            proxy.set_mode("hold")  # a cannot renew its lease; b takes over once it expires
            await trio.testing.wait_all_tasks_blocked(0.05)
            a.leadership._fence_deadline = trio.current_time() - 0.001
            st = await rs.scope(run.id).status()  # a read
            assert st.state == "ACTIVE"
            assert rs._transport.server_info.epoch == b.epoch > epoch_a
            created = await rs.scopes.create(name="after")  # not re-sent after a drop; after NOT_LEADER, yes
            assert created.id != run.id
        n.cancel_scope.cancel()


class _StandbyOf:
    """What ClusterHttpApp reads of a member: a standby of node a, whose leader record
    names ``http_address``."""

    def __init__(self, http_address):
        from types import SimpleNamespace

        self.config = SimpleNamespace(node="b", shard=0)
        self.role = "standby"
        self.node = None
        self.leader = SimpleNamespace(epoch=5, info=SimpleNamespace(node="a", http_address=http_address))

    async def wait_leader_change(self):
        await trio.sleep_forever()

    def not_leader_error(self):
        return NotLeaderError("no leader", retry_after=0.5, details={"shard": 0, "epoch": 5, "leader": None})


async def _asgi_post(app, path="/v1/spaces/default/scopes", body=b'{"name": "x"}'):
    sent = []
    first = True

    async def receive():
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": body, "more_body": False}
        await trio.sleep_forever()

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"content-type", b"application/json")]}
    await app(scope, receive, send)
    status = sent[0]["status"]
    data = b"".join(m.get("body", b"") for m in sent[1:])
    return status, data


async def test_http_forwarding_answers_503_json_when_the_leader_resets_or_refuses_the_connection():
    # found by the runstate SDK failover test: the httpx error left the forwarding
    # nursery inside an ExceptionGroup, so no handler caught it and hypercorn answered an
    # empty 500 the SDK could not read
    import json
    import socket
    import struct

    from rallypoint.cluster.forward import ClusterHttpApp

    async def reset_after_request(stream):
        await stream.receive_some(65536)
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()

    async with trio.open_nursery() as n:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        await n.start(trio.serve_listeners, reset_after_request, listeners)
        app = ClusterHttpApp(_StandbyOf(f"127.0.0.1:{port}"), lambda node: None, wait_s=0.3)
        status, data = await _asgi_post(app)
        assert status == 503
        err = json.loads(data)["error"]
        assert err["code"] == "UNAVAILABLE" and err["details"]["maybe_applied"] is True
        # a leader address that refuses connections: not sent, so NOT_LEADER once no other came
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        dead = closed.getsockname()[1]
        closed.close()
        app = ClusterHttpApp(_StandbyOf(f"127.0.0.1:{dead}"), lambda node: None, wait_s=0.3)
        status, data = await _asgi_post(app)
        assert status == 503 and json.loads(data)["error"]["code"] == "NOT_LEADER"
        await app.aclose()
        n.cancel_scope.cancel()


async def test_a_graceful_stop_answers_parked_waits_without_the_grace(etcd, tmp_path, cluster_name):
    # issue 42 item 8: a SIGTERM hand-over drained with the single node's 1 s grace for
    # parked waits: a consume() worker (a parked receive) held the resignation back and
    # workers and producers paused 1.2 s (scripts/bench_failover.py --handover measures
    # it). The leader's drain passes wait_grace=0: the wait is answered at once.
    drains: list = []

    class Recording(Server):
        async def drain(self, timeout=30.0, wait_grace=None):
            drains.append(wait_grace)
            await super().drain(timeout, wait_grace)

    cfg = MemberConfig(etcd=etcd.endpoints, node="a", data_dir=str(tmp_path / "a"), cluster=cluster_name,
                       client=("127.0.0.1", 0), replication=("127.0.0.1", 0), isr_timeout_s=0.5,
                       storage=StorageOptions(sync_helper="thread"))
    a = ShardMember(cfg, make_server=lambda d: Recording(d, drain_wait_grace=30.0))
    async with trio.open_nursery() as n:
        await n.start(a.run)
        await a.wait_role("leader")
        async with rallypoint.connect(f"tcp://127.0.0.1:{a.client_port}", reconnect=False) as rs:
            run = await rs.scopes.create(name="parked")
            jobs = await rs.mailboxes.ensure("jobs")
            got: list = []

            async def parked() -> None:
                try:
                    await jobs.receive(run, wait=60)
                except UnavailableError as e:
                    got.append(e)

            async with trio.open_nursery() as inner:
                inner.start_soon(parked)
                with trio.fail_after(10):
                    while a.server.statistics()["inflight"] < 1:
                        await trio.sleep(0.01)
                a.stop()
                with trio.fail_after(10):  # (the server's own grace here: 30 s)
                    await a.wait_role("stopped")
        assert drains == [0.0] and len(got) == 1, (drains, got)
        n.cancel_scope.cancel()
