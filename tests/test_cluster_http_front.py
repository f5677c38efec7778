"""A cluster's forwarders forward only what they route (issue 40): a standby's --http
(ClusterHttpApp: standby -> leader) and a sharded leader's (HttpRouter.forward: node ->
owning shard) build the URL from the peer's address and the request's path alone, drop
hop-by-hop and internal headers, never follow a redirect; and ``x-rallypoint-routed`` is
honoured only when another node signed that very request (a peerauth node token).

The attacker's inputs go over raw sockets (h11 and httpx would normalise a
request-target), and a trap listener on PORT shows nothing was sent there.
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
import trio

from rallypoint.cluster.forward import ClusterHttpApp, fenced_send, forward_headers, peer_url
from rallypoint.cluster.httproute import ROUTED_HEADER
from rallypoint.cluster.peerauth import make_token
from rallypoint.errors import NotLeaderError

from test_cluster_http_shards import SPACE, shard_of, start_http_cluster
from test_cluster_shards import leader
from test_http_front import HOSTILE_TARGETS, Trap, exchange, one_answer

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def cluster_name():
    return f"hf-{uuid.uuid4().hex[:10]}"


# ============================================================== the forwarder alone


class _StandbyOf:
    """What ClusterHttpApp reads of a member: a standby whose leader is at ``http_address``."""

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


async def _asgi(app, raw_path: bytes, headers=(), method="GET", body=b""):
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

    path, _, qs = raw_path.partition(b"?")
    scope = {"type": "http", "method": method, "path": path.decode("latin-1"), "raw_path": path,
             "query_string": qs, "headers": list(headers)}
    await app(scope, receive, send)
    return sent[0]["status"], dict(sent[0]["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


class _Recorder:
    """A fake leader: answers every request with ``status`` (and ``location``), keeping
    each request's target and headers."""

    def __init__(self, status=200, location=None):
        self.status, self.location = status, location
        self.requests: list[tuple[bytes, dict]] = []

    async def start(self, nursery) -> int:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        nursery.start_soon(trio.serve_listeners, self._handle, listeners)
        return listeners[0].socket.getsockname()[1]

    async def _handle(self, stream):
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            buf += chunk
        head = buf.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
        self.requests.append((head[0].split(b" ")[1],
                              {k.strip().lower(): v.strip() for k, v in (ln.split(b":", 1) for ln in head[1:])}))
        extra = b"location: %s\r\n" % self.location.encode() if self.location else b""
        await stream.send_all(b"HTTP/1.1 %d X\r\n%sconnection: close, x-secret-hop\r\nx-secret-hop: 1\r\n"
                              b"content-length: 2\r\n\r\n{}" % (self.status, extra))
        await stream.aclose()


@pytest.mark.parametrize("target", [t for t in HOSTILE_TARGETS if t != "*"])
async def test_the_forwarder_itself_refuses_a_target_that_is_not_a_path(target):
    # (behind the listener's guard as well: a ClusterHttpApp served without it still refuses)
    async with trio.open_nursery() as n:
        trap = Trap()
        tport = await trap.start(n)
        leader_port = await _Recorder().start(n)
        app = ClusterHttpApp(_StandbyOf(f"127.0.0.1:{leader_port}"), lambda node: None, wait_s=0.3)
        status, _, body = await _asgi(app, target.format(port=tport).encode())
        assert status == 400 and json.loads(body)["error"]["code"] == "VALIDATION_FAILED", body
        assert trap.connections == 0
        await app.aclose()
        n.cancel_scope.cancel()


async def test_the_forwarder_drops_hop_by_hop_and_internal_headers_and_never_follows_a_redirect():
    async with trio.open_nursery() as n:
        trap = Trap()
        tport = await trap.start(n)
        fake = _Recorder(status=302, location=f"http://127.0.0.1:{tport}/stolen")
        port = await fake.start(n)
        app = ClusterHttpApp(_StandbyOf(f"127.0.0.1:{port}"), lambda node: None, wait_s=0.3)
        headers = [(b"host", b"evil.example"), (b"connection", b"keep-alive, x-drop-me"), (b"x-drop-me", b"1"),
                   (b"x-rallypoint-routed", b"0"), (b"x-rallypoint-anything", b"1"), (b"te", b"trailers"),
                   (b"proxy-authorization", b"Basic eA=="), (b"upgrade", b"h2c"), (b"expect", b"100-continue"),
                   (b"authorization", b"Bearer k"), (b"idempotency-key", b"ik"), (b"x-forwarded-by", b"forged"),
                   (b"content-type", b"application/json")]
        status, out, body = await _asgi(app, b"/v1/spaces/default/scopes?x=%22a%22", headers, "POST", b"{}")
        assert status == 302 and out[b"location"] == f"http://127.0.0.1:{tport}/stolen".encode()
        assert b"x-secret-hop" not in out and b"connection" not in out  # hop-by-hop of the answer too
        assert trap.connections == 0  # the redirect was not followed
        (target, got), = fake.requests
        assert target == b"/v1/spaces/default/scopes?x=%22a%22"
        assert got[b"host"] == f"127.0.0.1:{port}".encode()
        assert got[b"authorization"] == b"Bearer k" and got[b"idempotency-key"] == b"ik"
        assert got[b"x-forwarded-by"] == b"b"
        for gone in (b"x-drop-me", b"x-rallypoint-routed", b"x-rallypoint-anything", b"te", b"proxy-authorization",
                     b"upgrade", b"expect"):
            assert gone not in got, gone
        await app.aclose()
        n.cancel_scope.cancel()


