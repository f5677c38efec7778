"""The replication link's authentication: both ends prove who they are on every
connection, before anything else is sent or taken (:mod:`.wire` has the messages,
:mod:`rallypoint.cluster.peerauth` the MACs and TLS contexts).

:class:`LinkAuth` holds what a node proves itself with -- the cluster secret (always)
and its peer TLS material (optional: ``--peer-cert/--peer-key/--peer-ca``) -- and runs
the leader's (:meth:`LinkAuth.accept`) and the standby's (:meth:`LinkAuth.connect`)
side of the handshake. Either raises :class:`Unauthenticated` (a
:class:`~.link.LinkClosed`) when the peer does not prove itself; nothing of the
shard (no frame, no in-sync set change, no epoch) is touched before both proved.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import trio

from ..cluster import peerauth
from ..cluster.peerauth import PeerTls, link_proof, names_of, verify_link_proof
from . import wire
from .link import Link, LinkClosed, StaleLeader

__all__ = ["LinkAuth", "Unauthenticated", "Accepted"]


class Unauthenticated(LinkClosed):
    """The peer did not prove the cluster secret (or, with peer TLS, presented no
    certificate of the cluster's CA naming the node it claims)."""


@dataclass
class Accepted:
    """A standby that proved itself: its ``hello`` and the ``link`` (now taking
    messages of any size)."""

    hello: wire.Hello
    link: Link


class LinkAuth:
    """What this node proves itself with on the replication link.

    Args:
        secret: the cluster secret (etcd, :func:`rallypoint.cluster.shardmap.node_secret`).
        cluster, shard: the shard both ends must belong to (part of every proof).
        tls: peer TLS (mutual, the cluster's CA) or None (plaintext: loopback only,
            unless ``--insecure``; the node checks that at start).
        handshake_timeout_s: a peer that has not proved itself within this many seconds
            (TLS handshake included) is cut off.
    """

    def __init__(self, secret: str | bytes, *, cluster: str, shard: int, tls: PeerTls | None = None,
                 handshake_timeout_s: float = 5.0) -> None:
        if not secret:
            raise ValueError("the replication link needs the cluster secret")
        self.secret = secret
        self.cluster = cluster
        self.shard = shard
        self.tls = tls
        self.handshake_timeout_s = handshake_timeout_s

    # ------------------------------------------------------------------ leader
    async def accept(self, stream: trio.abc.Stream, *, node: str, epoch: int) -> Accepted:
        """The leader's side (``node`` at ``epoch``): TLS if configured, then Hello ->
        Challenge -> Proof. Returns the standby's Hello and the link; raises
        Unauthenticated (a wrong or missing proof or certificate, a handshake over
        ``handshake_timeout_s``) or LinkClosed (the connection ended, another link
        version: the peer is told so)."""
        with trio.move_on_after(self.handshake_timeout_s):
            try:
                return await self._accept(stream, node, epoch)
            except Unauthenticated:
                raise
            except LinkClosed as e:
                if "link version" in str(e):
                    raise
                raise Unauthenticated(f"the peer's connection ended before it proved itself: {e}") from None
        raise Unauthenticated(f"no authenticated handshake within {self.handshake_timeout_s:g} s")

    async def _accept(self, stream, node: str, epoch: int) -> Accepted:
        names: set[str] | None = None
        if self.tls is not None:
            stream = await _tls_handshake(trio.SSLStream(stream, self.tls.server, server_side=True),
                                          "the peer's TLS handshake failed (no certificate of the cluster's CA?)")
            names = names_of(stream.getpeercert())
        link = Link(stream, "leader", max_message=wire.HANDSHAKE_MAX_BYTES)
        hello = await link.receive()
        if not isinstance(hello, wire.Hello):
            raise Unauthenticated(f"expected Hello, got {type(hello).__name__}")
        if hello.version != wire.LINK_VERSION:
            await link.send(wire.Refuse(code="REFUSED", message=f"replication link version {hello.version} is not "
                                                                 f"{wire.LINK_VERSION}"))
            raise LinkClosed(f"a standby speaks replication link version {hello.version}, not {wire.LINK_VERSION}")
        if len(hello.nonce) < 16:
            raise Unauthenticated("the Hello carries no nonce")
        mine = peerauth.new_nonce()
        await link.send(wire.Challenge(leader=node, epoch=epoch, nonce=mine, proof=link_proof(
            self.secret, role="leader", cluster=self.cluster, shard=self.shard, node=node, epoch=epoch,
            standby_nonce=hello.nonce, leader_nonce=mine)))
        msg = await link.receive()
        if not isinstance(msg, wire.Proof) or not verify_link_proof(
                msg.proof, self.secret, role="standby", cluster=self.cluster, shard=self.shard, node=hello.node,
                epoch=epoch, standby_nonce=hello.nonce, leader_nonce=mine):
            await _refuse(link, "the standby did not prove the cluster secret (is it a node of this cluster, with "
                                "the same etcd?)")
            raise Unauthenticated(f"a peer claiming to be {hello.node!r} did not prove the cluster secret")
        if names is not None and hello.node not in names:
            await _refuse(link, f"the certificate presented does not name node {hello.node!r}")
            raise Unauthenticated(f"a peer claiming to be {hello.node!r} presented a certificate for "
                                  f"{sorted(names)}")
        link.max_message = wire.MAX_MESSAGE_BYTES
        return Accepted(hello, link)

    # ------------------------------------------------------------------ standby
    async def connect(self, stream: trio.abc.Stream, hello: wire.Hello, *, leader: str, epoch: int) -> Link:
        """The standby's side, to the ``leader`` etcd names at ``epoch``: TLS if
        configured (the leader's certificate must name ``leader``), Hello (a nonce is
        put in it) -> Challenge (checked: that node, that epoch, its proof) -> Proof.
        Returns the link, ready for the Welcome. Raises Unauthenticated, or LinkClosed
        (a Refuse, the connection ended)."""
        with trio.move_on_after(self.handshake_timeout_s):
            return await self._connect(stream, hello, leader, epoch)
        raise LinkClosed(f"the leader did not answer the handshake within {self.handshake_timeout_s:g} s")

    async def _connect(self, stream, hello: wire.Hello, leader: str, epoch: int) -> Link:
        if self.tls is not None:
            stream = await _tls_handshake(trio.SSLStream(stream, self.tls.client, server_hostname=leader),
                                          f"TLS to the leader {leader!r} failed (its certificate must be of the "
                                          f"cluster's CA and name {leader!r})")
        link = Link(stream, "standby", max_message=wire.HANDSHAKE_MAX_BYTES)
        hello.nonce = mine = peerauth.new_nonce()
        await link.send(hello)
        ch = await link.receive()
        if isinstance(ch, wire.Refuse):
            raise LinkClosed(f"the leader refused: {ch.message}")
        if not isinstance(ch, wire.Challenge):
            raise Unauthenticated(f"expected Challenge, got {type(ch).__name__}")
        if ch.leader != leader:
            raise Unauthenticated(f"the peer at the leader's replication address says it is {ch.leader!r}; etcd "
                                  f"names {leader!r}")
        if not verify_link_proof(ch.proof, self.secret, role="leader", cluster=self.cluster, shard=self.shard,
                                 node=leader, epoch=ch.epoch, standby_nonce=mine, leader_nonce=ch.nonce):
            raise Unauthenticated(f"the peer at the leader's replication address did not prove the cluster "
                                  f"secret: not {leader!r}")
        if ch.epoch != epoch:  # a node of the cluster, but not at the epoch etcd names: deposed (or newer)
            raise StaleLeader(f"the peer leads epoch {ch.epoch}, etcd names epoch {epoch}")
        await link.send(wire.Proof(proof=link_proof(
            self.secret, role="standby", cluster=self.cluster, shard=self.shard, node=hello.node, epoch=epoch,
            standby_nonce=mine, leader_nonce=ch.nonce)))
        link.max_message = wire.MAX_MESSAGE_BYTES
        return link


async def _refuse(link: Link, message: str) -> None:
    try:
        await link.send(wire.Refuse(code="UNAUTHENTICATED", message=message))
    except LinkClosed:
        pass


async def _tls_handshake(stream: trio.SSLStream, failed: str) -> trio.SSLStream:
    """``stream`` once its TLS handshake is done; Unauthenticated (``failed: cause``) if it fails."""
    try:
        await stream.do_handshake()
    except (trio.BrokenResourceError, ssl.SSLError, OSError) as e:
        raise Unauthenticated(f"{failed}: {_cause(e)}") from None
    return stream


def _cause(e: BaseException) -> str:
    c = e.__cause__ or e.__context__
    return f"{c}" if c is not None else f"{e}"
