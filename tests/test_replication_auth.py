"""The replication link lets no one in (issue 40): both ends prove the cluster secret on
every connection (and, with peer TLS, a certificate of the cluster's CA naming the node
they claim to be) before anything of the shard is sent or taken.

The inputs are the attack as it was found: a process that connects to a leader's
replication address and sends a Hello naming the shard and the standby's node (``b``)
with every field a real peer sends, but no credential. It used to be sent the whole
journal, take the standby's place in the in-sync set and acknowledge frames it never
stored. Real daemons under load with the impostor looping, then kill -9 of the leader:
tests/test_cluster_daemon.py (``..._with_an_impostor_on_the_replication_port``).
"""

from __future__ import annotations

import functools
import os

import pytest
import trio
import trio.testing

from rallypoint.cluster.member import MemberConfig, ShardMember
from rallypoint.cluster.peerauth import PeerTls, TokenVerifier, link_proof, make_token, verify_link_proof
from rallypoint.cluster.pki import write_cluster_pki
from rallypoint.errors import UnauthenticatedError, ValidationError
from rallypoint.node import recovered
from rallypoint.replication import LinkClosed, running_as_standby, wire
from rallypoint.replication.auth import LinkAuth, Unauthenticated
from rallypoint.replication.leader import MAX_HANDSHAKES_PER_HOST
from rallypoint.replication.link import Link
from rallypoint.testing.impostor import TRICKS, Impostor

from test_replication import AUTH, SNAP, FakeIsr, Leader, follow, wait_until, workload

pytestmark = pytest.mark.timeout(120)


async def test_an_impostor_naming_the_standby_without_the_secret_gets_no_frame_and_changes_nothing(tmp_path):
    log = []
    async with trio.open_nursery() as n:
        leader = await n.start(Leader(tmp_path / "a", epoch=10, log=log).run)
        await workload(leader.client)
        async with recovered(str(tmp_path / "b"), "fsync", clock=None, interval_ms=10, sync_helper="thread") as rb:
            async with running_as_standby(rb, node="b", cluster="c", shard=0, auth=AUTH, **SNAP) as sb:
                n.start_soon(follow, sb, leader.port, 10)
                await wait_until(lambda: leader.isr.isr == ["a", "b"] and leader.repl.peer is not None
                                 and leader.repl.peer.state == "in_sync")
                real_peer = leader.repl.peer
                isr_writes = list(log)
                imp = Impostor("127.0.0.1", leader.port, cluster="c", shard=0, node="b", pause_s=0)
                # every trick, twice; "no-proof" waits out the leader's handshake timeout
                leader.repl.auth.handshake_timeout_s = 0.5
                await imp.run(rounds=2 * len(TRICKS))
                assert imp.connections == 2 * len(TRICKS)
                assert imp.frames == 0 and imp.welcomes == 0, imp.got
                assert imp.challenges >= 2 * (len(TRICKS) - 2)  # (ack-first and big-hello get none)
                # nothing changed: the same standby session, in sync; no in-sync set write
                assert leader.repl.peer is real_peer and real_peer.state == "in_sync"
                assert leader.isr.isr == ["a", "b"] and log == isr_writes
                assert leader.repl.stats["refused"] == 2 * len(TRICKS)
                assert leader.repl.stats["sessions"] == 1
                # and acknowledgement still waits for the real standby, which holds it
                await leader.client.scopes.create(name="after-the-impostor")
                await wait_until(lambda: sb.applied_lsn == leader.coord.journal.last_lsn)
                n.cancel_scope.cancel()


async def test_a_standby_with_another_secret_is_refused_and_gets_nothing(tmp_path):
    log = []
    async with trio.open_nursery() as n:
        leader = await n.start(Leader(tmp_path / "a", epoch=10, log=log).run)
        await workload(leader.client)
        other = LinkAuth("not-the-cluster-secret", cluster="c", shard=0)
        async with recovered(str(tmp_path / "b"), "fsync", clock=None, interval_ms=10, sync_helper="thread") as rb:
            before = rb.coordinator.journal.last_lsn
            async with running_as_standby(rb, node="b", cluster="c", shard=0, auth=other, **SNAP) as sb:
                # the leader's Challenge does not check with this secret: the standby stops there
                with pytest.raises(Unauthenticated, match="did not prove the cluster secret"):
                    await follow(sb, leader.port, 10)
            assert rb.coordinator.journal.last_lsn == before
        assert leader.repl.peer is None and leader.isr.isr == ["a"] and log == []
        n.cancel_scope.cancel()