def test_peer_url_takes_the_host_from_the_address_only():
    scope = {"raw_path": b"/v1/spaces/a%2Fb/x", "query_string": b"y=1"}
    assert str(peer_url("10.0.0.1:8080", scope)) == "http://10.0.0.1:8080/v1/spaces/a%2Fb/x?y=1"
    assert str(peer_url("[::1]:8080", {"raw_path": b"/x"})) == "http://[::1]:8080/x"
    for raw in (b"@127.0.0.1:9/x", b"//127.0.0.1:9/x", b"http://127.0.0.1:9/x", b"/\\127.0.0.1/x"):
        with pytest.raises(ValueError):
            peer_url("10.0.0.1:8080", {"raw_path": raw})
    for address in ("10.0.0.1", "evil@10.0.0.1:80", "10.0.0.1:80/x", "h:port"):
        with pytest.raises(ValueError):
            peer_url(address, {"raw_path": b"/x"})
    assert forward_headers([("X-RallyPoint-Routed", "1"), ("accept", "*/*")]) == [(b"accept", b"*/*")]


# ===================================================== a standby's and a leader's --http


async def test_hostile_targets_to_a_standbys_and_a_sharded_leaders_http_are_400_and_port_receives_nothing(
        etcd, tmp_path, cluster_name):
    async with trio.open_nursery() as n:
        members, secrets, apps = await start_http_cluster(etcd, tmp_path, cluster_name, n, nodes=2)
        trap = Trap()
        tport = await trap.start(n)
        lead = leader(members[0])
        standby = next(m for m in members[0] if m is not lead)
        h = {"authorization": "Bearer " + secrets["admin"]}
        async with httpx.AsyncClient(timeout=60) as c:
            base = f"http://127.0.0.1:{lead.config.http[1]}/v1/spaces/{SPACE}"
            elsewhere = None  # a run of another shard: the leader would forward a request about it
            for i in range(12):
                r = await c.post(f"{base}/scopes", json={"name": f"r{i}"}, headers={**h, "idempotency-key": f"k{i}"})
                assert r.status_code == 200, r.text
                if shard_of(members, r.json()["id"]) != 0:
                    elsewhere = r.json()["id"]
                    break
            assert elsewhere is not None
        before = apps[0].routed()["forwarded"]
        forwarded_by_standby = sum(a.forwarded for a in apps.values())
        for port in (standby.config.http[1], lead.config.http[1]):
            for target in HOSTILE_TARGETS:
                t = target.format(port=tport)
                if "/v1/spaces/" in t:  # a path the leader routes to the other shard
                    t = t.replace("/v1/spaces/default/scopes", f"/v1/spaces/{SPACE}/scopes/{elsewhere}")
                method = "CONNECT" if t.startswith("127.") else ("OPTIONS" if t == "*" else "GET")
                req = (f"{method} {t} HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {secrets['admin']}\r\n"
                       f"\r\n").encode()
                status, _, body = one_answer(await exchange(port, req))
                assert status == 400, (port, t, body)
        assert trap.connections == 0
        assert apps[0].routed()["forwarded"] == before  # nothing reached the routing
        assert sum(a.forwarded for a in apps.values()) == forwarded_by_standby
        n.cancel_scope.cancel()


# ============================================================ x-rallypoint-routed


def _verifiers(app):
    return list(app._verifiers.values())


