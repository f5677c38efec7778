"""The leader's side of replication: ship every journal record to the standby, count
what it made durable, and keep the in-sync set honest.

**What "acknowledged" means.** A reply leaves only once ``journal.durable_lsn`` passes
what it observed (:mod:`rallypoint.persistence.journal`). While a standby is in the
in-sync set (ISR), :class:`ReplicationLeader` caps that LSN at the standby's
acknowledged one (``Journal.set_replica_floor``), so "durable" means fsynced here *and*
there, and no actor code changes. The ISR itself lives in etcd (``isr`` of the shard's
``replicas`` key), changed only by the leader with a transaction fenced by its own
epoch (:class:`IsrStore`): a deposed leader cannot change it.

**Joining.** A standby that connects is *catching up*: it is sent what it lacks (from
the leader's memory ring, its journal files, or a snapshot copy) and counts for nothing.
Once its acknowledged LSN reaches the journal's end it *joins*: the floor is set
(replies from now on wait for it), and once it has also acknowledged everything that
was acknowledged before the floor was set, the leader adds it to the ISR in etcd. Only
then may it take over: it holds every acknowledged record.

**Dropping.** A standby in the ISR that acknowledges nothing for ``isr_timeout_s`` while
records wait (or whose connection drops) is removed from the ISR in etcd *first*, and
only then is the floor lifted and acknowledgement goes on without it (PacificA, Kafka's
ISR). With ``min_insync=2`` it is never removed: writes are refused instead
(UNAVAILABLE) until it is back, and what was written waits for it.
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
import os
import shutil
import struct
import tempfile
import time
from collections import deque
from typing import Any, Awaitable, Callable, Protocol, Sequence

import trio

from ..errors import UnavailableError
from ..fsm import Transitions
from ..logutil import RateLimitedLogger
from ..persistence.journal import read_journal
from . import wire
from .auth import LinkAuth, Unauthenticated
from .link import Link, LinkClosed, unwrapped

log = logging.getLogger("rallypoint.replication")

__all__ = ["ReplicationLeader", "RecordRing", "IsrStore", "Deposed", "PeerState", "PEER_MOVES", "frame_records"]

_II = struct.Struct("<II")
_Q = struct.Struct("<Q")

#: A batch of frames is cut once it holds this many bytes (one record larger than it
#: travels alone).
BATCH_BYTES = 1 << 20
#: A heartbeat when nothing was sent for this long, seconds.
BEAT_S = 0.1
#: Snapshot copies travel in pieces of this many bytes.
SNAPSHOT_CHUNK = 4 << 20
#: Connections in their handshake at once, in all and from one peer address; one more
#: is closed at once (a flood of unauthenticated connections costs a socket each,
#: briefly; one address cannot take every slot from the real standby's).
MAX_HANDSHAKES = 64
MAX_HANDSHAKES_PER_HOST = 4


class Deposed(Exception):
    """A fenced etcd transaction failed: this node is not the shard's leader any more."""


class IsrStore(Protocol):
    """Where the in-sync set lives (etcd, through ``rallypoint.cluster``)."""

    @property
    def isr(self) -> list[str]:
        """The in-sync set as last written or read (node names, the leader first)."""

    async def set_isr(self, isr: list[str]) -> bool:
        """Write the in-sync set, fenced by this leader's epoch. False: the fence failed
        (this node is not the leader any more); nothing was written."""


def frame_records(records) -> bytes:
    """``[(lsn, crc, payload)]`` -> the bytes of their journal frames, as on disk."""
    parts = []
    for lsn, crc, payload in records:
        parts.append(_II.pack(len(payload), crc))
        parts.append(_Q.pack(lsn))
        parts.append(payload)
    return b"".join(parts)


