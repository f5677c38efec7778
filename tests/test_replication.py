"""Replication of a shard's journal to a synchronous standby, in one process: the
leader and the standby are two data dirs, the link a real TCP connection (through a
loopback proxy where a test cuts it), the in-sync set a fake of the etcd store.

Every test checks the invariant of the design (SCALE-OUT.md §5): the replicas hold the
same bytes at every LSN both have, and nothing acknowledged is missing on the one that
takes over."""

from __future__ import annotations

import msgspec
import pytest
import trio
import trio.testing

from rallypoint.client.api import Client
from rallypoint.client.embedded import EmbeddedTransport
from rallypoint.errors import UnavailableError
from rallypoint.node import recovered, serving
from rallypoint.persistence.journal import read_journal
from rallypoint.replication import (
    LinkClosed,
    Rebuild,
    ReplicationLeader,
    StaleLeader,
    install_snapshot,
    running_as_standby,
    take_over,
    truncate_after,
)
from rallypoint.replication.auth import LinkAuth
from rallypoint.testing.proxy import Proxy

pytestmark = pytest.mark.timeout(120)

SNAP = dict(snapshot_every_records=10**9, snapshot_every_s=10**6)
#: both ends of every link here prove the same cluster secret (tests/test_replication_auth.py: what a
#: peer without it gets)
AUTH = LinkAuth("test-cluster-secret", cluster="c", shard=0)
#: the node name of the leader listening on a port (a standby checks it is the one "etcd" names)
PORT_NODES: dict[int, str] = {}


class FakeIsr:
    """The in-sync set store: records every write in ``log`` (shared with the test)."""

    def __init__(self, isr, log):
        self.isr = list(isr)
        self.log = log
        self.fenced = False

    async def set_isr(self, isr):
        await trio.sleep(0)
        if self.fenced:
            return False
        self.isr = list(isr)
        self.log.append(("isr", tuple(isr)))
        return True


async def wait_until(pred, timeout=30.0, what="condition"):
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.005)


class Leader:
    """A data dir serving as the leader of ``epoch`` with replication on a free port."""

    def __init__(self, path, epoch, node="a", *, isr=None, log=None, min_insync=1, isr_timeout_s=0.5,
                 segment_bytes=64 << 20, ring_bytes=64 << 20):
        self.path = str(path)
        self.epoch = epoch
        self.node = node
        self.log = log if log is not None else []
        self.isr = isr or FakeIsr([node], self.log)
        self.min_insync = min_insync
        self.isr_timeout_s = isr_timeout_s
        self.segment_bytes = segment_bytes
        self.ring_bytes = ring_bytes

    async def run(self, clock_pair=None, *, task_status=trio.TASK_STATUS_IGNORED):
        async with recovered(self.path, "fsync", clock=None, interval_ms=10, sync_helper="thread",
                             segment_bytes=self.segment_bytes) as rec:
            await self.run_recovered(rec, clock_pair, task_status=task_status)

    async def run_recovered(self, rec, clock_pair=None, *, task_status=trio.TASK_STATUS_IGNORED):
        self.rec = rec
        gap = {}

        def before(coord):
            gap["ms"] = take_over(coord, epoch=self.epoch, node=self.node, clock_pair=clock_pair,
                                  default_gap_ms=rec.gap_ms)
            return gap["ms"]

        # the ring must see the epoch record: attach replication to the journal first
        self.repl = None

        def attach(coord):
            self.repl = ReplicationLeader(coord, epoch=self.epoch, node=self.node, cluster="c", shard=0,
                                          isr=self.isr, snapshot_store=rec.rec.store,
                                          isr_timeout_s=self.isr_timeout_s, min_insync=self.min_insync,
                                          ring_bytes=self.ring_bytes, auth=AUTH)
            self.repl.attach()
            return before(coord)  # the gap goes back to leases (as the member does)

        async with serving(rec, before_rearm=attach, **SNAP) as node:
            self.node_obj = node
            self.coord = node.coordinator
            node.snapshotter.hold_lsn = self.repl.hold_lsn
            self.client = Client(EmbeddedTransport(node.service))
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            self.port = listeners[0].socket.getsockname()[1]
            PORT_NODES[self.port] = self.node
            async with trio.open_nursery() as n:
                await n.start(self.repl.serve, listeners)
                task_status.started(self)
                await trio.sleep_forever()


async def follow(standby, port, epoch, *, leader=None, task_status=trio.TASK_STATUS_IGNORED):
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await standby.follow(stream, epoch, leader=leader or PORT_NODES.get(port, "a"), task_status=task_status)


async def follow_until_cut(standby, port, epoch):
    """Follow until the link is cut (a test that cuts it on purpose)."""
    try:
        await follow(standby, port, epoch)
    except LinkClosed:
        pass


