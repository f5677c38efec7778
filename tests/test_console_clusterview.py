"""The cluster console's own logic (rallypoint/console/clusterview.py) without a
cluster: the key table taken from etcd, the shards' state and the failovers it sees,
the merge of recent events, and the live stream's sink over the merge (its cursor, its
resume after a shard's subscription ends, its ``cluster`` messages, a revocation). The
same code on a real 3-shard cluster in Chromium: tests/test_console_cluster.py."""

from __future__ import annotations

import msgspec
import pytest
import trio

from rallypoint import protocol as p
from rallypoint.actors.keys import hash_secret
from rallypoint.cluster.keystore import KeyRecord
from rallypoint.cluster.leader import LeaderInfo, LeaderRecord
from rallypoint.console.clusterview import ClusterKeys, ClusterState, MergedSink, _ReopenCounting, merge_recent
from rallypoint.errors import UnauthenticatedError, UnavailableError

from test_shard_events_merge import FakeRouter


def key(kid: str, secret: str, *, space="default", revoked=None) -> KeyRecord:
    return KeyRecord(id=kid, space=space, permissions=["coordination_read"], secret_sha256=hash_secret(secret),
                     created_at_ms=1, name=kid, revoked_at_ms=revoked)


def leader(node: str, epoch: int) -> LeaderRecord:
    return LeaderRecord(info=LeaderInfo(node=node, client_address=f"{node}:1", replication_address=f"{node}:2"),
                        epoch=epoch, lease_id=1, mod_revision=epoch)


# ============================================================================ keys
async def test_the_key_table_from_etcd_authenticates_remembers_the_secret_and_revokes_for_good():
    keys = ClusterKeys()
    assert keys.open_mode and keys.authenticate(None) is None  # no key at all: open mode, as a shard
    keys.apply([key("key_a", "sa"), key("key_b", "sb", space="b")], [])
    assert not keys.open_mode
    k = keys.authenticate("sb")
    assert (k.id, k.space, k.permissions) == ("key_b", "b", ["coordination_read"])
    assert keys.secrets == {"key_b": "sb"}  # to make this login's calls under its own key
    for bad in (None, "", "nope"):
        with pytest.raises(UnauthenticatedError):
            keys.authenticate(bad)
    ev = keys.revoked("key_b")
    assert not ev.is_set() and not keys.is_revoked("key_b")
    keys.apply([key("key_b", "sb", space="b", revoked=5)], [])
    assert ev.is_set() and keys.is_revoked("key_b") and "key_b" not in keys.secrets
    with pytest.raises(UnauthenticatedError):
        keys.authenticate("sb")
    keys.apply([key("key_b", "sb", space="b")], ["key_a"])  # a live record again, a deletion: neither counts
    assert keys.is_revoked("key_b") and not keys.is_revoked("key_a")
    assert keys.revoked("key_b").is_set()
    assert keys.is_revoked("key_unknown")


# ============================================================================ the shards' state
async def test_the_state_sees_a_failover_as_the_leader_key_goes_then_a_standby_takes_it():
    st = ClusterState()
    assert st.apply(0, "leader", leader("n0a", 10)) is None  # the first read: no failover
    st.apply(1, "leader", leader("n1a", 11))
    st.seen = True
    assert st.apply(1, "leader", leader("n1a", 11)) is None  # the same leader read again
    gone = st.apply(1, "leader", None, now=100.0)
    assert (gone.old, gone.old_epoch, gone.new, gone.new_epoch) == ("n1a", 11, None, None)
    assert "n1a (epoch 11) is gone" in gone.text()
    took = st.apply(1, "leader", leader("n1b", 24), now=103.0)
    assert (took.old, took.old_epoch, took.new, took.new_epoch) == ("n1a", 11, "n1b", 24)  # from whom
    assert took.text() == "shard 1: n1a (epoch 11) → n1b (epoch 24)"
    assert st.failovers == [gone, took] and st.last_failover(1) is took and st.last_failover(0) is None
    assert st.leaders[1].info.node == "n1b"
    # a leader replaced at once (no gap): one failover
    again = st.apply(0, "leader", leader("n0b", 30), now=104.0)
    assert (again.old, again.new) == ("n0a", "n0b")