async def test_a_forged_x_rallypoint_routed_from_a_client_changes_nothing_and_a_signed_one_works(
        etcd, tmp_path, cluster_name):
    async with trio.open_nursery() as n:
        members, secrets, apps = await start_http_cluster(etcd, tmp_path, cluster_name, n)
        node0 = leader(members[0])
        base = f"http://127.0.0.1:{node0.config.http[1]}/v1/spaces/{SPACE}"
        h = {"authorization": "Bearer " + secrets["admin"]}
        secret = node0.node.service.node_secret
        assert secret
        async with httpx.AsyncClient(timeout=60) as c:
            # forged (the old mark, garbage, a token of another cluster): new root runs are
            # still spread over the shards, as a client's (a routed one would stay on 0)
            forged = ["0", "1", "rpnode1.h1a.0.000000000000000000000000." + "0" * 64,
                      make_token(secret, purpose="http", cluster="another", node="h1a", target="POST /x")]
            runs = []
            for i in range(9):
                r = await c.post(f"{base}/scopes", json={"name": f"f{i}"},
                                 headers={**h, ROUTED_HEADER: forged[i % len(forged)]})
                assert r.status_code == 200, r.text
                runs.append(r.json()["id"])
            assert {shard_of(members, r) for r in runs} == {0, 1, 2}
            # a run of another shard asked for with a forged mark: forwarded there (not run
            # natively as a routed request's op would be), and the mark not passed on
            other = next(r for r in runs if shard_of(members, r) != 0)
            routed = apps[0].routed()
            r = await c.get(f"{base}/scopes/{other}", headers={**h, ROUTED_HEADER: "0"})
            assert r.status_code == 200 and r.json()["id"] == other
            assert apps[0].routed()["forwarded"] == routed["forwarded"] + 1
            assert apps[0].routed()["native"] == routed["native"]
            owner = apps[shard_of(members, other)]
            (v,) = _verifiers(owner)
            assert v.refused == 0 and len(v._seen) >= 1  # the owner took node 0's signature
            (v0,) = _verifiers(apps[0])
            assert v0.refused >= 10
            # a request signed by a node (the cluster's secret) is honoured once: a new
            # root run stays on the shard it was sent to
            kept = []
            for i in range(6):
                body = json.dumps({"name": f"s{i}"}).encode()
                token = make_token(secret, purpose="http", cluster=cluster_name, node="h1a",
                                   target=f"POST /v1/spaces/{SPACE}/scopes", body=body)
                r = await c.post(f"{base}/scopes", content=body,
                                 headers={**h, "content-type": "application/json", ROUTED_HEADER: token})
                assert r.status_code == 200, r.text
                kept.append(r.json()["id"])
            assert {shard_of(members, r) for r in kept} == {0}
            refused = v0.refused
            r = await c.post(f"{base}/scopes", content=body,  # the last token again: a replay
                             headers={**h, "content-type": "application/json", ROUTED_HEADER: token})
            assert r.status_code == 200 and v0.refused == refused + 1
            # signed for another body: refused too
            r = await c.post(f"{base}/scopes", content=b'{"name": "other"}',
                             headers={**h, "content-type": "application/json",
                                      ROUTED_HEADER: make_token(secret, purpose="http", cluster=cluster_name,
                                                                node="h1a", target=f"POST /v1/spaces/{SPACE}/scopes",
                                                                body=body)})
            assert r.status_code == 200 and v0.refused == refused + 2
        n.cancel_scope.cancel()


async def test_an_answer_started_past_the_self_fence_is_503_and_a_stream_past_it_ends():
    """The leader's HTTP answers ask the self-fence before they start and before each
    chunk of a stream (SCALE-OUT §4.4 layer 2): a GET answered after the lapse is 503
    NOT_LEADER, a POST 503 UNAVAILABLE maybe_applied, an event stream ends; while the
    fence holds, everything passes as sent."""
    leading = [True]
    sent: list = []

    async def send(msg):
        sent.append(msg)

    ok = fenced_send(send, lambda: leading[0], "GET")
    await ok({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await ok({"type": "http.response.body", "body": b"{}"})
    assert [m.get("status") for m in sent] == [200, None] and sent[1]["body"] == b"{}"

    for method, code, detail in (("GET", "NOT_LEADER", "leader"), ("POST", "UNAVAILABLE", "maybe_applied")):
        sent.clear()
        leading[0] = False
        late = fenced_send(send, lambda: leading[0], method)
        await late({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"12")]})
        await late({"type": "http.response.body", "body": b'{"stale": 1}'})
        assert sent[0]["status"] == 503 and len(sent) == 2, sent
        err = json.loads(sent[1]["body"])["error"]
        assert err["code"] == code and detail in err["details"], err
        leading[0] = True

    sent.clear()
    stream = fenced_send(send, lambda: leading[0], "GET")
    await stream({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await stream({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
    leading[0] = False
    await stream({"type": "http.response.body", "body": b"data: 2\n\n", "more_body": True})
    await stream({"type": "http.response.body", "body": b"data: 3\n\n", "more_body": True})
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n", b""] and sent[-1]["more_body"] is False