def journal_bytes(path):
    return dict(read_journal(str(path)))


def entities(coord):
    enc = msgspec.msgpack.Encoder()
    out = {}
    for prefix, (table, _typ) in coord.entity_tables().items():
        for k, v in table.items():
            out[k] = enc.encode(v)
    return out


async def workload(rs, n=20):
    run = await rs.scopes.create(name="w")
    jobs = await rs.mailboxes.ensure("jobs")
    for i in range(n):
        await jobs.submit({"i": i}, scope=run)
    got = await jobs.receive(scope=run, max_messages=n // 2, lease_seconds=60, wait=0)
    for d in got:
        await d.complete({"ok": True})
    return run


async def test_a_standby_holds_the_same_bytes_and_state_and_acknowledgement_waits_for_it(tmp_path):
    log = []
    async with trio.open_nursery() as n:
        leader = await n.start(Leader(tmp_path / "a", epoch=10, log=log).run)
        await workload(leader.client)
        async with recovered(str(tmp_path / "b"), "fsync", clock=None, interval_ms=10, sync_helper="thread") as rb:
            async with running_as_standby(rb, node="b", cluster="c", shard=0, auth=AUTH, **SNAP) as sb:
                n.start_soon(follow, sb, leader.port, 10)
                await wait_until(lambda: leader.isr.isr == ["a", "b"], what="standby in sync")
                assert log == [("isr", ("a", "b"))]
                # from now on a reply waits for the standby's acknowledgement
                run = await workload(leader.client)
                journal = leader.coord.journal
                assert journal.durable_lsn <= leader.repl.peer.acked
                assert journal.replica_floor == leader.repl.peer.acked
                await wait_until(lambda: sb.applied_lsn == journal.last_lsn)
                # the standby applied every record: the same state, entity by entity
                assert entities(rb.coordinator) == entities(leader.coord)
                assert rb.coordinator.runs.table[run.id].state == "ACTIVE"
                assert rb.coordinator.epochs.current == 10
                n.cancel_scope.cancel()
    a, b = journal_bytes(tmp_path / "a"), journal_bytes(tmp_path / "b")
    assert set(a) <= set(b) or set(b) <= set(a)
    common = set(a) & set(b)
    assert len(common) > 40
    assert all(a[lsn] == b[lsn] for lsn in common)


async def test_a_silent_standby_leaves_the_isr_in_etcd_before_anything_is_acknowledged_without_it(tmp_path):
    log = []
    async with trio.open_nursery() as n:
        leader = await n.start(Leader(tmp_path / "a", epoch=10, log=log, isr_timeout_s=0.3).run)
        proxy = Proxy("127.0.0.1", leader.port)
        pport = await n.start(proxy.run)
        async with recovered(str(tmp_path / "b"), "fsync", clock=None, interval_ms=10, sync_helper="thread") as rb:
            async with running_as_standby(rb, node="b", cluster="c", shard=0, auth=AUTH, **SNAP) as sb:
                n.start_soon(follow_until_cut, sb, pport, 10)
                await wait_until(lambda: leader.isr.isr == ["a", "b"])
                rs = leader.client
                run = await rs.scopes.create(name="before-cut")
                proxy.set_mode("hold")
                # this write cannot be acknowledged until the standby is out of the ISR
                run2 = await rs.scopes.create(name="after-cut")
                log.append(("reply", "after-cut"))
                assert log == [("isr", ("a", "b")), ("isr", ("a",)), ("reply", "after-cut")]
                assert leader.coord.journal.replica_floor is None
                assert run.id != run2.id
                n.cancel_scope.cancel()


async def test_min_insync_2_refuses_writes_without_a_standby_and_resumes_when_it_is_back(tmp_path):
    log = []
    async with trio.open_nursery() as n:
        leader = await n.start(Leader(tmp_path / "a", epoch=10, log=log, min_insync=2, isr_timeout_s=0.3).run)
        rs = leader.client
        with pytest.raises(UnavailableError) as e:
            await rs.scopes.create(name="alone")
        assert "min-insync" in e.value.message
        async with recovered(str(tmp_path / "b"), "fsync", clock=None, interval_ms=10, sync_helper="thread") as rb:
            async with running_as_standby(rb, node="b", cluster="c", shard=0, auth=AUTH, **SNAP) as sb:
                proxy = Proxy("127.0.0.1", leader.port)
                pport = await n.start(proxy.run)
                n.start_soon(follow_until_cut, sb, pport, 10)
                await wait_until(lambda: leader.repl.peer is not None and leader.repl.peer.state == "in_sync")
                run = await rs.scopes.create(name="replicated")
                proxy.set_mode("hold")
                with trio.move_on_after(1.5) as waited:  # never acknowledged while the standby is cut off
                    await rs.scopes.create(name="held")
                assert waited.cancelled_caught
                # the ISR was not shrunk: the standby may still take over
                assert ("isr", ("a",)) not in log
                proxy.set_mode("reset")
                proxy.set_mode("pass")
                with pytest.raises(UnavailableError):
                    await rs.scopes.create(name="refused")
                n.start_soon(follow, sb, pport, 10)
                await wait_until(lambda: leader.repl.peer is not None and leader.repl.peer.state == "in_sync")
                again = await rs.scopes.create(name="again")
                assert again.id != run.id
                n.cancel_scope.cancel()


async def test_a_deposed_leader_truncates_what_it_wrote_past_its_epoch_and_rejoins(tmp_path):
    log = []
    a_path, b_path = tmp_path / "a", tmp_path / "b"
    # epoch 10: a leads, b follows; then b is cut off and a writes on alone
    async with trio.open_nursery() as n:
        leader = await n.start(Leader(a_path, epoch=10, log=log, isr_timeout_s=0.3).run)
        proxy = Proxy("127.0.0.1", leader.port)
        pport = await n.start(proxy.run)
        async with recovered(str(b_path), "fsync", clock=None, interval_ms=10, sync_helper="thread") as rb:
            async with running_as_standby(rb, node="b", cluster="c", shard=0, auth=AUTH, **SNAP) as sb:
                n.start_soon(follow_until_cut, sb, pport, 10)
                await wait_until(lambda: leader.isr.isr == ["a", "b"])
                await workload(leader.client, 6)
                await wait_until(lambda: sb.applied_lsn == leader.coord.journal.last_lsn)
                proxy.set_mode("hold")
                await leader.client.scopes.create(name="only-on-a")  # after the ISR shrink
                a_last = leader.coord.journal.last_lsn
                b_last = rb.coordinator.journal.last_lsn
                assert a_last > b_last
                n.cancel_scope.cancel()
    # epoch 12: b takes over (as etcd would let it once a's lease lapsed) and writes
    async with trio.open_nursery() as n:
        async with recovered(str(b_path), "fsync", clock=None, interval_ms=10, sync_helper="thread") as rb:
            b = Leader(b_path, epoch=12, node="b", log=log)
            await n.start(b.run_recovered, rb)
            await b.client.scopes.create(name="b-leads")
            # a comes back as a standby: it must cut what it wrote past epoch 10's end
            async with recovered(str(a_path), "fsync", clock=None, interval_ms=10, sync_helper="thread") as ra:
                async with running_as_standby(ra, node="a", cluster="c", shard=0, auth=AUTH, **SNAP) as sa:
                    with pytest.raises(Rebuild) as rb_exc:
                        await follow(sa, b.port, 12)
            assert rb_exc.value.truncate_to == b_last
            assert truncate_after(str(a_path), rb_exc.value.truncate_to) == a_last - b_last
            async with recovered(str(a_path), "fsync", clock=None, interval_ms=10, sync_helper="thread") as ra:
                assert ra.coordinator.journal.last_lsn == b_last
                assert not any(r.name == "only-on-a" for r in ra.coordinator.runs.table.values())
                async with running_as_standby(ra, node="a", cluster="c", shard=0, auth=AUTH, **SNAP) as sa:
                    n.start_soon(follow, sa, b.port, 12)
                    await wait_until(lambda: b.repl.peer is not None and b.repl.peer.state == "in_sync")
                    await b.client.scopes.create(name="replicated-again")
                    await wait_until(lambda: sa.applied_lsn == b.coord.journal.last_lsn)
                    assert entities(ra.coordinator) == entities(b.coord)
                    assert [e.epoch for e in ra.coordinator.epochs.entries] == [10, 12]
            n.cancel_scope.cancel()
    a, b_ = journal_bytes(a_path), journal_bytes(b_path)
    common = set(a) & set(b_)
    assert all(a[lsn] == b_[lsn] for lsn in common)


async def test_a_standby_too_far_behind_gets_a_snapshot_copy(tmp_path):
    log = []
    async with trio.open_nursery() as n:
        # a small ring and small segments: after the snapshot, the start of the journal
        # is neither in memory nor on disk
        leader = await n.start(Leader(tmp_path / "a", epoch=10, log=log, segment_bytes=4096, ring_bytes=2048).run)
        for _ in range(4):
            await workload(leader.client, 10)
        await leader.node_obj.snapshotter.snapshot()
        assert leader.coord.journal.oldest_lsn > 1  # the start of the journal is gone
        async with recovered(str(tmp_path / "b"), "fsync", clock=None, interval_ms=10, sync_helper="thread") as rb:
            async with running_as_standby(rb, node="b", cluster="c", shard=0, auth=AUTH, **SNAP) as sb:
                with pytest.raises(Rebuild) as exc:
                    await follow(sb, leader.port, 10)
        assert exc.value.snapshot_lsn == leader.node_obj.snapshotter.last_lsn
        install_snapshot(str(tmp_path / "b"), exc.value.snapshot_dir)
        async with recovered(str(tmp_path / "b"), "fsync", clock=None, interval_ms=10, sync_helper="thread") as rb:
            async with running_as_standby(rb, node="b", cluster="c", shard=0, auth=AUTH, **SNAP) as sb:
                n.start_soon(follow, sb, leader.port, 10)
                await wait_until(lambda: leader.isr.isr == ["a", "b"])
                await workload(leader.client, 4)
                await wait_until(lambda: sb.applied_lsn == leader.coord.journal.last_lsn)
                assert entities(rb.coordinator) == entities(leader.coord)
                n.cancel_scope.cancel()


async def test_a_standby_refuses_a_leader_of_an_older_epoch(tmp_path):
    async with trio.open_nursery() as n:
        leader = await n.start(Leader(tmp_path / "a", epoch=10).run)
        async with recovered(str(tmp_path / "b"), "fsync", clock=None, interval_ms=10, sync_helper="thread") as rb:
            async with running_as_standby(rb, node="b", cluster="c", shard=0, auth=AUTH, **SNAP) as sb:
                # etcd says the leader is at epoch 11: the peer at 10 is a deposed one
                with pytest.raises(StaleLeader):
                    await follow(sb, leader.port, 11)
                sb.epoch_seen = 14
                with pytest.raises(StaleLeader):
                    await follow(sb, leader.port, 10)
                assert rb.coordinator.journal.last_lsn == 0
        n.cancel_scope.cancel()


async def test_the_link_refuses_frames_that_do_not_check():
    from rallypoint.replication.standby import _check_frames
    from rallypoint.replication.leader import frame_records
    from zlib import crc32
    import struct

    def rec(lsn, payload):
        return (lsn, crc32(payload, crc32(struct.pack("<Q", lsn))), payload)

    good = frame_records([rec(5, b"abc"), rec(6, b"de")])
    assert _check_frames(good, 5, 2) == [b"abc", b"de"]
    bad = bytearray(good)
    bad[-1] ^= 0xFF
    with pytest.raises(LinkClosed):
        _check_frames(bytes(bad), 5, 2)
    with pytest.raises(LinkClosed):  # a gap
        _check_frames(frame_records([rec(5, b"abc"), rec(7, b"de")]), 5, 2)
    with pytest.raises(LinkClosed):  # fewer than announced
        _check_frames(good, 5, 3)


def test_the_record_ring_keeps_the_newest_records_and_takes_from_any_position():
    from rallypoint.replication import RecordRing

    ring = RecordRing(next_lsn=1, max_bytes=100)
    for lsn in range(1, 51):
        ring.tap(lsn, 0, b"x" * 10)
    # only the newest ~100 payload bytes are kept (at least one record)
    assert (ring.first_lsn, ring.last_lsn) == (41, 50) and ring.bytes == 100
    assert [r[0] for r in ring.take(41)] == list(range(41, 51))
    assert [r[0] for r in ring.take(48)] == [48, 49, 50]  # from the nearer (back) end
    assert [r[0] for r in ring.take(42, max_bytes=30)] == [42, 43]  # a batch is cut by size
    assert ring.take(51) == []
    big = RecordRing(next_lsn=7, max_bytes=10)
    big.tap(7, 0, b"y" * 500)  # one record larger than the ring is still kept
    assert [r[0] for r in big.take(7)] == [7]


class _SlowSend(trio.abc.HalfCloseableStream):
    """The leader's end of a replication connection whose ``send_all`` of a Frames
    message returns only after the peer answered something (``hold`` on): the bytes
    left, and the sending task is still inside ``send_all`` when the acknowledgement
    arrives (as under load, when the send's last checkpoint is slow to resume)."""

    def __init__(self, inner):
        self.inner = inner
        self.hold = False
        self.held = 0
        self._got = trio.Event()
        from rallypoint.replication import wire

        self._wire = wire
        self._decoder = msgspec.msgpack.Decoder(wire.LeaderMessage)

    async def send_all(self, data):
        frames = False
        if self.hold and len(data) > 4:
            try:
                frames = isinstance(self._decoder.decode(bytes(data[4:])), self._wire.Frames)
            except msgspec.DecodeError:
                frames = False
        if frames:
            self._got = trio.Event()
        await self.inner.send_all(data)
        if frames:
            self.held += 1
            await self._got.wait()  # the standby's acknowledgement was read meanwhile

    async def wait_send_all_might_not_block(self):
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None):
        data = await self.inner.receive_some(max_bytes)
        self._got.set()
        return data

    async def send_eof(self):
        await self.inner.send_eof()

    async def aclose(self):
        await self.inner.aclose()


