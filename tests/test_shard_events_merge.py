"""The merge of several shards' events (rallypoint/client/shardevents.py), against a fake
router whose shards answer exactly when the test says: the vector cursor, the order
(per shard exact; across shards by instant then shard, exact while catching up on
history and within a page), per-shard resume, errors naming their shard. The same
code against a real 3-shard cluster: tests/test_cluster_shard_events.py."""

from __future__ import annotations

import msgspec
import pytest
import trio

from rallypoint import protocol as p
from rallypoint.client.shardevents import MergedWatch, format_cursor, list_events, parse_cursor
from rallypoint.clock import to_iso
from rallypoint.errors import CursorExpiredError, SlowConsumerError, UnavailableError, ValidationError


def ev(shard: int, seq: int, at_ms: int, type_: str = "task.submitted") -> bytes:
    return p.encoder.encode(p.EventView(seq=seq, type=type_, kind="task", id=f"t{shard}-{seq}", at=to_iso(at_ms),
                                        shard=shard))


class FakeSub:
    """A subscription whose batches the test feeds (``feed``) or ends (``end``)."""

    def __init__(self, start: p.WatchView) -> None:
        self.start = p.encoder.encode(start)
        self.scanned = None
        self._send, self._recv = trio.open_memory_channel(100)
        self.closed = False

    def feed(self, raws: list[bytes], scanned: int | None = None) -> None:
        self._send.send_nowait(("batch", raws, scanned))

    def end(self, error) -> None:
        self._send.send_nowait(("error", error, None))

    async def next_batch(self) -> list:
        # Like the real subscriptions (rallypoint/service.py, transport/connection.py): a
        # batch already buffered is returned without a checkpoint; only the wait is one.
        try:
            kind, value, scanned = self._recv.receive_nowait()
        except trio.WouldBlock:
            kind, value, scanned = await self._recv.receive()
        if kind == "error":
            raise value
        if scanned is not None:
            self.scanned = scanned
        return value

    def close(self) -> None:
        self.closed = True


class FakeMap:
    def __init__(self, shards) -> None:
        self.owners = list(shards)


class FakeRouter:
    """``event_shards`` / ``subscribe_shard`` / ``call_shard`` / ``shard_closed`` of a
    :class:`~rallypoint.client.router.ShardedTransport`, over shards whose history the
    test gives (``logs[shard]``: (seq, at_ms) pairs)."""

    def __init__(self, logs: dict[int, list[tuple[int, int]]]) -> None:
        self.logs = logs
        self.map = FakeMap(sorted(logs))
        self.subs: dict[int, list[FakeSub]] = {s: [] for s in logs}
        self.opened: dict[int, list] = {s: [] for s in logs}
        self.expired: dict[int, int] = {}  # shard -> oldest kept
        self.scan_limit: dict[int, int] = {}  # shard -> events a page examines at most (a filtered list's)
        self.unreachable: set[int] = set()

    def event_shards(self, op) -> list[int]:
        return sorted(self.logs)

    def shard_closed(self, shard: int) -> bool:
        return False

    def _newest(self, s: int) -> int:
        return self.logs[s][-1][0] if self.logs[s] else 0

    async def subscribe_shard(self, shard: int, op, max_events: int):
        await trio.lowlevel.checkpoint()
        if shard in self.unreachable:
            raise UnavailableError("reconnecting")
        if op.cursor is not None and shard in self.expired and op.cursor < self.expired[shard] - 1:
            raise CursorExpiredError(f"cursor {op.cursor} has expired", details={"cursor": op.cursor})
        cursor = op.cursor if op.cursor is not None else (self._newest(shard) if op.start == "now" else 0)
        self.opened[shard].append(cursor)
        sub = FakeSub(p.WatchView(cursor=cursor, oldest=1, newest=self._newest(shard)))
        self.subs[shard].append(sub)
        return sub

    async def call_shard(self, shard: int, op):
        await trio.lowlevel.checkpoint()
        if op.cursor is not None and shard in self.expired and op.cursor < self.expired[shard] - 1:
            raise CursorExpiredError(f"cursor {op.cursor} has expired", details={"cursor": op.cursor})
        after = op.cursor or 0
        rows = [(q, at) for q, at in self.logs[shard] if q > after]
        rows = rows[: min(op.limit, self.scan_limit.get(shard, op.limit))]
        nxt = rows[-1][0] if rows else after
        return p.encoder.encode(p.EventPageView(events=[msgspec.Raw(ev(shard, q, at)) for q, at in rows], next_cursor=nxt,
                                                oldest=1, newest=self._newest(shard)))

    def send(self, shard: int, upto: int, frm: int = 0, scanned: int | None = None) -> None:
        """Push shard's events ``frm < seq <= upto`` on its newest subscription."""
        rows = [(q, at) for q, at in self.logs[shard] if frm < q <= upto]
        self.subs[shard][-1].feed([ev(shard, q, at) for q, at in rows], scanned)


