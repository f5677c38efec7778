"""An attacker on the replication port: connects to a leader's ``--replication``
address as the standby would, naming the shard and the real standby's node, with every
field a real peer sends -- but without the cluster secret -- and tries each thing the
unauthenticated link once allowed (issue 40): to be sent the journal, to take the
standby's place in the in-sync set, to acknowledge frames it never stored.

:class:`Impostor` loops over its tricks until cancelled, counting what it got
(``frames`` and ``welcomes`` must stay 0 against an authenticated leader). Used by
tests/test_replication_auth.py and ``scripts/bench_failover.py --impostor``.
"""

from __future__ import annotations

import os

import trio

from ..replication import wire
from ..replication.link import Link, LinkClosed

__all__ = ["Impostor", "TRICKS"]

#: what one connection tries, in turn
TRICKS = ("no-proof", "wrong-proof", "ack-first", "skip-to-ack", "big-hello")


class Impostor:
    """Connect to ``host:port`` again and again as ``node`` of ``shard`` of
    ``cluster`` (the real standby's name), one trick per connection.

    Counters: ``connections``, ``challenges`` (the leader's Challenge: expected),
    ``refusals`` (a Refuse), ``welcomes``, ``frames`` (journal frames, snapshot pieces
    or beats: must stay 0), ``errors`` (connection refused or reset)."""

    def __init__(self, host: str, port: int, *, cluster: str, shard: int, node: str,
                 last_lsn: int = 0, pause_s: float = 0.02) -> None:
        self.host, self.port = host, port
        self.cluster, self.shard, self.node = cluster, shard, node
        self.last_lsn = last_lsn
        self.pause_s = pause_s
        self.connections = self.challenges = self.refusals = self.welcomes = self.frames = self.errors = 0
        self.got: list[str] = []

    def hello(self) -> wire.Hello:
        return wire.Hello(version=wire.LINK_VERSION, cluster=self.cluster, shard=self.shard, node=self.node,
                          last_lsn=self.last_lsn, last_epoch=0, snapshot_lsn=0, epochs=[], nonce=os.urandom(16))

    async def run(self, *, rounds: int | None = None, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Loop (``rounds`` connections, or until cancelled)."""
        task_status.started()
        i = 0
        while rounds is None or i < rounds:
            await self.once(TRICKS[i % len(TRICKS)])
            i += 1
            await trio.sleep(self.pause_s)

    async def once(self, trick: str) -> None:
        """One connection trying ``trick`` (one of :data:`TRICKS`)."""
        try:
            stream = await trio.open_tcp_stream(self.host, self.port)
        except OSError:
            self.errors += 1
            return
        self.connections += 1
        link = Link(stream, "standby")
        try:
            with trio.move_on_after(8.0):
                if trick == "big-hello":
                    h = self.hello()
                    h.epochs = [(i, i) for i in range(20_000)]  # ~200 KB before any proof
                    await link.send(h)
                elif trick == "ack-first":
                    await link.send(wire.Ack(lsn=10**9))
                    await link.send(self.hello())
                else:
                    await link.send(self.hello())
                while True:
                    msg = await link.receive()
                    self._count(msg)
                    if isinstance(msg, wire.Challenge):
                        if trick == "wrong-proof":
                            await link.send(wire.Proof(proof=os.urandom(32)))
                        elif trick == "skip-to-ack":
                            await link.send(wire.Ack(lsn=10**9))
                        # no-proof: say nothing and wait to be cut off
                    elif isinstance(msg, wire.Refuse):
                        return
        except LinkClosed:
            return
        finally:
            await link.aclose()

    def _count(self, msg) -> None:
        t = type(msg)
        self.got.append(t.__name__)
        if t is wire.Challenge:
            self.challenges += 1
        elif t is wire.Refuse:
            self.refusals += 1
        elif t is wire.Welcome:
            self.welcomes += 1
        elif t in (wire.Frames, wire.SnapshotChunk, wire.Beat):
            self.frames += 1