async def test_an_acknowledgement_that_arrives_while_the_frames_are_still_being_sent_is_accepted(tmp_path):
    # found by tests/test_cluster_daemon.py: the leader counted frames as sent only
    # after send_all returned, so a standby that acknowledged them first was "past what
    # it was sent": the link closed and the standby left the in-sync set
    log = []
    ended = []
    async with trio.open_nursery() as n:
        leader = await n.start(Leader(tmp_path / "a", epoch=10, log=log).run)
        slow: list[_SlowSend] = []

        async def session(stream):
            s = _SlowSend(stream)
            slow.append(s)
            try:
                await leader.repl.session(s)
            except LinkClosed as e:
                ended.append(str(e))

        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        await n.start(trio.serve_listeners, session, listeners)
        async with recovered(str(tmp_path / "b"), "fsync", clock=None, interval_ms=10, sync_helper="thread") as rb:
            async with running_as_standby(rb, node="b", cluster="c", shard=0, auth=AUTH, **SNAP) as sb:
                n.start_soon(follow_until_cut, sb, port, 10)
                await wait_until(lambda: leader.isr.isr == ["a", "b"])
                slow[0].hold = True
                await workload(leader.client, 6)
                assert slow[0].held > 0
                assert ended == []
                assert log == [("isr", ("a", "b"))]  # never dropped from the in-sync set
                assert leader.repl.peer is not None and leader.repl.peer.state == "in_sync"
                n.cancel_scope.cancel()