async def test_a_change_wakes_the_waiters():
    st = ClusterState()
    woke = []

    async def waiter():
        await st.wait_change()
        woke.append(True)

    async with trio.open_nursery() as n:
        n.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert not woke
        st.apply(2, "replicas", object())
    assert woke


# ============================================================================ recent events
def test_recent_events_of_several_shards_merge_by_instant_then_shard_then_seq():
    def e(shard, seq, at):
        return p.EventView(seq=seq, type="t", kind="k", id="i", at=at, shard=shard)

    got = merge_recent({0: [e(0, 1, "2026-01-01T00:00:01.000Z"), e(0, 2, "2026-01-01T00:00:03.000Z")],
                        1: [e(1, 7, "2026-01-01T00:00:02.000Z"), e(1, 8, "2026-01-01T00:00:03.000Z")]}, 3)
    assert [(x.shard, x.seq) for x in got] == [(1, 7), (0, 2), (1, 8)]
    assert merge_recent({0: [e(0, 1, "2026-01-01T00:00:01.000Z")]}, 0) == []


# ============================================================================ the stream's sink
class _Service:
    def __init__(self) -> None:
        self.state = ClusterState()


def _ids(raws: list[bytes]) -> list[tuple[int, int]]:
    out = []
    for r in raws:
        v = msgspec.msgpack.decode(r, type=p.EventView)
        out.append((v.shard, v.seq))
    return out


async def test_the_sink_returns_merged_events_with_the_vector_cursor_and_resumes_a_shard_exactly(autojump_clock):
    router = FakeRouter({0: [(1, 10), (2, 20)], 1: [(1, 15), (2, 25)]})
    w = _ReopenCounting(router, p.EventsWatch(start="now"), "0:2,1:2", 100)
    sink = MergedSink(w, _Service(), None)
    await w.open()
    assert router.opened == {0: [2], 1: [2]}
    for s in (0, 1):  # live from here: what the shards commit after the subscription
        router.logs[s] += [(q, 10 * q + 5 * s) for q in range(3, 9)]
    router.send(0, 4, frm=2)
    router.send(1, 4, frm=2)
    got = _ids(await sink.next_batch())
    assert got == [(0, 3), (1, 3), (0, 4), (1, 4)]  # merged by instant
    assert sink.cursor == "0:4,1:4"
    # shard 1's leader goes: its subscription ends; the next batch is taken after it is
    # opened again from its own position (at the new leader), and the resume is told
    router.subs[1][-1].end(UnavailableError("the leader went away"))
    router.send(0, 5, frm=4)
    assert _ids(await sink.next_batch()) == [(0, 5)]
    async with trio.open_nursery() as n:
        async def next_batch():
            n.got = _ids(await sink.next_batch())

        n.start_soon(next_batch)
        with trio.fail_after(5):
            while len(router.opened[1]) < 2:
                await trio.sleep(0.01)
        assert router.opened[1] == [2, 4]  # from its position: nothing missed
        router.send(1, 6, frm=3)  # the new leader sends one already seen again: not twice
    assert n.got == [(1, 5), (1, 6)]
    assert sink.resumes() == [(1, 4)] and sink.resumes() == []
    assert sink.cursor == "0:5,1:6"
    sink.close()
    assert all(subs[-1].closed for subs in router.subs.values())


async def test_the_sink_ends_at_once_when_the_key_is_revoked(autojump_clock):
    router = FakeRouter({0: [(1, 10)], 1: [(1, 20)]})
    revoked = trio.Event()
    w = _ReopenCounting(router, p.EventsWatch(start="now"), None, 100)
    sink = MergedSink(w, _Service(), revoked)
    await w.open()
    async with trio.open_nursery() as n:
        async def later():
            await trio.sleep(1)
            revoked.set()

        n.start_soon(later)
        with pytest.raises(UnauthenticatedError):
            await sink.next_batch()


