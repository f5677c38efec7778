"""The standby's side of replication: a coordinator in continuous recovery.

A standby is a node that recovered its data dir (snapshot + journal tail, as at any
start) and then keeps replaying: it connects to the shard's leader, receives its journal
records (the same frames, the same LSNs), checks them as recovery does (CRC, LSN
continuity, the leader's epoch), appends them to its own journal, acknowledges each LSN
once its journal made it durable, and applies them to its coordinator with the replay
path (``Coordinator.replay``: no actors, no activities, no replies). Taking over is then
"finish recovery": re-arm the activities, extend the leases by the gap, serve.

**The replica fence** (the safety of the whole design): a standby accepts frames only
from the leader it connected to, whose epoch (its etcd leader key's create revision)
it was told by etcd, and never from an epoch older than one it has seen. A deposed
leader therefore gets no acknowledgement, and so can acknowledge no write.

**When its files must change first** (:class:`Rebuild`): its journal goes past the end
of its last epoch (it led, was deposed, and wrote records no one acknowledged): it
truncates them (:func:`truncate_after`) and starts again; or the leader no longer has
the records it needs: it receives a copy of the leader's snapshot
(:func:`install_snapshot`) and starts again from it.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
from pathlib import Path

import trio

from ..persistence.journal import HEADER_SIZE, _validate, list_segments
from ..persistence.manifest import Manifest, try_write_manifest
from . import wire
from .auth import LinkAuth
from .link import Link, LinkClosed, StaleLeader, unwrapped

log = logging.getLogger("rallypoint.replication")

__all__ = ["Standby", "Rebuild", "truncate_after", "install_snapshot", "StaleLeader"]

_HDR = struct.Struct("<IIQ")


class Rebuild(Exception):
    """The standby must change its files before it can follow the leader: cut its
    journal after ``truncate_to``, or install the snapshot copy downloaded to
    ``snapshot_dir`` (valid at ``snapshot_lsn``)."""

    def __init__(self, *, truncate_to: int | None = None, snapshot_dir: str | None = None,
                 snapshot_lsn: int | None = None) -> None:
        self.truncate_to = truncate_to
        self.snapshot_dir = snapshot_dir
        self.snapshot_lsn = snapshot_lsn
        what = (f"truncate the journal after LSN {truncate_to}" if truncate_to is not None
                else f"install the leader's snapshot at LSN {snapshot_lsn}")
        super().__init__(what)


class Standby:
    """Follows the shard's leader into this node's coordinator and journal.

    Args:
        coordinator: the recovered coordinator (its ``journal`` running, nothing armed).
        node, cluster, shard: this node, what it tells the leader.
        snapshot_lsn: a callable returning the LSN of this node's snapshot.
        data_dir: where a downloaded snapshot copy is put (``<data_dir>/bootstrap``).
        silence_s: a link that brings nothing (no frames, no heartbeat: the leader beats
            every 0.1 s when idle) for this long, seconds, is ended (LinkClosed): a
            partition that TCP does not notice must not keep the standby on a dead
            connection, never reconnecting, after the leader dropped it.
        auth: how this standby and its leader prove themselves (:class:`~.auth.LinkAuth`);
            nothing is taken from a peer that did not prove itself.

    Attributes:
        clock_pair: the leader's latest ``(server time ms, wall ms)`` (None: none yet);
            a takeover continues the shard's server time from it.
        epoch_seen: the newest epoch this standby has followed or found in its journal.
        applied_lsn: the last LSN applied to the coordinator.
    """

    def __init__(self, coordinator, *, node: str, cluster: str, shard: int, snapshot_lsn, data_dir: str,
                 on_clock=None, silence_s: float = 2.0, auth: LinkAuth) -> None:
        self.coord = coordinator
        self.auth = auth
        self.silence_s = silence_s
        self.node = node
        self.cluster = cluster
        self.shard = shard
        self._snapshot_lsn = snapshot_lsn
        self.data_dir = data_dir
        self.on_clock = on_clock
        self.clock_pair: tuple[int, int] | None = None
        self.epoch_seen = coordinator.epochs.current
        self.applied_lsn = coordinator.journal.last_lsn
        self.leader: str | None = None
        self.following_epoch: int | None = None
        self.records = 0
        self._durable = trio.Event()
        coordinator.journal.add_durable_listener(self._on_durable)

    def close(self) -> None:
        self.coord.journal.remove_durable_listener(self._on_durable)

    def _on_durable(self, lsn: int, err) -> None:
        self._durable.set()

    async def follow(self, stream: trio.abc.Stream, epoch: int, *, leader: str,
                     task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Follow ``leader`` (the node etcd names), of ``epoch``, over ``stream`` (a
        connection to its replication address) until the connection ends (LinkClosed)
        or the caller cancels. The handshake authenticates both ends first
        (:meth:`LinkAuth.connect`). ``task_status.started()`` once it is done and frames
        flow.

        Raises:
            Rebuild: the files must change first (see the class docstring).
            LinkClosed: the connection ended (StaleLeader: a deposed leader's frames;
                Unauthenticated: the peer did not prove itself).
        """
        if epoch < self.epoch_seen:
            raise StaleLeader(f"epoch {epoch} is older than epoch {self.epoch_seen} this standby has seen")
        journal = self.coord.journal
        link = None
        try:
            last = journal.last_lsn
            link = await self.auth.connect(stream, wire.Hello(
                version=wire.LINK_VERSION, cluster=self.cluster, shard=self.shard, node=self.node, last_lsn=last,
                last_epoch=self.coord.epochs.epoch_of(last), snapshot_lsn=self._snapshot_lsn(),
                epochs=[(e.epoch, e.first_lsn) for e in self.coord.epochs.entries if e.first_lsn <= last]),
                leader=leader, epoch=epoch)
            welcome = None
            with trio.move_on_after(self.silence_s):  # (a lost Hello or Welcome: connect again)
                welcome = await link.receive()
            if welcome is None:
                raise LinkClosed(f"the leader did not answer the handshake within {self.silence_s:g} s")
            if isinstance(welcome, wire.Refuse):
                raise LinkClosed(f"the leader refused: {welcome.message}")
            if not isinstance(welcome, wire.Welcome):
                raise LinkClosed(f"expected Welcome, got {type(welcome).__name__}")
            if welcome.epoch != epoch:
                raise StaleLeader(f"the peer leads epoch {welcome.epoch}, etcd names epoch {epoch}")
            if welcome.truncate_to is not None:
                raise Rebuild(truncate_to=welcome.truncate_to)
            if welcome.snapshot:
                path, lsn = await self._download_snapshot(link)
                raise Rebuild(snapshot_dir=path, snapshot_lsn=lsn)
            if welcome.from_lsn != last + 1:
                raise LinkClosed(f"the leader starts at LSN {welcome.from_lsn}, this journal ends at {last}")
            self.epoch_seen = max(self.epoch_seen, epoch)
            self.leader = welcome.leader
            self.following_epoch = epoch
            log.info("replication: following %s (epoch %d) from LSN %d", welcome.leader, epoch, last + 1)
            task_status.started()
            async with unwrapped(), trio.open_nursery() as nursery:
                nursery.start_soon(self._send_acks, link)
                await self._receive(link, epoch)
        finally:
            self.following_epoch = None
            if link is not None:
                await link.aclose()
            else:
                with trio.CancelScope(shield=True):
                    try:
                        await stream.aclose()
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass

    async def _receive(self, link: Link, epoch: int) -> None:
        journal = self.coord.journal
        coord = self.coord
        while True:
            msg = None
            with trio.move_on_after(self.silence_s):
                msg = await link.receive()
            if msg is None:
                raise LinkClosed(f"nothing from the leader for {self.silence_s:g} s (no frames, no heartbeat)")
            t = type(msg)
            if t is wire.Frames:
                if msg.epoch != epoch or msg.epoch < self.epoch_seen:
                    raise StaleLeader(f"frames of epoch {msg.epoch} on a link of epoch {epoch}")
                expect = journal.last_lsn + 1
                if msg.first_lsn != expect:
                    raise LinkClosed(f"frames start at LSN {msg.first_lsn}, expected {expect}")
                payloads = _check_frames(msg.data, msg.first_lsn, msg.count)
                lsn = expect
                for payload in payloads:
                    got = journal.append(payload)
                    if got != lsn:  # cannot happen: the journal numbers consecutively
                        raise LinkClosed(f"internal: appended LSN {got}, expected {lsn}")
                    coord.replay(payload)
                    lsn += 1
                self.applied_lsn = lsn - 1
                self.records += len(payloads)
                journal.write_now()
                self._clock(msg.mono_ms, msg.wall_ms)
            elif t is wire.Beat:
                if msg.epoch != epoch:
                    raise StaleLeader(f"a beat of epoch {msg.epoch} on a link of epoch {epoch}")
                if msg.last_lsn > journal.last_lsn:
                    # the leader beats only once it sent everything up to last_lsn: the
                    # frames between were lost (and with nothing more to send, no later
                    # frame would show the gap); connect again from here
                    raise LinkClosed(f"a beat says the leader's journal ends at LSN {msg.last_lsn}; this one "
                                     f"ends at {journal.last_lsn}: frames were lost")
                self._clock(msg.mono_ms, msg.wall_ms)
            else:
                raise LinkClosed(f"unexpected {t.__name__} from the leader")

    def _clock(self, mono_ms: int, wall_ms: int) -> None:
        self.clock_pair = (mono_ms, wall_ms)
        if self.on_clock is not None:
            self.on_clock(mono_ms, wall_ms)

    async def _send_acks(self, link: Link) -> None:
        journal = self.coord.journal
        sent = 0
        while True:
            lsn = journal.durable_lsn
            if lsn > sent:
                await link.send(wire.Ack(lsn=lsn))
                sent = lsn
                continue
            self._durable = trio.Event()
            if journal.durable_lsn > sent:
                continue
            await self._durable.wait()

    async def _download_snapshot(self, link: Link) -> tuple[str, int]:
        dest = Path(self.data_dir) / "bootstrap"
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        path = dest / "data.mdb"
        lsn = None
        with open(path, "wb") as f:
            while True:
                msg = await link.receive()
                if not isinstance(msg, wire.SnapshotChunk):
                    raise LinkClosed(f"expected a snapshot piece, got {type(msg).__name__}")
                if lsn is None:
                    lsn = msg.lsn
                if msg.offset != f.tell() or msg.lsn != lsn:
                    raise LinkClosed("snapshot pieces out of order")
                await trio.to_thread.run_sync(f.write, msg.data)
                if msg.last:
                    break
            f.flush()
            os.fsync(f.fileno())
        log.info("replication: received the leader's snapshot at LSN %d (%d bytes)", lsn, path.stat().st_size)
        return str(dest), int(lsn or 0)