async def test_a_link_lost_in_both_directions_at_once_is_one_link_closed():
    # found by tests/test_cluster_daemon.py: a leader's send to the standby and its read
    # of acknowledgements both failed on one reset; the two LinkClosed left the session
    # as an ExceptionGroup that nothing caught, and the node's process died
    from rallypoint.replication.link import unwrapped

    async def fail(exc):
        await trio.testing.wait_all_tasks_blocked()
        raise exc

    with pytest.raises(LinkClosed) as e:
        async with unwrapped(), trio.open_nursery() as n:
            n.start_soon(fail, LinkClosed("reset while sending"))
            n.start_soon(fail, LinkClosed("reset while receiving"))
    assert "reset while" in str(e.value)
    with pytest.raises(StaleLeader):  # the specific one wins
        async with unwrapped(), trio.open_nursery() as n:
            n.start_soon(fail, LinkClosed("closed"))
            n.start_soon(fail, StaleLeader("epoch 3 on a link of epoch 4"))
    with pytest.raises(BaseExceptionGroup):  # other errors stay a group
        async with unwrapped(), trio.open_nursery() as n:
            n.start_soon(fail, LinkClosed("closed"))
            n.start_soon(fail, ValueError("a bug"))


async def test_a_deposed_leader_keeps_its_floor_when_a_later_catching_up_session_ends(tmp_path):
    # split brain, found by the two-node simulator (rallypoint.testing.replsim): the
    # standby connected again, the leader's fenced shrink of the in-sync set failed (it
    # was deposed), and when that second, catching-up session ended the floor was lifted:
    # the deposed leader acknowledged writes that only it held, in an epoch no longer its
    from rallypoint.replication import wire

    log = []
    async with trio.open_nursery() as n:
        leader = await n.start(Leader(tmp_path / "a", epoch=10, log=log, isr_timeout_s=60).run)
        async with recovered(str(tmp_path / "b"), "fsync", clock=None, interval_ms=10, sync_helper="thread") as rb:
            async with running_as_standby(rb, node="b", cluster="c", shard=0, auth=AUTH, **SNAP) as sb:
                n.start_soon(follow_until_cut, sb, leader.port, 10)
                await wait_until(lambda: leader.isr.isr == ["a", "b"])
                await leader.client.scopes.create(name="replicated")
                await wait_until(lambda: sb.applied_lsn == leader.coord.journal.last_lsn)
                leader.isr.fenced = True  # etcd: the leader key of epoch 10 is gone
                # the standby's second connection (a reconnect) replaces the first
                last = rb.coordinator.journal.last_lsn
                link = await AUTH.connect(await trio.open_tcp_stream("127.0.0.1", leader.port), wire.Hello(
                    version=wire.LINK_VERSION, cluster="c", shard=0, node="b", last_lsn=last, last_epoch=10,
                    snapshot_lsn=0), leader="a", epoch=10)
                assert isinstance(await link.receive(), wire.Welcome)
                await wait_until(lambda: leader.repl.deposed)
                await link.aclose()  # the second session ends
                await wait_until(lambda: leader.repl.peer is None)
                assert leader.coord.journal.replica_floor is not None
                with trio.move_on_after(1.5) as waited:  # a deposed leader acknowledges nothing
                    await leader.client.scopes.create(name="split-brain")
                assert waited.cancelled_caught
                assert ("isr", ("a",)) not in log
                n.cancel_scope.cancel()