async def test_a_cancelled_next_batch_loses_no_event_of_any_shard(autojump_clock):
    """The live page's stream takes what is buffered with ``move_on_after(0)`` around
    ``next_batch()``. CI saw the page miss one event of each shard that did not fail over:
    a cancelled call had taken events (from the shards' subscriptions, or from the merge)
    and dropped them, and the cursor had moved past them. Cancelled at every point of the
    wait, it takes nothing: every event comes out of the next calls, once, in order."""
    n_ev = MergedSink.MAX_BATCH + 100
    router = FakeRouter({0: [(1, 10)], 1: [(1, 20)]})
    w = _ReopenCounting(router, p.EventsWatch(start="now"), "0:1,1:1", 10_000)
    sink = MergedSink(w, _Service(), None)
    await w.open()
    for s in (0, 1):
        router.logs[s] += [(q, 10 * q + 5 * s) for q in range(2, n_ev + 2)]
    want = [(s, q) for s in (0, 1) for q in range(2, n_ev + 2)]
    got: list = []

    async def cancelled_call() -> None:  # what it returns, if it returns, counts too
        with trio.move_on_after(0):
            got.extend(_ids(await sink.next_batch()))

    # (1) one shard's batch arrives as a call is cancelled while the other has sent
    # nothing: nothing may be dropped (this is what CI saw: the merge's wait on both was
    # cancelled after shard 0's subscription had handed its batch over)
    router.send(0, n_ev + 1, frm=1)
    await cancelled_call()
    router.send(1, n_ev + 1, frm=1)
    await cancelled_call()
    if not got:
        got += _ids(await sink.next_batch())
    assert len(got) == MergedSink.MAX_BATCH  # (2) more than a batch is left in the merge ...
    await cancelled_call()  # ... and a cancelled call must not drop any of it
    while len(got) < len(want):
        got += _ids(await sink.next_batch())
        await cancelled_call()
    # once each (live, a shard that has sent nothing does not hold back another's: the
    # order across shards is arrival's), and each shard's in its own order
    assert len(got) == len(set(got)) and sorted(got) == sorted(want)
    for s in (0, 1):
        assert [q for t, q in got if t == s] == list(range(2, n_ev + 2))
    assert sink.cursor == f"0:{n_ev + 1},1:{n_ev + 1}"
    sink.close()


async def test_the_sink_refuses_at_once_once_revoked_even_with_events_waiting(autojump_clock):
    router = FakeRouter({0: [(1, 10)], 1: [(1, 20)]})
    revoked = trio.Event()
    w = _ReopenCounting(router, p.EventsWatch(start="now"), "0:1,1:1", 100)
    sink = MergedSink(w, _Service(), revoked)
    await w.open()
    router.logs[0] += [(2, 30), (3, 40)]
    router.send(0, 3, frm=1)
    assert _ids(await sink.next_batch()) == [(0, 2), (0, 3)]
    router.logs[0] += [(4, 50)]
    router.send(0, 4, frm=3)
    revoked.set()
    with pytest.raises(UnauthenticatedError):
        await sink.next_batch()


async def test_the_stream_is_told_of_each_failover_and_each_resume(autojump_clock):
    router = FakeRouter({0: [(1, 1)], 1: [(1, 1)]})
    svc = _Service()
    svc.state.apply(1, "leader", leader("n1a", 11))
    svc.state.seen = True
    w = _ReopenCounting(router, p.EventsWatch(start="now"), "0:1,1:1", 100)
    sink = MergedSink(w, svc, None)
    await w.open()
    router.logs[0] += [(2, 2), (3, 3)]
    sent: list = []

    async def emit(event, data, event_id=None):
        sent.append((event, data))

    async with trio.open_nursery() as n:
        n.start_soon(sink.watch_cluster, emit)
        await trio.testing.wait_all_tasks_blocked()
        svc.state.apply(1, "leader", None)
        svc.state.apply(1, "leader", leader("n1b", 24))
        router.subs[1][-1].end(UnavailableError("gone"))
        router.send(0, 2, frm=1)
        await sink.next_batch()  # shard 0's (shard 1's subscription ended meanwhile)

        async def more():
            await sink.next_batch()  # opens shard 1 again (then waits for events)

        n.start_soon(more)
        with trio.fail_after(5):
            while not any("resumed" in d for _e, d in sent):
                await trio.sleep(0.05)
        n.cancel_scope.cancel()
    texts = [d["text"] for e, d in sent if e == "cluster"]
    assert texts[0] == "shard 1: leader n1a (epoch 11) is gone; waiting for a standby to take over"
    assert texts[1] == "shard 1: n1a (epoch 11) → n1b (epoch 24)"
    assert texts[2].startswith("shard 1: the live stream resumed at n1b (epoch 24) after event 1:1")