def _check_frames(data: bytes, first_lsn: int, count: int) -> list[bytes]:
    """The payloads of ``count`` frames from ``first_lsn``, checked as recovery checks
    a segment (CRC, consecutive LSNs, nothing after the last). Raises LinkClosed."""
    good_end, nxt, _start, problem, _definite = _validate(data, first_lsn, 0)
    if problem is not None or nxt != first_lsn + count or good_end != len(data):
        raise LinkClosed(f"replicated frames from LSN {first_lsn} do not check: {problem or 'wrong count'}")
    out = []
    off = 0
    mv = memoryview(data)
    for _ in range(count):
        n = _HDR.unpack_from(data, off)[0]
        out.append(bytes(mv[off + HEADER_SIZE: off + HEADER_SIZE + n]))
        off += HEADER_SIZE + n
    return out


def truncate_after(data_dir: str, lsn: int) -> int:
    """Cut the journal of a stopped node after ``lsn``: the segment holding ``lsn + 1``
    is truncated at that record, later segments are deleted, the manifest names the new
    last segment. Returns how many records were cut. (A rejoining replica's records past
    the end of its last epoch: no one acknowledged them.)

    Raises ValueError when ``lsn`` is below the journal's first record (the caller then
    installs a snapshot instead)."""
    segs = list_segments(data_dir)
    cut = 0
    keep_last: int | None = None
    for first, path in reversed(segs):
        if first > lsn + 1:
            cut += _count_records(path)
            path.unlink()
            continue
        data = path.read_bytes()
        off = 0
        while off + HEADER_SIZE <= len(data):
            n, _crc, rlsn = _HDR.unpack_from(data, off)
            if rlsn == 0:
                break  # preallocated zeros: the end of the records
            if rlsn == lsn + 1:
                cut += _count_from(data, off)
                with open(path, "r+b") as f:
                    f.truncate(off)
                    f.flush()
                    os.fsync(f.fileno())
                break
            off += HEADER_SIZE + n
        keep_last = first
        break
    if keep_last is None and segs:
        raise ValueError(f"the journal starts after LSN {lsn}: nothing to keep")
    jdir = Path(data_dir) / "journal"
    fd = os.open(jdir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if keep_last is not None:
        try_write_manifest(data_dir, Manifest(active_segment=keep_last))
    log.warning("replication: cut %d journal record(s) after LSN %d (written past the end of this node's last "
                "epoch; never acknowledged)", cut, lsn)
    return cut


def _count_records(path: Path) -> int:
    return _count_from(path.read_bytes(), 0)


def _count_from(data: bytes, off: int) -> int:
    n_rec = 0
    while off + HEADER_SIZE <= len(data):
        n, _crc, rlsn = _HDR.unpack_from(data, off)
        if rlsn == 0:
            break
        n_rec += 1
        off += HEADER_SIZE + n
    return n_rec


def install_snapshot(data_dir: str, snapshot_dir: str) -> None:
    """Replace a stopped node's snapshot and journal with a downloaded snapshot copy
    (``snapshot_dir/data.mdb``): the journal goes (the node continues from the
    snapshot's LSN + 1), the old snapshot is replaced."""
    d = Path(data_dir)
    jdir = d / "journal"
    if jdir.exists():
        shutil.rmtree(jdir)
    snap = d / "snapshot"
    old = d / "snapshot.old"
    if old.exists():
        shutil.rmtree(old)
    if snap.exists():
        snap.rename(old)
    snap.mkdir()
    os.replace(Path(snapshot_dir) / "data.mdb", snap / "data.mdb")
    shutil.rmtree(snapshot_dir, ignore_errors=True)
    if old.exists():
        shutil.rmtree(old)
    manifest = d / "JOURNAL_MANIFEST"
    if manifest.exists():
        manifest.unlink()  # the journal starts afresh at the snapshot's LSN + 1 on open
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