async def test_a_standby_ends_a_link_that_brings_nothing_and_can_follow_again(tmp_path):
    # a partition TCP does not notice (the proxy holds the bytes): without frames and
    # without heartbeats the standby ends the link, so it can connect again (before,
    # it waited on the dead connection for ever and never caught up)
    async with trio.open_nursery() as n:
        leader = await n.start(Leader(tmp_path / "a", epoch=10, isr_timeout_s=60).run)
        proxy = Proxy("127.0.0.1", leader.port)
        pport = await n.start(proxy.run)
        async with recovered(str(tmp_path / "b"), "fsync", clock=None, interval_ms=10, sync_helper="thread") as rb:
            async with running_as_standby(rb, node="b", cluster="c", shard=0, auth=AUTH, silence_s=0.5, **SNAP) as sb:
                ended = []

                async def follow_once():
                    try:
                        await follow(sb, pport, 10)
                    except LinkClosed as e:
                        ended.append(str(e))

                n.start_soon(follow_once)
                await wait_until(lambda: leader.isr.isr == ["a", "b"])
                proxy.set_mode("hold")
                await wait_until(lambda: ended, timeout=10)
                assert "nothing from the leader for 0.5 s" in ended[0]
                proxy.set_mode("reset")
                proxy.set_mode("pass")
                n.start_soon(follow_once)
                await leader.client.scopes.create(name="after")
                await wait_until(lambda: sb.applied_lsn == leader.coord.journal.last_lsn)
                n.cancel_scope.cancel()