async def pull(w: MergedWatch, n: int) -> list:
    out = []
    with trio.fail_after(5):
        for _ in range(n):
            out.append(await w.next())
    return out


def test_the_vector_cursor_round_trips_and_refuses_what_is_not_one():
    assert format_cursor({2: 9, 0: 120, 1: 45}) == "0:120,1:45,2:9"
    assert parse_cursor("0:120,1:45,2:9", [0, 1, 2]) == {0: 120, 1: 45, 2: 9}
    assert parse_cursor("0:120", [0, 1, 2]) == {0: 120, 1: None, 2: None}  # a shard it does not name: oldest
    assert parse_cursor(None, [0, 1]) == {0: None, 1: None}
    assert parse_cursor(7, [2], [0, 1, 2]) == {2: 7}  # one shard (a run's): its seq will do
    assert parse_cursor("0:1,2:5", [2], [0, 1, 2]) == {2: 5}
    for bad in (7, "7", "0:1,0:2", "0:x", "a", "0:1;1:2", True, -1):
        with pytest.raises(ValidationError):
            parse_cursor(bad, [0, 1, 2])
    with pytest.raises(ValidationError) as e:
        parse_cursor("0:1,5:1", [0, 1, 2])
    assert e.value.details == {"field": "cursor", "shard": 5}


async def test_catching_up_merges_every_shard_by_instant_even_when_one_shard_sends_later():
    # shard 0's history at instants 10, 30, 50, 70; shard 1's at 20, 40, 60, 80
    router = FakeRouter({0: [(1, 10), (2, 30), (3, 50), (4, 70)], 1: [(1, 20), (2, 40), (3, 60), (4, 80)]})
    op = p.EventsWatch()
    w = MergedWatch(router, op, None, 100)
    await w.open()
    assert w.cursor == "0:0,1:0"
    # shard 1 sends all its history at once, shard 0 only its first two events so far:
    # nothing of shard 1 after shard 0's last received (instant 30) may go first
    router.send(1, 4)
    router.send(0, 2)
    first = await pull(w, 3)
    assert [(e.shard, e.seq) for e in first] == [(0, 1), (1, 1), (0, 2)]
    with trio.move_on_after(0.3):  # shard 0 is still catching up and has nothing pending: wait
        await w.next()
        pytest.fail("returned an event while a shard catching up had nothing to compare with")
    router.send(0, 4, frm=2)
    rest = await pull(w, 5)
    assert [(e.shard, e.seq) for e in rest] == [(1, 2), (0, 3), (1, 3), (0, 4), (1, 4)]
    assert w.cursor == "0:4,1:4"
    # live: no wait for an idle shard
    router.logs[1].append((5, 90))
    router.send(1, 5, frm=4)
    assert [(e.shard, e.seq) for e in await pull(w, 1)] == [(1, 5)]
    assert w.cursor == "0:4,1:5"


async def test_one_shards_subscription_ends_and_resumes_from_its_own_position():
    router = FakeRouter({0: [(1, 10), (2, 20)], 1: [(1, 15)], 2: []})
    w = MergedWatch(router, p.EventsWatch(), "0:0,1:0,2:0", 100)
    await w.open()
    router.send(0, 2)
    router.send(1, 1)
    assert [(e.shard, e.seq) for e in await pull(w, 3)] == [(0, 1), (1, 1), (0, 2)]
    # shard 1 drops (a failover); shard 0 is cut off as slow; both re-open from their own
    # position, shard 2 is left alone
    router.subs[1][-1].end(UnavailableError("connection lost"))
    router.subs[0][-1].end(SlowConsumerError("cut off", details={"cursor": 2}))
    router.logs[0].append((3, 30))
    router.logs[1].append((2, 35))
    with trio.fail_after(5):
        while len(router.subs[0]) < 2 or len(router.subs[1]) < 2:
            with trio.move_on_after(0.05):
                await w.next()
    assert router.opened[0] == [0, 2] and router.opened[1] == [0, 1] and router.opened[2] == [0]
    router.send(0, 3, frm=2)
    router.send(1, 2, frm=1)
    got = await pull(w, 2)
    assert [(e.shard, e.seq) for e in got] == [(0, 3), (1, 2)]
    assert w.cursor == "0:3,1:2,2:0" and w.resumed == 2


async def test_a_filtered_watch_moves_each_shards_position_past_what_it_skipped():
    router = FakeRouter({0: [(1, 10), (2, 20), (3, 30)], 1: [(1, 5)]})
    w = MergedWatch(router, p.EventsWatch(types=["task.failed"]), "0:0,1:1", 100)
    await w.open()
    router.send(0, 1, scanned=3)  # one match, the two after it skipped
    assert [(e.shard, e.seq) for e in await pull(w, 1)] == [(0, 1)]
    assert w.cursor == "0:3,1:1"