class RecordRing:
    """The records appended most recently, kept in memory for the standby: the
    journal's tap (:meth:`tap`) adds each, and the oldest go once more than
    ``max_bytes`` of payload are held. ``first_lsn``..``last_lsn`` are held (empty:
    ``first_lsn == last_lsn + 1``)."""

    def __init__(self, next_lsn: int, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self._q: deque[tuple[int, int, bytes]] = deque()
        self.first_lsn = next_lsn
        self.last_lsn = next_lsn - 1
        self.bytes = 0
        self._event: trio.Event | None = None

    def tap(self, lsn: int, crc: int, payload: bytes) -> None:
        """The journal appended ``lsn`` (called synchronously, in LSN order)."""
        q = self._q
        q.append((lsn, crc, payload))
        self.last_lsn = lsn
        self.bytes += len(payload)
        while self.bytes > self.max_bytes and len(q) > 1:
            self.bytes -= len(q.popleft()[2])
            self.first_lsn = q[0][0]
        ev = self._event
        if ev is not None:
            self._event = None
            ev.set()

    async def wait_past(self, lsn: int) -> None:
        """Return once a record past ``lsn`` was appended."""
        while self.last_lsn <= lsn:
            if self._event is None:
                self._event = trio.Event()
            await self._event.wait()

    def take(self, from_lsn: int, max_bytes: int = BATCH_BYTES) -> list[tuple[int, int, bytes]]:
        """Records from ``from_lsn`` on (``first_lsn <= from_lsn``), up to about
        ``max_bytes`` (at least one, if there is one)."""
        q = self._q
        if not q or from_lsn > self.last_lsn:
            return []
        out = []
        n = 0
        # one walk from the nearer end (indexing a deque in the middle is O(n) per step)
        start = from_lsn - self.first_lsn
        if start <= len(q) // 2:
            it = itertools.islice(q, start, None)
        else:
            tail = list(itertools.islice(reversed(q), len(q) - start))
            tail.reverse()
            it = iter(tail)
        for rec in it:
            out.append(rec)
            n += len(rec[2]) + 16
            if n >= max_bytes:
                break
        return out


async def _close(stream) -> None:
    with trio.CancelScope(shield=True):
        try:
            await stream.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass


def _peer_of(stream) -> str:
    """``host:port`` of a stream's peer, for logs (``?`` when unknown)."""
    s = stream
    while s is not None and not hasattr(s, "socket"):
        s = getattr(s, "transport_stream", None)
    try:
        host, port = s.socket.getpeername()[:2]
        return f"{host}:{port}"
    except (AttributeError, OSError, TypeError, ValueError):
        return "?"


class PeerState(enum.StrEnum):
    """A connected standby as its leader sees it (issue 43: these were strings)."""

    CATCHING_UP = "catching_up"  # receiving what it lacks; replies do not wait for it
    JOINING = "joining"  # caught up: replies wait for it; not in the in-sync set yet
    IN_SYNC = "in_sync"  # in the in-sync set in etcd: may take over
    DROPPED = "dropped"  # out (its link closed); a reconnection is a new peer


#: the moves of :class:`PeerState` (a dropped peer stays dropped: the standby connects
#: again as a new peer and catches up)
PEER_MOVES: Transitions[PeerState] = Transitions("replication peer", PeerState, {
    PeerState.CATCHING_UP: {PeerState.JOINING, PeerState.DROPPED},
    PeerState.JOINING: {PeerState.IN_SYNC, PeerState.DROPPED},
    PeerState.IN_SYNC: {PeerState.DROPPED},
    PeerState.DROPPED: set(),
})


class _Peer:
    """One connected standby; :attr:`state` moves only along :data:`PEER_MOVES`."""

    def __init__(self, node: str, link: Link, acked: int) -> None:
        self.node = node
        self.link = link
        self.acked = acked
        self._state = PeerState.CATCHING_UP
        self.join_target: int | None = None
        self.last_progress = trio.current_time()
        self.connected_at = time.time()
        self.sent_lsn = acked

    @property
    def state(self) -> PeerState:
        return self._state

    @state.setter
    def state(self, to: PeerState) -> None:
        PEER_MOVES.check(self._state, to)  # IllegalTransition for a move not in the table
        self._state = to


class ReplicationLeader:
    """Replication on the shard's leader: serves standbys on the replication listener.

    Args:
        coordinator: the leader's coordinator (its journal, epochs, clock, snapshotter).
        epoch: this leader's epoch (its etcd leader key's create revision).
        node: this node's name; cluster, shard: what a standby must name in its Hello.
        isr: the in-sync set store (fenced writes).
        snapshot_store: the leader's :class:`~rallypoint.persistence.snapshot.SnapshotStore`
            (a standby too far behind gets a compacted copy of it).
        isr_timeout_s: a standby in the ISR that acknowledges nothing for this long
            (seconds) while records wait for it is dropped from the ISR (default 1 s).
        min_insync: 2: never run alone -- refuse writes while no standby is in sync.
        ring_bytes: payload bytes of recent records kept in memory for the standby.
        on_deposed: called when a fenced ISR write fails (the node must stop serving).
        auth: how a connecting standby must prove itself (:class:`~.auth.LinkAuth`:
            the cluster secret, peer TLS); a peer that does not is sent nothing.
        members: ``await members()`` -> the shard's configured replica set (node names,
            as etcd holds it now); a standby whose Hello names a node not in it is
            refused before anything is sent (None: every node is let in).

    Use: ``journal.set_tap(leader.ring.tap)`` is done by :meth:`attach`; run
    :meth:`serve` with a listener in the node's nursery.
    """

    def __init__(self, coordinator, *, epoch: int, node: str, cluster: str, shard: int, isr: IsrStore,
                 snapshot_store=None, isr_timeout_s: float = 1.0,
                 min_insync: int = 1, ring_bytes: int = 64 << 20,
                 on_deposed: Callable[[], None] | None = None, auth: LinkAuth,
                 members: Callable[[], Awaitable[Sequence[str]]] | None = None) -> None:
        if min_insync not in (1, 2):
            raise ValueError(f"min_insync must be 1 or 2 (got {min_insync})")
        self.coord = coordinator
        self.journal = coordinator.journal
        self.epoch = epoch
        self.node = node
        self.cluster = cluster
        self.shard = shard
        self.isr_store = isr
        self.snapshot_store = snapshot_store
        self.isr_timeout_s = isr_timeout_s
        self.min_insync = min_insync
        self.ring = RecordRing(self.journal.last_lsn + 1, ring_bytes)
        self.on_deposed = on_deposed
        self.auth = auth
        self._handshakes: dict[str, int] = {}
        #: refused connections, for a rate-limited warning (an impostor loops)
        self.refusals = RateLimitedLogger(log, window_s=30.0, burst=1)
        self.members = members
        self._refused_logged: dict[str, float] = {}
        self.peer: _Peer | None = None
        self.deposed = False
        self._isr_lock = trio.Lock()
        self.stats = {"frames_sent": 0, "bytes_sent": 0, "snapshots_sent": 0, "isr_shrinks": 0, "isr_expands": 0,
                      "sessions": 0, "refused": 0}

    # ------------------------------------------------------------------ wiring
    def attach(self) -> None:
        """Start seeing every record the journal appends (before the first commit of
        this epoch: the new leader's own records -- its epoch, the lease extension --
        go in before :meth:`serve` refuses writes under ``min_insync``).

        While the in-sync set still names another node (the old leader, at a
        takeover), the replica floor is set at the journal's end: nothing this term
        writes counts as acknowledged until a standby holds it or the set is shrunk to
        this node (:meth:`shrink_isr_alone`; never under ``min_insync=2``, where the
        node named there may still take over and would lack it)."""
        self.journal.set_tap(self.ring.tap)
        if [n for n in self.isr_store.isr if n != self.node]:
            self.journal.set_replica_floor(self.journal.last_lsn)

    def detach(self) -> None:
        self.journal.set_tap(None)
        self.journal.set_replica_floor(None)
        self.journal.set_write_gate(None)

    def _update_gate(self) -> None:
        if self.min_insync < 2:
            self.journal.set_write_gate(None)
            return
        peer = self.peer
        if peer is not None and peer.state == PeerState.IN_SYNC:
            self.journal.set_write_gate(None)
        else:
            self.journal.set_write_gate(lambda: UnavailableError(
                "no in-sync standby: this shard runs with --min-insync 2 and refuses writes it could not "
                "replicate; they resume once the standby has caught up", retry_after=1.0,
                details={"reason": "min_insync"}))

    def hold_lsn(self) -> int | None:
        """The oldest LSN a connected standby may still need from the journal files
        (the Snapshotter keeps segments from it on), or None."""
        peer = self.peer
        return None if peer is None else peer.acked + 1

    # ------------------------------------------------------------------ status
    def statistics(self) -> dict[str, Any]:
        """Replication figures for ``cluster status`` and metrics: the standby (node,
        state, acknowledged LSN, lag in records, seconds since its last progress)."""
        peer = self.peer
        out: dict[str, Any] = dict(self.stats)
        out["epoch"] = self.epoch
        out["last_lsn"] = self.journal.last_lsn
        out["isr"] = list(self.isr_store.isr)
        if peer is None:
            out["standby"] = None
        else:
            out["standby"] = {
                "node": peer.node, "state": peer.state, "acked_lsn": peer.acked,
                "lag_records": max(0, self.journal.last_lsn - peer.acked),
                "since_progress_s": round(trio.current_time() - peer.last_progress, 3),
            }
        return out

    # ------------------------------------------------------------------ serving
    async def serve(self, listeners, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Accept standby connections on ``listeners`` until cancelled; one session
        each (a new standby connection replaces an older one of the same node)."""
        self._update_gate()  # min_insync 2: no client write until a standby is in sync
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watchdog)
            task_status.started()
            await trio.serve_listeners(self._session_guarded, listeners, handler_nursery=nursery)

    async def _session_guarded(self, stream) -> None:
        try:
            await self.session(stream)
        except Unauthenticated as exc:
            self.stats["refused"] += 1
            self.refusals.log(logging.WARNING, "link-unauthenticated",
                              "replication: refused a connection from %s: %s", _peer_of(stream), exc)
        except LinkClosed as exc:
            log.info("replication: standby connection ended: %s", exc)
        except Deposed:
            self._deposed()

    def _deposed(self) -> None:
        if not self.deposed:
            self.deposed = True
            log.warning("replication: a fenced in-sync-set update failed: this node is no longer the leader")
            if self.on_deposed is not None:
                self.on_deposed()

    async def session(self, stream) -> None:
        """One standby connection: the authenticated handshake (:meth:`LinkAuth.accept`:
        nothing is sent to a peer that did not prove itself), then stream records and
        read acks. Raises Unauthenticated for a peer that did not prove itself."""
        host = _peer_of(stream).rpartition(":")[0]
        pending = self._handshakes
        if sum(pending.values()) >= MAX_HANDSHAKES or pending.get(host, 0) >= MAX_HANDSHAKES_PER_HOST:
            await _close(stream)
            raise Unauthenticated(f"too many connections in their handshake at once (from {host or '?'}: "
                                  f"{pending.get(host, 0)}, in all: {sum(pending.values())})")
        pending[host] = pending.get(host, 0) + 1
        try:
            try:
                accepted = await self.auth.accept(stream, node=self.node, epoch=self.epoch)
            finally:
                pending[host] -= 1
                if not pending[host]:
                    del pending[host]
        except BaseException:
            await _close(stream)
            raise
        link = accepted.link
        hello = accepted.hello
        try:
            refusal = self._check_hello(hello)
            if refusal is None:
                refusal = await self._check_member(hello)
            if refusal is not None:
                await link.send(wire.Refuse(code="REFUSED", message=refusal))
                return
            welcome = self._welcome(hello)
            await link.send(welcome)
            if welcome.truncate_to is not None:
                return  # it truncates and comes back
            self.stats["sessions"] += 1
            start = welcome.from_lsn
            if welcome.snapshot:
                start = await self._send_snapshot(link) + 1
            old = self.peer
            if old is not None:
                await self._drop(old, "replaced by a new connection of the standby")
            if self.deposed:
                raise LinkClosed("this node is no longer the leader (a fenced in-sync set update failed)")
            peer = _Peer(hello.node, link, start - 1)
            self.peer = peer
            log.info("replication: standby %s connected (from LSN %d, journal ends at %d)", hello.node, start,
                     self.journal.last_lsn)
            try:
                async with unwrapped(), trio.open_nursery() as nursery:
                    nursery.start_soon(self._read_acks, peer, nursery.cancel_scope)
                    await self._on_ack(peer)  # a standby that lacks nothing joins at once
                    await self._stream(peer, start)
            finally:
                if self.peer is peer:
                    with trio.CancelScope(shield=True):
                        await self._drop(peer, "its connection ended")
        finally:
            await link.aclose()

    def _check_hello(self, hello: wire.Hello) -> str | None:
        if hello.version != wire.LINK_VERSION:
            return f"replication link version {hello.version} is not {wire.LINK_VERSION}"
        if hello.cluster != self.cluster or hello.shard != self.shard:
            return (f"this is shard {self.shard} of cluster {self.cluster!r}, not shard {hello.shard} of "
                    f"{hello.cluster!r}")
        if hello.node == self.node:
            return f"node {hello.node!r} is this leader"
        if hello.last_epoch > self.epoch:
            return f"the standby has records of epoch {hello.last_epoch}, newer than this leader's {self.epoch}"
        if self.deposed:
            return "this node is no longer the leader"
        return None

    async def _check_member(self, hello: wire.Hello) -> str | None:
        """A standby must be one of the shard's configured members (``members``): a
        node outside the set gets no frame and never joins the in-sync set. Logged once
        a minute per node name."""
        if self.members is None:
            return None
        members = list(await self.members())
        if hello.node in members:
            return None
        now = trio.current_time()
        if now - self._refused_logged.get(hello.node, -math.inf) >= 60.0:
            if len(self._refused_logged) >= 1000:  # (names made up by a peer: bounded)
                self._refused_logged.clear()
            self._refused_logged[hello.node] = now
            log.warning("replication: refused standby %r: not a member of shard %d (members: %s)", hello.node,
                        self.shard, ", ".join(members))
        return (f"node {hello.node!r} is not a member of shard {self.shard} of cluster {self.cluster!r} "
                f"(its members: {', '.join(members)})")

    def shared_end(self, hello: wire.Hello) -> int:
        """The last LSN up to which the standby's journal holds what this leader's does
        (KIP-279): the two epoch histories agree up to some epoch E (the same epochs,
        starting at the same LSNs; E = 0 before any); E's records end, on either side,
        where that side's next epoch begins (or at its journal's end), and the two
        journals agree up to the smaller of the two ends. (Where the standby's *last*
        epoch ends on the leader is not enough: a node that led epoch 12 and a node that
        led 11 and then 13 both have records at the LSNs after epoch 10 -- different
        ones.) A standby that sends no history (an older version) is answered by the end
        of its last epoch here."""
        mine = [(e.epoch, e.first_lsn) for e in self.coord.epochs.entries]
        theirs = [tuple(x) for x in hello.epochs]
        my_last = self.journal.last_lsn
        if not theirs and hello.last_epoch:
            end = self.coord.epochs.end_of(hello.last_epoch)
            return min(end if end is not None else my_last, my_last, hello.last_lsn)
        k = 0
        while k < len(mine) and k < len(theirs) and mine[k] == theirs[k]:
            k += 1
        my_end = mine[k][1] - 1 if k < len(mine) else my_last
        their_end = theirs[k][1] - 1 if k < len(theirs) else hello.last_lsn
        return min(my_end, their_end, my_last, hello.last_lsn)

    def _welcome(self, hello: wire.Hello) -> wire.Welcome:
        last = hello.last_lsn
        shared = self.shared_end(hello)
        truncate_to = None
        if last > shared:
            truncate_to = shared  # past it, records of epochs no one acknowledged
        if truncate_to is not None:
            if truncate_to < hello.snapshot_lsn:
                return wire.Welcome(epoch=self.epoch, leader=self.node, from_lsn=0, snapshot=True)
            return wire.Welcome(epoch=self.epoch, leader=self.node, from_lsn=truncate_to + 1, truncate_to=truncate_to)
        from_lsn = last + 1
        if from_lsn < self.ring.first_lsn and from_lsn < self._oldest_on_disk():
            return wire.Welcome(epoch=self.epoch, leader=self.node, from_lsn=0, snapshot=True)
        return wire.Welcome(epoch=self.epoch, leader=self.node, from_lsn=from_lsn)

    def _oldest_on_disk(self) -> int:
        oldest = self.journal.oldest_lsn
        return self.ring.first_lsn if oldest is None else oldest

    async def _send_snapshot(self, link: Link) -> int:
        """Send a compacted copy of the leader's snapshot; returns its LSN."""
        store = self.snapshot_store
        if store is None:
            raise LinkClosed("the standby needs a snapshot copy and this leader keeps none")
        tmp = tempfile.mkdtemp(prefix="rallypoint-snapcopy-")
        try:
            lsn = await store.copy_to(tmp)
            path = os.path.join(tmp, "data.mdb")
            size = os.path.getsize(path)
            log.info("replication: sending a %d-byte snapshot copy at LSN %d to the standby", size, lsn)
            with open(path, "rb") as f:
                off = 0
                while True:
                    data = await trio.to_thread.run_sync(f.read, SNAPSHOT_CHUNK)
                    last = off + len(data) >= size
                    await link.send(wire.SnapshotChunk(lsn=lsn, offset=off, data=data, last=last))
                    off += len(data)
                    if last:
                        break
            self.stats["snapshots_sent"] += 1
            return lsn
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    async def _stream(self, peer: _Peer, start: int) -> None:
        """Send records from ``start`` on as they are appended; beats when idle."""
        nxt = start
        ring = self.ring
        clock = self.coord.clock
        disk_iter = None
        misses = 0
        last_send = trio.current_time()
        while True:
            if nxt < ring.first_lsn:
                # older than the ring holds: from the journal files (a worker thread)
                if nxt < self._oldest_on_disk():
                    raise LinkClosed(f"LSN {nxt} is no longer in the journal files (a snapshot truncated them); "
                                     "the standby reconnects and gets a snapshot copy")
                if disk_iter is None:
                    disk_iter = iter(read_journal(self.journal.data_dir, after_lsn=nxt - 1))
                upto = min(ring.first_lsn - 1, self.journal.synced_lsn)
                batch = await trio.to_thread.run_sync(_read_batch, disk_iter, nxt, upto)
                if not batch:
                    # not synced yet, or written after the iterator read the files: again
                    disk_iter = None
                    misses += 1
                    if misses > 100:
                        raise LinkClosed(f"LSN {nxt} cannot be read from the journal files")
                    await trio.sleep(0.01)
                    continue
                misses = 0
            else:
                disk_iter = None
                batch = ring.take(nxt)
            if batch:
                first = batch[0][0]
                if first != nxt:
                    raise LinkClosed(f"internal: batch starts at LSN {first}, expected {nxt}")
                data = frame_records(batch)
                # counted as sent before the send: the standby may append, fsync and
                # acknowledge them while this task is still inside send_all (it yields
                # after the bytes left), and an acknowledgement past sent_lsn ends the link
                peer.sent_lsn = nxt + len(batch) - 1
                await peer.link.send(wire.Frames(epoch=self.epoch, first_lsn=nxt, count=len(batch), data=data,
                                                 mono_ms=clock.mono_ms(), wall_ms=clock.now_ms()))
                nxt += len(batch)
                self.stats["frames_sent"] += len(batch)
                self.stats["bytes_sent"] += len(data)
                last_send = trio.current_time()
                continue
            with trio.move_on_after(max(0.0, BEAT_S - (trio.current_time() - last_send))):
                await ring.wait_past(nxt - 1)
                continue
            await peer.link.send(wire.Beat(epoch=self.epoch, last_lsn=self.journal.last_lsn,
                                           mono_ms=clock.mono_ms(), wall_ms=clock.now_ms()))
            last_send = trio.current_time()

    async def _read_acks(self, peer: _Peer, scope: trio.CancelScope) -> None:
        try:
            while True:
                msg = await peer.link.receive()
                if not isinstance(msg, wire.Ack):
                    raise LinkClosed(f"unexpected {type(msg).__name__} from the standby")
                if msg.lsn > peer.sent_lsn:
                    raise LinkClosed(f"the standby acknowledged LSN {msg.lsn}, past what it was sent "
                                     f"({peer.sent_lsn})")
                if msg.lsn > peer.acked:
                    peer.acked = msg.lsn
                    peer.last_progress = trio.current_time()
                    await self._on_ack(peer)
        finally:
            scope.cancel()

    # ------------------------------------------------------------------ the ISR
    async def _on_ack(self, peer: _Peer) -> None:
        journal = self.journal
        if peer.state in (PeerState.JOINING, PeerState.IN_SYNC):
            journal.set_replica_floor(peer.acked)
        if peer.state == PeerState.CATCHING_UP and peer.acked >= journal.last_lsn:
            # caught up: from now on replies wait for it; everything acknowledged
            # before must be on it too before it may take over
            peer.state = PeerState.JOINING
            peer.join_target = journal.durable_lsn
            journal.set_replica_floor(peer.acked)
        if peer.state == PeerState.JOINING and peer.join_target is not None and peer.acked >= peer.join_target:
            async with self._isr_lock:
                if self.peer is not peer or peer.state != PeerState.JOINING:
                    return
                isr = [self.node, peer.node]
                if not await self.isr_store.set_isr(isr):
                    raise Deposed()
                peer.state = PeerState.IN_SYNC
                self.stats["isr_expands"] += 1
                log.info("replication: standby %s is in sync at LSN %d: the in-sync set is now %s", peer.node,
                         peer.acked, isr)
                self._update_gate()

    async def _drop(self, peer: _Peer, why: str) -> None:
        """Stop counting ``peer``: out of the ISR in etcd first (fenced), then the floor
        is lifted. Under ``min_insync=2`` it stays in the ISR and writes are refused.
        Its connection is closed in every case (the standby connects again and catches
        up; a session left open after the drop under ``--min-insync 2`` kept streaming
        to a standby that counted for nothing, for ever: found by the two-node
        simulator, seed 113)."""
        try:
            await self._drop_locked(peer, why)
        finally:
            with trio.CancelScope(shield=True):
                await peer.link.aclose()

    async def _drop_locked(self, peer: _Peer, why: str) -> None:
        async with self._isr_lock:
            if self.peer is peer:
                self.peer = None
            was = peer.state
            peer.state = PeerState.DROPPED
            if was == PeerState.IN_SYNC:
                if self.min_insync >= 2:
                    log.warning("replication: standby %s is out (%s); --min-insync 2: writes are refused "
                                "until it is back", peer.node, why)
                    self._update_gate()
                    return  # the floor stays: nothing more is acknowledged without it
                if not await self.isr_store.set_isr([self.node]):
                    self._deposed()
                    return  # the floor stays: a deposed leader acknowledges nothing more
                self.stats["isr_shrinks"] += 1
                log.warning("replication: standby %s dropped from the in-sync set (%s); acknowledging without "
                            "it", peer.node, why)
            if self._may_lift_floor():
                self.journal.set_replica_floor(None)
            self._update_gate()

    def _may_lift_floor(self) -> bool:
        """Whether acknowledgement may go on without any standby: only while this node
        is not deposed, no other session counts (joining or in sync), and the in-sync
        set as last written names this node alone. A deposed leader (a fenced write
        failed) and one whose ISR still names a standby (``min_insync=2``, or a shrink
        that failed) keep the floor: the standby named there may take over, and it
        lacks what the floor holds back. (A deposed leader whose second, catching-up
        session ended used to lift it and acknowledge alone in an epoch that was no
        longer its own: split brain, found by the two-node simulator.)"""
        if self.deposed:
            return False
        peer = self.peer
        if peer is not None and peer.state in (PeerState.JOINING, PeerState.IN_SYNC):
            return False
        return [n for n in self.isr_store.isr if n != self.node] == []

    async def _watchdog(self) -> None:
        """Drop a standby that stopped acknowledging while records wait for it; let one
        that caught up with nothing left to acknowledge join."""
        try:
            await self._watch()
        except Deposed:
            self._deposed()

    async def _watch(self) -> None:
        period = max(0.01, self.isr_timeout_s / 4)
        while True:
            await trio.sleep(period)
            peer = self.peer
            if peer is None:
                continue
            if peer.state == PeerState.CATCHING_UP:
                await self._on_ack(peer)  # caught up with nothing left to acknowledge
                continue
            if peer.state not in (PeerState.JOINING, PeerState.IN_SYNC):
                continue
            waiting = self.journal.local_durable_lsn > peer.acked or self.journal.last_lsn > peer.acked
            if not waiting:
                peer.last_progress = trio.current_time()
                continue
            if trio.current_time() - peer.last_progress >= self.isr_timeout_s:
                await self._drop(peer, f"no acknowledgement for {self.isr_timeout_s:g} s")

    async def shrink_isr_alone(self) -> bool:
        """At takeover: the ISR becomes this leader alone (the old leader is gone), fenced,
        before anything is acknowledged. False when the fence failed."""
        async with self._isr_lock:
            if self.isr_store.isr == [self.node]:
                return True
            if self.min_insync >= 2:
                return True  # keep the old member: writes wait for a standby instead
            ok = await self.isr_store.set_isr([self.node])
            if ok:
                self.stats["isr_shrinks"] += 1
                if self._may_lift_floor():
                    self.journal.set_replica_floor(None)
            return ok

    async def wait_standby_caught_up(self, lsn: int) -> bool:
        """Wait until the in-sync standby acknowledged ``lsn`` (a graceful hand-over);
        False when there is no in-sync standby."""
        while True:
            peer = self.peer
            if peer is None or peer.state != PeerState.IN_SYNC:
                return False
            if peer.acked >= lsn:
                return True
            await trio.sleep(0.005)


def _read_batch(it, nxt: int, upto: int) -> list[tuple[int, int, bytes]]:
    """Up to BATCH_BYTES of records ``nxt..upto`` from a journal iterator (a worker
    thread). The CRC is recomputed (the iterator checked it)."""
    from zlib import crc32

    out = []
    n = 0
    while nxt <= upto:
        try:
            lsn, payload = next(it)
        except StopIteration:
            break
        if lsn < nxt:
            continue
        if lsn != nxt:
            break
        payload = bytes(payload)
        out.append((lsn, crc32(payload, crc32(_Q.pack(lsn))), payload))
        n += len(payload) + 16
        nxt += 1
        if n >= BATCH_BYTES:
            break
    return out