async def test_a_promoted_standby_gives_the_time_without_a_leader_back_to_every_lease(tmp_path):
    # a standby's first start has no heartbeat of its own: the takeover extended leases
    # by that (nothing) instead of by the time since the old leader's last word
    a_path, b_path = tmp_path / "a", tmp_path / "b"
    async with recovered(str(b_path), "fsync", clock=None, interval_ms=10, sync_helper="thread") as rb:
        async with trio.open_nursery() as n:
            leader = await n.start(Leader(a_path, epoch=10).run)
            async with running_as_standby(rb, node="b", cluster="c", shard=0, auth=AUTH, **SNAP) as sb:
                n.start_soon(follow_until_cut, sb, leader.port, 10)
                await wait_until(lambda: leader.isr.isr == ["a", "b"])
                rs = leader.client
                run = await rs.scopes.create(name="leased")
                jobs = await rs.mailboxes.ensure("jobs")
                await jobs.submit({"i": 1}, scope=run)
                got = await jobs.receive(scope=run, max_messages=1, lease_seconds=30, wait=0)
                task_id = got.task_id
                expires = leader.coord.queues.tasks[task_id].lease_expires_ms
                await wait_until(lambda: sb.applied_lsn == leader.coord.journal.last_lsn)
                n.cancel_scope.cancel()  # the leader dies
                clock_pair = sb.clock_pair
        await trio.sleep(1.0)  # a second without a leader
        await rb.reopen_journal()
        async with trio.open_nursery() as n:
            b = await n.start(Leader(b_path, epoch=12, node="b").run_recovered, rb, clock_pair)
            t = b.coord.queues.tasks[task_id]
            assert t.state == "RUNNING"
            assert t.lease_expires_ms - expires >= 1000
            n.cancel_scope.cancel()


async def test_min_insync_2_holds_a_floor_at_takeover_until_a_standby_holds_the_new_term(tmp_path):
    # the in-sync set still names the old leader: what the new term writes (its epoch
    # record, extensions, activities) is not acknowledged -- no reply shows it -- until
    # a standby holds it; before, it counted as durable on the new leader alone
    log = []
    async with trio.open_nursery() as n:
        b = await n.start(Leader(tmp_path / "b", epoch=12, node="b", isr=FakeIsr(["a", "b"], log),
                                 min_insync=2, log=log).run)
        journal = b.coord.journal
        assert journal.last_lsn >= 1  # the epoch record
        assert journal.replica_floor == 0
        await wait_until(lambda: journal.local_durable_lsn == journal.last_lsn)  # fsynced here...
        assert journal.durable_lsn == 0  # ...and still not acknowledged
        async with recovered(str(tmp_path / "a"), "fsync", clock=None, interval_ms=10, sync_helper="thread") as ra:
            async with running_as_standby(ra, node="a", cluster="c", shard=0, auth=AUTH, **SNAP) as sa:
                n.start_soon(follow, sa, b.port, 12)
                await wait_until(lambda: b.repl.peer is not None and b.repl.peer.state == "in_sync")
                assert journal.durable_lsn == journal.last_lsn
                await b.client.scopes.create(name="replicated")
                n.cancel_scope.cancel()