async def test_cursor_expired_on_one_shard_says_which():
    router = FakeRouter({0: [(5, 10)], 1: [(9, 20)]})
    router.expired[1] = 9
    w = MergedWatch(router, p.EventsWatch(), "0:4,1:2", 100)
    with pytest.raises(CursorExpiredError) as e:
        await w.open()
    assert e.value.details["shard"] == 1 and e.value.message.startswith("shard 1:")
    with pytest.raises(CursorExpiredError) as e:
        await list_events(router, p.EventsList(limit=10), "0:4,1:2")
    assert e.value.details == {"cursor": 2, "shard": 1}
    # mid-stream (retention passed it while it was reading): the same
    router.expired.clear()
    w = MergedWatch(router, p.EventsWatch(), "0:4,1:8", 100)
    await w.open()
    router.subs[0][-1].end(CursorExpiredError("fell behind", details={"cursor": 4}))
    with pytest.raises(CursorExpiredError) as e:
        await pull(w, 1)
    assert e.value.details["shard"] == 0


async def test_a_page_never_runs_past_a_shard_that_has_more():
    """A page holds the first ``limit`` events by (instant, shard, seq) of what the
    shards sent, never past the last of a shard that has more (so the next page starts
    no earlier than where this one ended)."""
    # shard 0: 6 events at instants 10..60; shard 1: 3 events at 5, 35, 100
    router = FakeRouter({0: [(i, 10 * i) for i in range(1, 7)], 1: [(1, 5), (2, 35), (3, 100)]})
    page = await list_events(router, p.EventsList(limit=3), None)
    # shard 0's page is full at instant 30: shard 1's 35 and 100 wait for the next page
    assert [(e.shard, e.seq) for e in page.events] == [(1, 1), (0, 1), (0, 2)]
    assert page.next_cursor == "0:2,1:1" and page.newest == "0:6,1:3"
    seen = list(page.events)
    cursor = page.next_cursor
    while True:
        page = await list_events(router, p.EventsList(limit=3), cursor)
        seen += page.events
        if page.next_cursor == cursor:
            break
        cursor = page.next_cursor
    assert [(e.shard, e.seq) for e in seen] == [(1, 1), (0, 1), (0, 2), (0, 3), (1, 2), (0, 4), (0, 5), (0, 6),
                                               (1, 3)]
    assert cursor == "0:6,1:3"
    # a shard whose page stopped short of its newest without filling it (a filtered
    # list scans at most 100,000 events a page) bounds the others the same way
    router.scan_limit[0] = 2
    page = await list_events(router, p.EventsList(limit=10), None)
    assert [(e.shard, e.seq) for e in page.events] == [(1, 1), (0, 1), (0, 2)]
    assert page.next_cursor == "0:2,1:1"
    # a shard none of whose events were taken keeps a pinned position (not "from oldest")
    page = await list_events(FakeRouter({0: [(i, i) for i in range(1, 5)], 1: [(1, 50)]}),
                             p.EventsList(limit=2), None)
    assert page.next_cursor == "0:2,1:0"


async def test_a_single_node_keeps_its_integer_cursor_and_its_events_name_no_shard():
    import rallypoint

    async with rallypoint.open_embedded() as rs:
        await rs.scopes.create(name="one")
        page = await rs.events.list()
        assert page.events and all(e.shard is None for e in page.events)
        assert isinstance(page.next_cursor, int)
        async with rs.events.watch() as stream:
            e = await stream.next(timeout=5)
            assert e.shard is None and stream.cursor == e.seq
        assert (await rs.events.list(cursor=str(page.next_cursor))).next_cursor == page.next_cursor
        with pytest.raises(ValidationError):
            await rs.events.list(cursor="0:1,1:2")
        with pytest.raises(ValidationError):
            rs.events.watch(cursor="0:1")


async def test_a_next_cancelled_after_a_shard_answered_keeps_that_shards_events():
    """``MergedWatch.next()`` waits on every shard at once; one answers (its subscription
    has handed over the batch and will not send it again) as the caller's deadline
    passes. The batch must be kept: the next call returns it. (It was dropped: the
    results were taken only after the task group, which the cancellation skipped.)"""
    router = FakeRouter({0: [(1, 10)], 1: [(1, 20)]})
    w = MergedWatch(router, p.EventsWatch(start="now"), "0:1,1:1", 100)
    await w.open()
    router.logs[0] += [(2, 30), (3, 40)]
    router.send(0, 3, frm=1)
    with trio.move_on_after(0) as scope:
        await w.next()
    assert scope.cancelled_caught
    got = await pull(w, 2)
    assert [(e.shard, e.seq) for e in got] == [(0, 2), (0, 3)]
    assert w.cursor == "0:3,1:1"