async def test_a_fake_leader_without_the_secret_feeds_a_standby_no_frame(tmp_path):
    fake_auth = LinkAuth("a-guess", cluster="c", shard=0)
    async with recovered(str(tmp_path / "b"), "fsync", clock=None, interval_ms=10, sync_helper="thread") as rb:
        journal = rb.coordinator.journal
        async with running_as_standby(rb, node="b", cluster="c", shard=0, auth=AUTH, **SNAP) as sb:
            # 1. a wrong proof in its Challenge
            left, right = trio.testing.memory_stream_pair()

            async def fake_with_wrong_secret():
                try:
                    link = (await fake_auth.accept(right, node="a", epoch=10)).link
                    await link.send(wire.Welcome(epoch=10, leader="a", from_lsn=1))
                except LinkClosed:
                    pass

            async with trio.open_nursery() as n:
                n.start_soon(fake_with_wrong_secret)
                with pytest.raises(Unauthenticated, match="did not prove the cluster secret"):
                    await sb.follow(left, 10, leader="a")
            # 2. no Challenge at all: straight to Welcome and frames
            left, right = trio.testing.memory_stream_pair()

            async def fake_without_challenge():
                link = Link(right, "leader")
                await link.receive()
                try:
                    await link.send(wire.Welcome(epoch=10, leader="a", from_lsn=1))
                    await link.send(wire.Frames(epoch=10, first_lsn=1, count=0, data=b"", mono_ms=1, wall_ms=1))
                except LinkClosed:
                    pass

            async with trio.open_nursery() as n:
                n.start_soon(fake_without_challenge)
                with pytest.raises(Unauthenticated, match="expected Challenge"):
                    await sb.follow(left, 10, leader="a")
            assert journal.last_lsn == 0 and sb.records == 0


async def test_a_proof_sniffed_on_one_connection_is_refused_on_another(tmp_path):
    # a passive attacker saw a real standby's Hello and Proof: replaying them on a new
    # connection fails, because the leader's nonce is new every time
    log = []
    async with trio.open_nursery() as n:
        leader = await n.start(Leader(tmp_path / "a", epoch=10, log=log).run)
        seen: dict[str, object] = {}

        async def tap(client_side, server_port):
            """Relay one connection, keeping what the standby sent."""
            upstream = await trio.open_tcp_stream("127.0.0.1", server_port)
            async def up():
                from rallypoint.transport.framing import FrameParser
                import msgspec

                parser = FrameParser(max_frame=1 << 20)
                dec = msgspec.msgpack.Decoder(wire.StandbyMessage)
                while data := await client_side.receive_some(1 << 16):
                    for f in parser.feed(data):
                        m = dec.decode(f)
                        seen.setdefault(type(m).__name__, m)
                    await upstream.send_all(data)

            async def down():
                while data := await upstream.receive_some(1 << 16):
                    await client_side.send_all(data)

            try:
                async with trio.open_nursery() as t:
                    t.start_soon(up)
                    t.start_soon(down)
            except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass

        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        tport = listeners[0].socket.getsockname()[1]
        n.start_soon(trio.serve_listeners, lambda s: tap(s, leader.port), listeners)
        async with recovered(str(tmp_path / "b"), "fsync", clock=None, interval_ms=10, sync_helper="thread") as rb:
            async with running_as_standby(rb, node="b", cluster="c", shard=0, auth=AUTH, **SNAP) as sb:
                n.start_soon(functools.partial(follow, sb, tport, 10, leader="a"))
                await wait_until(lambda: "Proof" in seen and leader.isr.isr == ["a", "b"])
                real = leader.repl.peer
                link = Link(await trio.open_tcp_stream("127.0.0.1", leader.port), "standby")
                await link.send(seen["Hello"])  # the same nonce, the same fields
                ch = await link.receive()
                assert isinstance(ch, wire.Challenge)
                await link.send(seen["Proof"])
                refusal = await link.receive()
                assert isinstance(refusal, wire.Refuse) and refusal.code == "UNAUTHENTICATED"
                await link.aclose()
                assert leader.repl.peer is real and leader.repl.stats["sessions"] == 1
                n.cancel_scope.cancel()


def test_a_link_proof_binds_every_field():
    base = dict(role="standby", cluster="c", shard=0, node="b", epoch=10, standby_nonce=b"s" * 16,
                leader_nonce=b"l" * 16)
    proof = link_proof("k", **base)
    assert verify_link_proof(proof, "k", **base)
    for field, other in [("role", "leader"), ("cluster", "d"), ("shard", 1), ("node", "a"), ("epoch", 11),
                         ("standby_nonce", b"t" * 16), ("leader_nonce", b"m" * 16)]:
        assert not verify_link_proof(proof, "k", **{**base, field: other}), field
    assert not verify_link_proof(proof, "other-secret", **base)
    with pytest.raises(ValueError):
        link_proof("k", **{**base, "standby_nonce": b""})