async def test_a_takeover_with_min_insync_1_lifts_the_floor_once_the_isr_is_shrunk(tmp_path):
    log = []
    async with trio.open_nursery() as n:
        b = await n.start(Leader(tmp_path / "b", epoch=12, node="b", isr=FakeIsr(["a", "b"], log), log=log).run)
        journal = b.coord.journal
        assert journal.replica_floor == 0  # set at attach: the ISR names a
        assert await b.repl.shrink_isr_alone()
        assert log == [("isr", ("b",))]
        assert journal.replica_floor is None
        await b.client.scopes.create(name="alone")
        n.cancel_scope.cancel()


async def test_a_rejoining_node_truncates_to_the_last_epoch_both_histories_share(tmp_path):
    # KIP-279: b led epoch 11 (alone), a led 12 (alone, more records), b leads 13. a's
    # last epoch, 12, "ends" on b where 13 begins -- but b's records before that are
    # epoch 11's, not a's: a must cut back to where the shared history ends (nothing
    # here), or the two journals differ at the same LSNs
    a_path, b_path = tmp_path / "a", tmp_path / "b"

    async def lead(path, epoch, node, names):
        async with trio.open_nursery() as n:
            ldr = await n.start(Leader(path, epoch=epoch, node=node).run)
            for name in names:
                await ldr.client.scopes.create(name=name)
            last = ldr.coord.journal.last_lsn
            n.cancel_scope.cancel()
        return last

    b_11 = await lead(b_path, 11, "b", ["b11"])
    a_12 = await lead(a_path, 12, "a", ["a12-1", "a12-2", "a12-3", "a12-4"])
    assert a_12 > b_11
    async with trio.open_nursery() as n:
        b = await n.start(Leader(b_path, epoch=13, node="b").run)
        await b.client.scopes.create(name="b13")
        async with recovered(str(a_path), "fsync", clock=None, interval_ms=10, sync_helper="thread") as ra:
            async with running_as_standby(ra, node="a", cluster="c", shard=0, auth=AUTH, **SNAP) as sa:
                with pytest.raises(Rebuild) as rb_exc:
                    await follow(sa, b.port, 13)
        assert rb_exc.value.truncate_to == 0  # (the end of epoch 12 on b would be b_11)
        truncate_after(str(a_path), rb_exc.value.truncate_to)
        async with recovered(str(a_path), "fsync", clock=None, interval_ms=10, sync_helper="thread") as ra:
            async with running_as_standby(ra, node="a", cluster="c", shard=0, auth=AUTH, **SNAP) as sa:
                n.start_soon(follow, sa, b.port, 13)
                await wait_until(lambda: b.repl.peer is not None and b.repl.peer.state == "in_sync")
                await wait_until(lambda: sa.applied_lsn == b.coord.journal.last_lsn)
                assert entities(ra.coordinator) == entities(b.coord)
                assert [e.epoch for e in ra.coordinator.epochs.entries] == [11, 13]
        n.cancel_scope.cancel()
    a, b_ = journal_bytes(a_path), journal_bytes(b_path)
    assert set(a) == set(b_) and all(a[lsn] == b_[lsn] for lsn in a)


def test_the_shared_end_of_two_epoch_histories():
    from types import SimpleNamespace as NS

    from rallypoint.replication import wire

    def leader(entries, last):
        repl = ReplicationLeader.__new__(ReplicationLeader)
        repl.coord = NS(epochs=NS(entries=[NS(epoch=e, first_lsn=f) for e, f in entries],
                                  end_of=lambda ep: next((f - 1 for e, f in entries if e > ep), None)))
        repl.journal = NS(last_lsn=last)
        return repl

    def hello(epochs, last, last_epoch=None):
        return wire.Hello(version=1, cluster="c", shard=0, node="s", last_lsn=last,
                          last_epoch=last_epoch if last_epoch is not None else (epochs[-1][0] if epochs else 0),
                          snapshot_lsn=0, epochs=epochs)

    ldr = leader([(10, 1), (11, 40), (13, 46)], 80)
    assert ldr.shared_end(hello([(10, 1), (12, 40)], 60)) == 39  # diverged after epoch 10
    assert ldr.shared_end(hello([(10, 1), (11, 40)], 45)) == 45  # a prefix: nothing to cut
    assert ldr.shared_end(hello([(10, 1), (11, 40)], 50)) == 45  # epoch 11 ended at 45 here
    assert ldr.shared_end(hello([(10, 1), (11, 40), (13, 46)], 90)) == 80  # past the leader's end
    assert ldr.shared_end(hello([], 7)) == 0  # records before any epoch: not the leader's
    assert leader([], 5).shared_end(hello([], 3)) == 3
    # an older standby (no history sent): where its last epoch ends here
    assert ldr.shared_end(hello([], 60, last_epoch=12)) == 45


