"""The replication link's messages: what a shard's leader and its standby say.

One TCP connection per standby, opened by the standby to the leader's replication
address (the one in the shard's leader key in etcd). Each message is a frame -- a 4-byte
big-endian length and a msgpack body (:class:`~rallypoint.transport.framing.FrameParser`),
at most :data:`MAX_MESSAGE_BYTES` -- tagged by the field ``t``::

    standby: Hello(cluster, shard, node, last_lsn, last_epoch, snapshot_lsn, epochs, nonce)
    leader:  Challenge(leader, epoch, nonce, proof)       the leader proves the cluster secret
    standby: Proof(proof)                                 the standby proves it (or: closed)
    leader:  Welcome(epoch, leader, from_lsn, truncate_to, snapshot)   or Refuse(...) and close
    leader:  SnapshotChunk(...)*          only when Welcome.snapshot: the leader's LMDB copy
    leader:  Frames(epoch, first_lsn, count, data, mono_ms, wall_ms) | Beat(...)   ...
    standby: Ack(lsn)                      each time its journal is durable further

``Frames.data`` is the records exactly as the journal frames them on disk (``u32 length,
u32 crc, u64 lsn, payload``; :mod:`rallypoint.persistence.journal`), consecutive from
``first_lsn``: the standby checks them as recovery does (CRC, LSN continuity) and
appends them at the same LSNs, so the replicas of a shard hold the same bytes at every
LSN. ``mono_ms``/``wall_ms`` are the leader's server time and wall time when it sent
them (a :class:`Beat` carries them when there is nothing to send): the standby continues
the shard's server time from the latest pair when it takes over.

**Authentication** (every connection, no way to turn it off;
:mod:`rallypoint.cluster.peerauth`): ``Hello.nonce`` and ``Challenge.nonce`` are 16
fresh random bytes each; ``Challenge.proof`` is the leader's HMAC of the cluster secret
over both nonces, the cluster, shard, its node name and its epoch, ``Proof.proof`` the
standby's over the same fields with its own node name and the other role's label. Until
both proofs checked, neither side sends or takes anything else, and a message of more
than :data:`HANDSHAKE_MAX_BYTES` ends the connection. With peer TLS the whole link runs
inside mutual TLS and each claimed node name must be one its certificate carries.
"""

from __future__ import annotations

from typing import Union

import msgspec

__all__ = ["Hello", "Challenge", "Proof", "Welcome", "Refuse", "SnapshotChunk", "Frames", "Beat", "Ack",
           "LeaderMessage", "StandbyMessage", "MAX_MESSAGE_BYTES", "HANDSHAKE_MAX_BYTES", "LINK_VERSION"]

#: Largest message body, bytes: a batch of frames is cut well below it (a single
#: record larger than the batch target travels alone).
MAX_MESSAGE_BYTES = 64 << 20
#: Largest message either side takes before the other proved itself, bytes.
HANDSHAKE_MAX_BYTES = 64 << 10
#: Bumped on any incompatible change of these messages (2: the authenticated handshake).
LINK_VERSION = 2


class Hello(msgspec.Struct, tag_field="t", tag="hello"):
    """The standby's first message: where its journal ends and which epoch wrote its
    last record (0: none), so the leader can tell it where to continue -- or to
    truncate first."""

    version: int
    cluster: str
    shard: int
    node: str
    last_lsn: int
    last_epoch: int
    snapshot_lsn: int
    #: the standby's epoch history, ``[epoch, first LSN]`` oldest first: the leader
    #: finds the last epoch both share and where it ends on either (KIP-279), not only
    #: where the standby's last epoch ends on the leader
    epochs: list[tuple[int, int]] = []
    #: 16 fresh random bytes: the leader's proof covers them
    nonce: bytes = b""


class Challenge(msgspec.Struct, tag_field="t", tag="challenge"):
    """The leader's answer to a Hello: who it is (``leader``, ``epoch``: what etcd must
    name), a fresh ``nonce`` and its ``proof`` of the cluster secret over both nonces."""

    leader: str
    epoch: int
    nonce: bytes
    proof: bytes


class Proof(msgspec.Struct, tag_field="t", tag="proof"):
    """The standby's proof of the cluster secret over both nonces (its role, its node)."""

    proof: bytes


class Welcome(msgspec.Struct, tag_field="t", tag="welcome"):
    """The leader's answer. ``truncate_to``: the standby's journal goes past the end of
    its last epoch (records no one acknowledged): it must cut everything after this LSN
    and reconnect. ``snapshot``: the records it needs are gone from the leader's journal
    (or its snapshot is past the cut): a copy of the leader's snapshot follows, then
    frames from its LSN + 1. Otherwise frames from ``from_lsn`` follow."""

    epoch: int
    leader: str
    from_lsn: int
    truncate_to: int | None = None
    snapshot: bool = False


class Refuse(msgspec.Struct, tag_field="t", tag="refuse"):
    """The leader will not replicate to this node (not the leader any more, another
    cluster or shard, a newer epoch on the standby's side); the connection closes."""

    code: str
    message: str


class SnapshotChunk(msgspec.Struct, tag_field="t", tag="snap"):
    """A piece of the leader's snapshot (LMDB ``data.mdb``, compacted copy) valid at
    ``lsn``; ``last`` ends it. ``offset`` is where ``data`` goes in the file."""

    lsn: int
    offset: int
    data: bytes
    last: bool = False


class Frames(msgspec.Struct, tag_field="t", tag="frames"):
    """``count`` journal records from ``first_lsn`` on, framed as on disk."""

    epoch: int
    first_lsn: int
    count: int
    data: bytes
    mono_ms: int
    wall_ms: int


class Beat(msgspec.Struct, tag_field="t", tag="beat"):
    """Nothing new: the leader is alive at ``(mono_ms, wall_ms)``; its journal ends at
    ``last_lsn``."""

    epoch: int
    last_lsn: int
    mono_ms: int
    wall_ms: int


class Ack(msgspec.Struct, tag_field="t", tag="ack"):
    """Every record up to ``lsn`` is durable on the standby."""

    lsn: int


LeaderMessage = Union[Challenge, Welcome, Refuse, SnapshotChunk, Frames, Beat]
StandbyMessage = Union[Hello, Proof, Ack]