async def test_silent_connections_of_one_address_cannot_take_every_handshake_slot(tmp_path):
    log = []
    async with trio.open_nursery() as n:
        leader = await n.start(Leader(tmp_path / "a", epoch=10, log=log).run)
        held = [await trio.open_tcp_stream("127.0.0.1", leader.port) for _ in range(MAX_HANDSHAKES_PER_HOST)]
        await wait_until(lambda: sum(leader.repl._handshakes.values()) == MAX_HANDSHAKES_PER_HOST)
        one_more = await trio.open_tcp_stream("127.0.0.1", leader.port)
        with trio.fail_after(10):
            assert await one_more.receive_some(100) == b""  # closed at once, not held
        for s in held + [one_more]:
            await s.aclose()
        await wait_until(lambda: not leader.repl._handshakes)
        n.cancel_scope.cancel()


# ---------------------------------------------------------------------------- peer TLS
@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("pki"))
    write_cluster_pki(d, ["a", "b", "c3"])
    other = os.path.join(d, "other")
    write_cluster_pki(other, ["b"])  # another CA's "b"
    return d


def _tls(pki, node, ca_dir=None):
    d = ca_dir or pki
    return PeerTls(os.path.join(d, f"{node}.pem"), os.path.join(d, f"{node}.key"), os.path.join(pki, "ca.pem"))


async def _tls_leader(n, tmp_path, pki, log, cert_node="a"):
    import test_replication as tr

    auth = LinkAuth("test-cluster-secret", cluster="c", shard=0, tls=_tls(pki, cert_node))
    saved = tr.AUTH
    tr.AUTH = auth  # the Leader helper reads the module's AUTH when it starts
    try:
        return await n.start(Leader(tmp_path / "a", epoch=10, log=log).run)
    finally:
        tr.AUTH = saved


async def test_peer_tls_takes_a_standby_whose_certificate_names_it(tmp_path, pki):
    log = []
    async with trio.open_nursery() as n:
        leader = await _tls_leader(n, tmp_path, pki, log)
        await workload(leader.client)
        auth = LinkAuth("test-cluster-secret", cluster="c", shard=0, tls=_tls(pki, "b"))
        async with recovered(str(tmp_path / "b"), "fsync", clock=None, interval_ms=10, sync_helper="thread") as rb:
            async with running_as_standby(rb, node="b", cluster="c", shard=0, auth=auth, **SNAP) as sb:
                n.start_soon(functools.partial(follow, sb, leader.port, 10, leader="a"))
                await wait_until(lambda: leader.isr.isr == ["a", "b"])
                await wait_until(lambda: sb.applied_lsn == leader.coord.journal.last_lsn)
                assert leader.repl.peer is not None and leader.repl.peer.node == "b"
                assert leader.repl.stats["refused"] == 0 and log == [("isr", ("a", "b"))]
        n.cancel_scope.cancel()


@pytest.mark.parametrize("case", ["plaintext", "another-ca", "another-nodes-cert"])
async def test_peer_tls_refuses_a_standby_without_a_certificate_naming_it(tmp_path, pki, case):
    log = []
    async with trio.open_nursery() as n:
        leader = await _tls_leader(n, tmp_path, pki, log)
        tls = {"plaintext": None, "another-ca": PeerTls(*(os.path.join(pki, "other", f) for f in
                                                         ("b.pem", "b.key", "ca.pem"))),
               "another-nodes-cert": _tls(pki, "c3")}[case]
        auth = LinkAuth("test-cluster-secret", cluster="c", shard=0, tls=tls)
        async with recovered(str(tmp_path / "b"), "fsync", clock=None, interval_ms=10, sync_helper="thread") as rb:
            async with running_as_standby(rb, node="b", cluster="c", shard=0, auth=auth, **SNAP) as sb:
                with pytest.raises(LinkClosed):
                    with trio.fail_after(20):
                        await follow(sb, leader.port, 10, leader="a")
                assert rb.coordinator.journal.last_lsn == 0
        await wait_until(lambda: leader.repl.stats["refused"] >= 1)
        assert leader.repl.peer is None and log == []
        n.cancel_scope.cancel()


async def test_peer_tls_a_standby_refuses_a_leader_whose_certificate_is_another_nodes(tmp_path, pki):
    log = []
    async with trio.open_nursery() as n:
        leader = await _tls_leader(n, tmp_path, pki, log, cert_node="c3")  # etcd says "a" leads
        auth = LinkAuth("test-cluster-secret", cluster="c", shard=0, tls=_tls(pki, "b"))
        async with recovered(str(tmp_path / "b"), "fsync", clock=None, interval_ms=10, sync_helper="thread") as rb:
            async with running_as_standby(rb, node="b", cluster="c", shard=0, auth=auth, **SNAP) as sb:
                with pytest.raises(Unauthenticated, match="TLS to the leader 'a' failed"):
                    await follow(sb, leader.port, 10, leader="a")
        n.cancel_scope.cancel()