async def test_a_leader_whose_standby_holds_less_than_it_wrote_stops_cleanly(tmp_path):
    # found by the two-node simulator (seed 1): a leader under --min-insync 2 with no
    # standby in sync, stopped gracefully, waited in its final snapshot for the standby
    # to acknowledge what it wrote -- for ever
    log = []
    stop = trio.Event()

    async def lead(rec):
        def attach(coord):
            repl = ReplicationLeader(coord, epoch=12, node="b", cluster="c", shard=0, isr=FakeIsr(["a", "b"], log),
                                     min_insync=2, auth=AUTH)
            repl.attach()
            return take_over(coord, epoch=12, node="b", clock_pair=None, default_gap_ms=0)

        async with serving(rec, before_rearm=attach, **SNAP) as node:
            journal = node.coordinator.journal
            assert journal.replica_floor is not None and journal.durable_lsn < journal.last_lsn
            await stop.wait()

    async with recovered(str(tmp_path / "b"), "fsync", clock=None, interval_ms=10, sync_helper="thread") as rec:
        with trio.fail_after(10):
            async with trio.open_nursery() as n:
                n.start_soon(lead, rec)
                await trio.sleep(0.2)
                stop.set()  # a clean exit of the serving block
    async with recovered(str(tmp_path / "b"), "fsync", clock=None, interval_ms=10, sync_helper="thread") as rec:
        assert rec.coordinator.epochs.current == 12  # the journal holds it: replayed


async def test_a_standby_dropped_under_min_insync_2_has_its_connection_closed(tmp_path):
    # found by the two-node simulator (seed 113): under --min-insync 2 the drop of the
    # in-sync standby returned before closing its connection; the session went on
    # streaming to a standby that counted for nothing, which never connected again, and
    # writes were refused for ever
    async with trio.open_nursery() as n:
        leader = await n.start(Leader(tmp_path / "a", epoch=10, min_insync=2, isr_timeout_s=0.3).run)
        proxy = Proxy("127.0.0.1", leader.port)
        pport = await n.start(proxy.run)
        async with recovered(str(tmp_path / "b"), "fsync", clock=None, interval_ms=10, sync_helper="thread") as rb:
            async with running_as_standby(rb, node="b", cluster="c", shard=0, auth=AUTH, silence_s=30, **SNAP) as sb:
                ended = []

                async def follow_once():
                    try:
                        await follow(sb, pport, 10)
                    except LinkClosed as e:
                        ended.append(str(e))

                n.start_soon(follow_once)
                await wait_until(lambda: leader.repl.peer is not None and leader.repl.peer.state == "in_sync")
                proxy.set_mode("hold")

                acked = []

                async def held_write():
                    acked.append(await leader.client.scopes.create(name="held"))

                n.start_soon(held_write)
                await wait_until(lambda: leader.repl.peer is None)  # dropped (it stays in the ISR)
                proxy.set_mode("pass")
                await wait_until(lambda: ended, timeout=10)
                assert not acked  # under --min-insync 2 nothing is acknowledged without it
                n.start_soon(follow_once)  # it connects again, catches up, and the write is acknowledged
                await wait_until(lambda: acked, timeout=10)
                assert leader.repl.peer is not None and leader.repl.peer.state == "in_sync"
                assert len(acked) == 1
                n.cancel_scope.cancel()


async def test_a_standby_ends_the_link_when_a_beat_announces_records_it_never_got(tmp_path):
    # the leader beats only once it sent everything up to the beat's LSN: frames before
    # it were lost (the two-node simulator drops some), and with nothing more to send no
    # later frame would show the gap -- the standby waited for ever, never in sync
    from rallypoint.replication import Link, wire

    async with recovered(str(tmp_path / "b"), "fsync", clock=None, interval_ms=10, sync_helper="thread") as rb:
        async with running_as_standby(rb, node="b", cluster="c", shard=0, auth=AUTH, **SNAP) as sb:
            left, right = trio.testing.memory_stream_pair()

            async def leader():
                fake = (await AUTH.accept(right, node="a", epoch=10)).link
                await fake.send(wire.Welcome(epoch=10, leader="a", from_lsn=1))
                await fake.send(wire.Beat(epoch=10, last_lsn=0, mono_ms=1, wall_ms=1))  # nothing missing
                await fake.send(wire.Beat(epoch=10, last_lsn=5, mono_ms=2, wall_ms=2))  # 1..5 never came

            async with trio.open_nursery() as n:
                n.start_soon(leader)
                with pytest.raises(LinkClosed, match="frames were lost"):
                    with trio.fail_after(10):
                        await sb.follow(left, 10, leader="a")