# ---------------------------------------------------------------------------- node config
@pytest.mark.parametrize("where", ["replication", "advertise", "advertise_replication"])
def test_a_plaintext_link_on_a_public_address_is_refused_unless_insecure(tmp_path, where):
    kw = {"replication": ("0.0.0.0", 0)} if where == "replication" else (
        {"advertise_host": "10.1.2.3"} if where == "advertise" else {"advertise_replication": "10.1.2.3:7000"})
    cfg = MemberConfig(etcd=["http://127.0.0.1:2379"], node="a", data_dir=str(tmp_path), **kw)
    with pytest.raises(ValidationError, match="not a loopback address and the replication link has no TLS"):
        ShardMember(cfg, make_server=lambda d: None)
    ShardMember(MemberConfig(etcd=["x"], node="a", data_dir=str(tmp_path), insecure=True, **kw),
                make_server=lambda d: None)


def test_a_peer_tls_set_up_serves_a_public_address(tmp_path, pki):
    cfg = MemberConfig(etcd=["x"], node="a", data_dir=str(tmp_path), replication=("0.0.0.0", 0),
                       peer_tls=_tls(pki, "a"))
    m = ShardMember(cfg, make_server=lambda d: None)  # (without TLS: refused, the test above)
    assert m.config.replication == ("0.0.0.0", 0) and m.config.peer_tls is cfg.peer_tls


def test_a_peer_certificate_that_does_not_name_the_node_is_refused_at_start(tmp_path, pki):
    cfg = MemberConfig(etcd=["x"], node="b", data_dir=str(tmp_path), peer_tls=_tls(pki, "a"))
    with pytest.raises(ValidationError, match="does not name node 'b'"):
        ShardMember(cfg, make_server=lambda d: None)


# ---------------------------------------------------------------------------- node tokens
def test_a_node_token_checks_once_for_its_target_within_its_window():
    now = [1_000_000.0]
    v = TokenVerifier("s", "c", window_s=60, clock=lambda: now[0])
    tok = make_token("s", purpose="session", cluster="c", node="n01", target="2", now_ms=int(now[0] * 1000))
    assert v.verify(tok, purpose="session", target="1") is None  # another shard
    assert v.verify(tok, purpose="http", target="2") is None  # another purpose
    assert v.verify(tok, purpose="session", target="2") == "n01"
    assert v.verify(tok, purpose="session", target="2") is None  # a replay
    old = make_token("s", purpose="session", cluster="c", node="n01", target="2", now_ms=int((now[0] - 61) * 1000))
    assert v.verify(old, purpose="session", target="2") is None  # out of the window
    forged = make_token("guess", purpose="session", cluster="c", node="n01", target="2", now_ms=int(now[0] * 1000))
    assert v.verify(forged, purpose="session", target="2") is None
    other_cluster = make_token("s", purpose="session", cluster="d", node="n01", target="2",
                               now_ms=int(now[0] * 1000))
    assert v.verify(other_cluster, purpose="session", target="2") is None
    body = make_token("s", purpose="http", cluster="c", node="n.with.dots", target="POST /x", body=b"{}",
                      now_ms=int(now[0] * 1000))
    assert v.verify(body, purpose="http", target="POST /x", body=b"{!}") is None
    assert v.refused == 7


async def test_the_node_secret_itself_is_no_key_and_a_bad_node_token_is_refused(tmp_path):
    from rallypoint.node import open_node
    from rallypoint.wire import PROTOCOL_VERSION, Hello

    async with open_node(None, durability="memory") as node:
        svc = node.service
        svc.shard = 0
        svc.node_secret = "the-node-secret"
        svc.node_tokens = TokenVerifier("the-node-secret", "c")
        # the old way (the secret as the key): an ordinary, unknown key now
        session, _ok = svc.hello(Hello(version=PROTOCOL_VERSION, api_key="the-node-secret"))
        assert not session.node
        tok = make_token("the-node-secret", purpose="session", cluster="c", node="n10", target="0")
        session, _ok = svc.hello(Hello(version=PROTOCOL_VERSION, api_key=tok))
        assert session.node
        with pytest.raises(UnauthenticatedError, match="node token"):
            svc.hello(Hello(version=PROTOCOL_VERSION, api_key=tok))  # a replay
        wrong_shard = make_token("the-node-secret", purpose="session", cluster="c", node="n10", target="1")
        with pytest.raises(UnauthenticatedError):
            svc.hello(Hello(version=PROTOCOL_VERSION, api_key=wrong_shard))
