"""Events and watch (issue 16, items 1-2): events derived from the journaled records, in
order with the right types; list and watch (server push) with filters; replay after a
restart gives the same events; a watcher resumes from its cursor across a SIGKILL and
sees every event exactly once; CURSOR_EXPIRED; a watcher that never reads is cut off
while the server goes on serving the others; the catalogue covers every record."""

from __future__ import annotations

import os
import re
import socket
import struct
import uuid

import msgspec
import pytest
import trio

import rallypoint
import rallypoint.client.embedded
from rallypoint import protocol as p
from rallypoint import wire
from rallypoint.actors import Coordinator
from rallypoint.errors import CursorExpiredError, SlowConsumerError, ValidationError
from rallypoint.events import CATALOGUE, SILENT_RECORDS
from rallypoint.records import ALL_RECORD_TYPES, IMPLIED_FACTS

from conftest import Daemon, until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def scenario(rs):
    """Tasks (complete, reject), a group that decides and cancels the rest, a child run
    with a join set (a task and a delay), a barrier and a timer; then the run is
    cancelled, which cancels everything below it in one step."""
    run = await rs.scopes.create(name="scenario")
    mbx = await rs.mailboxes.ensure("ev-" + uuid.uuid4().hex[:8])
    await mbx.submit({"n": 1}, scope=run, key="one")
    d = await mbx.receive(run, lease_seconds=30)
    await d.complete({"done": 1})
    await mbx.submit({"n": 2}, scope=run)
    d = await mbx.receive(run)
    await d.reject("nope")
    g = await run.groups.create(mbx, "N_ACCEPTED", threshold=1)
    await g.submit({"m": 1})
    await g.submit({"m": 2})
    d = await mbx.receive(g.scope_id)
    await d.complete({"ok": True})
    await g.accept(d.task_id)
    child = await run.child(name="kid")
    js = await child.join_sets.create("fan")
    await js.submit(mbx, {"c": 1})
    await js.submit_delay(3600)
    bar = await child.barriers.create(target=2)
    await bar.arrive("a")
    await child.timers.create(after_seconds=3600)
    await run.cancel(reason="enough")
    return run, g, child


EXPECTED = [
    "scope.created",
    "task.submitted", "task.delivered", "task.completed",
    "task.submitted", "task.delivered", "task.failed",
    "group.created", "scope.created",  # the group and its gate run
    "task.submitted", "group.member_joined", "task.submitted", "group.member_joined",
    "task.delivered", "task.completed", "group.verdict",
    "group.finalized", "scope.cancelled", "task.cancelled",  # one step: decided, gate cancelled, the rest cancelled
    "scope.created", "joinset.created", "task.submitted", "joinset.delay_submitted",
    "barrier.created", "barrier.arrived", "timer.created",
    # the cancel: the run first, then what its one step did below it, newest first
    "scope.cancelled", "timer.cancelled", "barrier.cancelled",
    "joinset.closing", "joinset.child_done", "task.cancelled", "joinset.child_done", "joinset.closed",
]


@pytest.mark.not_in_cluster("a whole space's events are not one gap-free sequence: each shard numbers its own "
                             "and the cursor is a vector (docs/events.md)")
async def test_a_scripted_scenario_comes_out_in_order_with_the_right_types(rs):
    before = (await rs.events.list(limit=1)).newest  # the daemon is shared: start after what is there
    run, g, child = await scenario(rs)
    page = await rs.events.list(cursor=before, scope=run, limit=1000)
    evs = page.events
    assert [e.type for e in evs] == EXPECTED
    seqs = [e.seq for e in evs]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs) and seqs[0] > before
    # aggregates, runs and payloads
    assert (evs[0].kind, evs[0].id, evs[0].run) == ("scope", run.id, run.id)
    assert evs[6].data == {"reason": "rejected", "attempt": 1}
    assert evs[16].kind == "group" and evs[16].id == g.id
    assert evs[16].data == {"outcome": "SUCCESS", "reason": "threshold_reached"}
    assert evs[17].id == g.scope_id and evs[17].data == {"reason": "group_finalized"}
    assert evs[26].id == run.id and evs[26].data == {"reason": "enough"}
    assert all(e.run == child.id for e in evs[27:])
    assert evs[-2].data["failure_kind"] == "cancelled" and evs[-3].type == "task.cancelled"
    assert all(e.at.tzinfo is not None for e in evs)
    # the whole space: a gap-free sequence; the mailbox's creation is in it (no run)
    everything = await rs.events.list(cursor=before, limit=10_000)
    assert [e.seq for e in everything.events] == list(range(before + 1, everything.events[-1].seq + 1))
    assert "mailbox.created" in [e.type for e in everything.events]


async def test_filters_types_prefix_aggregate_and_subtree(rs):
    before = (await rs.events.list(limit=1)).newest
    run, g, child = await scenario(rs)
    page = await rs.events.list(cursor=before, scope=run, types="group.*,scope.cancelled", limit=1000)
    assert [e.type for e in page.events] == ["group.created", "group.member_joined", "group.member_joined",
                                             "group.verdict", "group.finalized", "scope.cancelled",
                                             "scope.cancelled"]
    page = await rs.events.list(cursor=before, aggregate=g, limit=1000)
    assert {e.id for e in page.events} == {g.id}
    page = await rs.events.list(cursor=before, aggregate=f"scope:{child.id}", limit=1000)
    assert [e.type for e in page.events] == ["scope.created"]  # its end is its parent's: no event of its own
    page = await rs.events.list(cursor=before, scope=child, limit=1000)  # the subtree of the child only
    assert page.events[0].type == "scope.created" and page.events[0].id == child.id
    assert all(e.run == child.id for e in page.events)
    with pytest.raises(ValidationError):
        await rs.events.list(scope="not-a-run")


async def test_list_pages_with_next_cursor(rs):
    before = (await rs.events.list(limit=1)).newest
    run, _, _ = await scenario(rs)
    seen, cursor = [], before
    while True:
        page = await rs.events.list(cursor=cursor, limit=5, scope=run)
        seen += page.events
        if page.next_cursor == cursor:
            break
        cursor = page.next_cursor
    assert [e.type for e in seen] == EXPECTED


async def test_watch_pushes_events_as_they_happen(rs):
    run = await rs.scopes.create(name="watched")
    mbx = await rs.mailboxes.ensure("ev-watch")
    got: list = []
    async with trio.open_nursery() as n:
        async def watcher(task_status=trio.TASK_STATUS_IGNORED):
            async with rs.events.watch(scope=run, start="now") as stream:
                task_status.started()
                async for e in stream:
                    got.append(e)
                    if e.type == "scope.cancelled":
                        return

        await n.start(watcher)  # subscribed: entering the watch fixes "now"
        ticket = await mbx.submit({"x": 1}, scope=run)
        d = await mbx.receive(run)
        await d.complete(1)
        await run.cancel()
    assert [e.type for e in got] == ["task.submitted", "task.delivered", "task.completed", "scope.cancelled"]
    assert got[0].id == ticket.id


async def test_watch_from_a_cursor_then_live_without_a_gap(ers, autojump_clock):
    rs = ers
    run = await rs.scopes.create(name="catch-up")
    first = (await rs.events.list(scope=run)).events[0].seq
    mbx = await rs.mailboxes.ensure("m")
    await mbx.submit_many([{"i": i} for i in range(20)], scope=run)
    got = []
    async with rs.events.watch(cursor=first, scope=run) as stream:
        for _ in range(20):
            got.append(await stream.next(timeout=5))
        await mbx.submit({"late": 1}, scope=run)
        got.append(await stream.next(timeout=5))
    assert [e.type for e in got] == ["task.submitted"] * 21
    assert stream.cursor == got[-1].seq


async def test_replay_after_restart_gives_the_same_events(tmp_path):
    """Events are derived from the journal: a restart (with and without a snapshot)
    derives the same events, with the same sequence numbers."""
    data = str(tmp_path / "d")
    async with rallypoint.open_embedded(data) as rs:
        await scenario(rs)
        first = (await rs.events.list(limit=10_000)).events
        await rs.node.snapshotter.snapshot()  # part of it from the snapshot...
        run2, _, _ = await scenario(rs)  # ...the rest from the journal tail
        live = (await rs.events.list(limit=10_000)).events
        async def no_snapshot():
            return None

        rs.node.snapshotter.snapshot = no_snapshot  # no clean-shutdown snapshot: replay the tail
    assert len(live) > len(first) > 0
    async with rallypoint.open_embedded(data) as rs:
        replayed = (await rs.events.list(limit=10_000)).events
        assert rs.node.recovery_info["replayed"] > 0
        assert rs.node.recovery_info["snapshot_events"] == len(first)
    assert replayed == live


async def test_an_expired_cursor_is_cursor_expired():
    async with rallypoint.open_embedded(retain_events=10) as rs:
        run = await rs.scopes.create(name="many")
        mbx = await rs.mailboxes.ensure("m")
        await mbx.submit_many([{"i": i} for i in range(40)], scope=run)
        page = await rs.events.list()
        assert page.oldest > 1 and page.newest == 42
        with pytest.raises(CursorExpiredError) as ei:
            await rs.events.list(cursor=1)
        assert ei.value.details["oldest"] == page.oldest
        with pytest.raises(CursorExpiredError):
            async with rs.events.watch(cursor=1) as stream:
                await stream.next(timeout=5)
        # the oldest kept is still readable, from cursor=None or oldest - 1
        again = await rs.events.list(cursor=page.oldest - 1)
        assert again.events[0].seq == page.oldest == page.events[0].seq
        with pytest.raises(ValidationError):
            await rs.events.list(cursor=10_000)  # past the newest


async def test_an_expired_cursor_over_tcp_and_the_age_form(tmp_path):
    d = Daemon(None, "memory", ["--retain-events", "5"]).start()
    try:
        async with rallypoint.connect(d.url) as rs:
            run = await rs.scopes.create(name="x")
            for i in range(10):
                await run.child(name=f"c{i}")
            with pytest.raises(CursorExpiredError):
                await rs.events.list(cursor=0)
            with pytest.raises(CursorExpiredError):
                await rs.events.watch(cursor=0).next(timeout=5)
    finally:
        assert d.stop() == 0


async def test_a_watch_whose_buffer_fills_resumes_from_its_cursor(rs):
    """The client holds 8 events (over TCP: a buffer the connection's reader fills,
    ended and re-opened from the cursor when full; embedded: the server waits for
    room). Reading nothing while 60 happen, then reading on: every event once, in
    order."""
    run = await rs.scopes.create(name="slow")
    mbx = await rs.mailboxes.ensure("slow")
    async with rs.events.watch(scope=run, buffer=8, start="now") as stream:
        with pytest.raises(rallypoint.WaitTimeout):
            await stream.next(timeout=0.2)  # subscribed; nothing yet
        for i in range(60):
            await mbx.submit({"i": i}, scope=run)
        if not isinstance(rs._transport, rallypoint.client.embedded.EmbeddedTransport):
            # the connection's reader has taken more than the 8 and ended the subscription
            # (in a sharded cluster: the subscription to the run's shard)
            def subs():
                return [w.sub for w in stream._merged._shards] if stream._merged is not None else [stream._sub]

            await until(lambda: any(s is not None and s.error is not None for s in subs()))
        got = [await stream.next(timeout=5) for _ in range(60)]
    assert [e.type for e in got] == ["task.submitted"] * 60
    seqs = [e.seq for e in got]
    assert seqs == list(range(seqs[0], seqs[0] + 60))
    if isinstance(rs._transport, rallypoint.client.embedded.EmbeddedTransport):
        assert stream.resumed == 0  # flow control: the server waited for room
    else:
        assert stream.resumed >= 1  # the reader's buffer filled: ended, re-opened from the cursor


async def test_an_embedded_watch_that_stops_reading_is_cut_off_and_resumes(ers, autojump_clock):
    rs = ers
    run = await rs.scopes.create(name="stall")
    mbx = await rs.mailboxes.ensure("m")
    async with rs.events.watch(scope=run, buffer=8, start="now") as stream:
        with pytest.raises(rallypoint.WaitTimeout):
            await stream.next(timeout=0.1)
        for i in range(60):
            await mbx.submit({"i": i}, scope=run)
        await trio.sleep(30)  # longer than --watch-stall (10 s) without reading: cut off
        assert rs.node.coordinator.watchers.cut_off == 1
        got = [await stream.next(timeout=5) for _ in range(60)]
    seqs = [e.seq for e in got]
    assert seqs == list(range(seqs[0], seqs[0] + 60))
    assert stream.resumed == 1


def test_catalogue_covers_every_record_and_the_docs_list_it():
    coord = Coordinator()
    missing = [t.__name__ for t in (*ALL_RECORD_TYPES, *IMPLIED_FACTS)
               if t not in coord._emit and t.__name__ not in SILENT_RECORDS]
    assert not missing, f"record types with no event source (add an @emits method, or SILENT_RECORDS): {missing}"
    doc = open(os.path.join(ROOT, "docs", "events.md")).read()
    for name in CATALOGUE:
        assert f"`{name}`" in doc, f"docs/events.md does not list {name}"
    for name in re.findall(r"^\| `([a-z_]+\.[a-z_]+)` \|", doc, re.M):
        assert name in CATALOGUE, f"docs/events.md lists {name}, which is not in the catalogue"
    # issue 31 item 15: the docs say exactly what the catalogue says (kind, meaning, fields)
    for name, kind, meaning, fields in re.findall(r"^\| `([a-z_]+\.[a-z_]+)` \| ([^|]*) \| ([^|]*) \| ([^|]*) \|$",
                                                  doc, re.M):
        want = CATALOGUE[name]
        assert (kind.strip(), meaning.strip(), fields.strip()) == (want[0], want[1], want[2] or "-"), name
    for name, why in SILENT_RECORDS.items():
        assert f"- `{name}`: {why}." in doc, f"docs/events.md does not say why {name} makes no event"


def declared_fields(spec: str) -> set[str]:
    """The field names of a catalogue entry's fields text ("reason (a, b), attempt")."""
    parts, depth, cur = [], 0, ""
    for ch in spec:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    names = set()
    for part in parts:
        m = re.match(r"[a-z_]+", part.strip())
        if m:
            names.add(m.group(0))
    return names


async def test_every_emitted_type_is_in_the_catalogue(ers, autojump_clock):
    rs = ers
    await scenario(rs)
    run = await rs.scopes.create(name="more", deadline="2099-01-01T00:00:00Z")
    mbx = await rs.mailboxes.ensure("more")
    t = await rs.scopes.create(name="timers")
    tm = await t.timers.create(after_seconds=1)
    await tm.wait(timeout=5)
    await mbx.submit({"a": 1}, scope=run, deadline="2099-01-01T00:00:00Z")
    await mbx.submit({"b": 1}, scope=run)
    # issue 44: priority and fairness key on submit, delivery, a priority change; aging and weights
    await rs.mailboxes.ensure("more", aging_seconds=60, weights={"tenant-a": 2})
    tk = await mbx.submit({"c": 1}, scope=run, priority=1, fair_key="tenant-a")
    await tk.set_priority(2)
    d = await mbx.receive(run)
    await d.retry(delay=0)
    d = await mbx.receive(run, lease_seconds=5)
    await trio.sleep(10)  # the lease runs out: takeover
    b = await t.barriers.create(target=1)
    await b.arrive("x")
    await b.next_epoch()
    js = await t.join_sets.create()
    await js.submit_delay(1)
    await js.join_next(timeout=5)
    await js.close()
    await t.complete()
    events = (await rs.events.list(limit=10_000)).events
    types = {e.type for e in events}
    assert types <= set(CATALOGUE), types - set(CATALOGUE)
    for name in ("task.retried", "task.lease_expired", "timer.fired", "timer.acked", "barrier.released",
                 "barrier.next_epoch", "joinset.consumed", "scope.completed"):
        assert name in types
    # issue 31 item 15: an event carries only the fields its catalogue entry (and the docs) name
    seen: dict[str, set] = {}
    for e in events:
        extra = set(e.data or {}) - declared_fields(CATALOGUE[e.type][2])
        assert not extra, f"{e.type} carries {sorted(extra)}, which the catalogue does not list"
        seen.setdefault(e.type, set()).update(e.data or {})
    # ... and those whose fields are always there carry every one (the docs promised
    # joinset.consumed's `closing` and task.retried's `delay_ms`, which neither carried)
    for typ in ("joinset.consumed", "task.retried", "task.delivered", "task.lease_expired"):
        assert declared_fields(CATALOGUE[typ][2]) <= seen[typ], (typ, seen[typ])


async def test_the_blocking_client_watches(daemon):
    def body():
        with rallypoint.sync.connect(daemon.url) as rs:
            run = rs.scopes.create(name="sync-watch")
            with rs.events.watch(scope=run.id) as stream:
                first = next(iter(stream))
                run.cancel()
                second = stream.next(timeout=10)
            return first, second, run.id

    first, second, run_id = await trio.to_thread.run_sync(body)
    assert (first.type, first.id) == ("scope.created", run_id)
    assert (second.type, second.id) == ("scope.cancelled", run_id)


async def test_the_blocking_watch_subscribes_on_entering_its_block(daemon):
    # Issue 31 item 7: `with rs.events.watch(start="now")` subscribes when the block is
    # entered (as `async with` does), so an event caused inside the block -- before the
    # first next() -- is seen, and nothing from before the block is.
    def body():
        with rallypoint.sync.connect(daemon.url) as rs:
            before = rs.scopes.create(name="sync-before")
            with rs.events.watch(start="now", types="scope.*") as stream:
                inside = rs.scopes.create(name="sync-inside")
                got = stream.next(timeout=10)
            return before.id, inside.id, got

    before_id, inside_id, got = await trio.to_thread.run_sync(body)
    assert (got.type, got.id) == ("scope.created", inside_id), (got, before_id)


# ------------------------------------------------------------------ a daemon restart
async def test_a_watcher_resumes_after_a_sigkill_and_sees_every_event_exactly_once(tmp_path):
    data, port = str(tmp_path / "data"), free_port()
    args = (data, "fsync", ["--listen", f"127.0.0.1:{port}"])
    d = Daemon(*args).start()
    got: list = []
    try:
        async with rallypoint.connect(d.url, reconnect=rallypoint.Reconnect(timeout=30)) as watcher_rs:
            async with watcher_rs.events.watch() as stream, trio.open_nursery() as n:
                async def collect():
                    async for e in stream:
                        got.append(e)

                n.start_soon(collect)

                async def produce(tag: str, count: int):
                    async with rallypoint.connect(d.url, reconnect=False) as rs:
                        run = await rs.scopes.create(name=tag)
                        mbx = await rs.mailboxes.ensure("restart")
                        for i in range(count):
                            await mbx.submit({"i": i}, scope=run, key=f"{tag}-{i}")
                        return run

                await produce("before", 20)
                with trio.fail_after(10):
                    while len(got) < 22:
                        await trio.sleep(0.01)
                d.kill()  # SIGKILL
                d = Daemon(*args).start()
                await produce("after", 20)
                with trio.fail_after(20):
                    while not got or got[-1].type != "task.submitted" or len(got) < 42:
                        await trio.sleep(0.02)
                # one event more, then stop once it is read: an event delivered twice by
                # the resume would have come before it
                async with rallypoint.connect(d.url, reconnect=False) as rs:
                    last = await rs.scopes.create(name="last")
                await until(lambda: got[-1].id == last.id, timeout=20)
                n.cancel_scope.cancel()
            assert stream.resumed >= 1
        async with rallypoint.connect(d.url, reconnect=False) as rs:
            everything = (await rs.events.list(limit=10_000)).events
    finally:
        d.stop()
    seqs = [e.seq for e in got]
    assert len(seqs) == len(set(seqs)), "an event was delivered twice"
    assert seqs == list(range(1, len(seqs) + 1)), "an event was skipped"
    assert [(e.seq, e.type, e.id) for e in got] == [(e.seq, e.type, e.id) for e in everything]
    assert [e.data.get("key") for e in got if e.type == "task.submitted"] == (
        [f"before-{i}" for i in range(20)] + [f"after-{i}" for i in range(20)])


# ------------------------------------------------------------------ a watcher that never reads
def _frame(msg) -> bytes:
    body = msgspec.msgpack.encode(msg)
    return struct.pack(">I", len(body)) + body


def _stuck_watcher(url: str) -> socket.socket:
    """A raw client that subscribes to every event and then never reads its socket."""
    host, port = url.removeprefix("tcp://").rsplit(":", 1)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    s.sendall(_frame(wire.Hello(wire.PROTOCOL_VERSION, None, "stuck")))
    body = msgspec.msgpack.encode(p.EventsWatch(start="now"))
    s.sendall(_frame(wire.Request(7, msgspec.Raw(body))))
    return s


def _read_frames(s: socket.socket, timeout: float = 10.0) -> list:
    dec = msgspec.msgpack.Decoder(wire.ServerFrame)
    s.settimeout(timeout)
    buf = b""
    out = []
    while True:
        try:
            chunk = s.recv(1 << 20)
        except socket.timeout:
            break
        if not chunk:
            break
        buf += chunk
        while len(buf) >= 4 and len(buf) >= 4 + int.from_bytes(buf[:4], "big"):
            n = int.from_bytes(buf[:4], "big")
            out.append(dec.decode(buf[4:4 + n]))
            buf = buf[4 + n:]
        if out and isinstance(out[-1], wire.Err) and out[-1].id == 7:
            break
    return out


async def _lifecycles(url: str, count: int) -> int:
    """Submit/receive/complete ``count`` tasks in batches of 100; how many completed."""
    async with rallypoint.connect(url, reconnect=False) as rs:
        run = await rs.scopes.create(name="load")
        mbx = await rs.mailboxes.ensure("load")
        done = 0
        while done < count:
            await mbx.submit_many([{"i": i} for i in range(100)], scope=run)
            got = 0
            while got < 100:
                ds = await mbx.receive(run, max_messages=100)
                got += len(ds)
                await mbx.complete_many([(dd, 1) for dd in ds])
            done += 100
        await run.cancel()
        return done


async def test_a_watcher_that_never_reads_is_cut_off_and_does_not_hold_up_the_others():
    """A subscriber that never reads its socket fills its buffer and stalls; the server
    goes on serving everyone else meanwhile (the load below completes while the stuck
    watcher is still attached, well before the stall limit cuts it off), a healthy
    watcher sees every completion, and the stuck one is then cut off with
    SLOW_CONSUMER and a cursor to resume from. (What a stuck watcher costs the others in
    throughput is a figure: ``python scripts/bench_events.py --watcher stuck``.)"""
    stall_s = 8.0
    d = Daemon(None, "memory", ["--watch-stall", str(stall_s), "--watch-buffer-bytes", "65536"]).start()
    try:
        stuck = _stuck_watcher(d.url)
        healthy_seen = []
        async with rallypoint.connect(d.url) as rs, trio.open_nursery() as n:
            async def healthy():
                async with rs.events.watch(start="now", types="task.completed") as stream:
                    async for e in stream:
                        healthy_seen.append(e.seq)

            n.start_soon(healthy)
            while (await rs.overview()).events["watchers"] < 2:
                await trio.sleep(0.01)
            # A server that waited for the stuck socket would finish this only after the
            # cut-off: it must finish while the stuck watcher is still attached.
            done = await _lifecycles(d.url, 3000)
            ov = await rs.overview()
            assert ov.events["cut_off"] == 0 and ov.events["watchers"] == 2, ov.events
            newest = (await rs.events.list(limit=1)).newest
            with trio.fail_after(stall_s * 4):  # a liveness guard, not a timing claim
                while len(healthy_seen) < done:
                    await trio.sleep(0.01)
                while (await rs.overview()).events["cut_off"] < 1:
                    await trio.sleep(0.05)
            ov = await rs.overview()
            n.cancel_scope.cancel()
        assert ov.events["watchers"] == 1, ov.events  # the healthy one stays
        assert len(healthy_seen) == done  # it saw every completion, once
        frames = await trio.to_thread.run_sync(_read_frames, stuck)
        stuck.close()
        pushes = [f for f in frames if isinstance(f, wire.Push)]
        err = frames[-1]
        assert isinstance(err, wire.Err) and err.id == 7 and err.code == "SLOW_CONSUMER", err
        assert "resume with watch(cursor=" in err.message
        got = [msgspec.msgpack.decode(r, type=p.EventView).seq for f in pushes for r in f.events]
        assert got == list(range(got[0], got[0] + len(got)))  # what it got was in order, gap-free
        assert err.details["cursor"] == got[-1]
        assert got[-1] < newest  # it really was stuck: it did not get everything
        assert sum(len(r) for f in pushes for r in f.events) < 4 * 65536 + 300_000  # the buffer bounded it
    finally:
        assert d.stop() == 0


def test_slow_consumer_is_a_known_code():
    from rallypoint.errors import error_from_wire

    assert isinstance(error_from_wire("SLOW_CONSUMER", "x"), SlowConsumerError)


async def test_snapshots_keep_the_retained_events_in_chunks_and_drop_the_rest(tmp_path):
    """Events whose records left the journal come back from the snapshot: written in
    chunks as they accumulate, chunks below what is kept deleted."""
    from rallypoint.events import CHUNK, decode_chunk

    data = str(tmp_path / "d")
    async with rallypoint.open_embedded(data, retain_events=1000) as rs:
        run = await rs.scopes.create(name="many")
        mbx = await rs.mailboxes.ensure("m")
        for _ in range(3):
            for _ in range(10):
                await mbx.submit_many([{"i": i} for i in range(100)], scope=run)
            await rs.node.snapshotter.snapshot()
        newest = (await rs.events.list(limit=1)).newest
        store = rs.node.snapshotter.store
        kept = sum(len(decode_chunk(v)) for _, v in store.iter_events())
        assert 1000 <= kept <= 1000 + 1000 // 16 + CHUNK  # the count limit, trimmed in steps, chunk-aligned
    async with rallypoint.open_embedded(data, retain_events=1000) as rs:
        assert rs.node.recovery_info["replayed"] == 0  # everything from the snapshot
        page = await rs.events.list(limit=10_000)
        seqs = [e.seq for e in page.events]
        assert seqs[-1] == newest and seqs == list(range(seqs[0], newest + 1)) and len(seqs) >= 1000
        with pytest.raises(CursorExpiredError):
            await rs.events.list(cursor=seqs[0] - 2)


async def test_a_watch_from_now_starts_when_its_block_is_entered(rs):
    """``start="now"`` is the moment ``async with rs.events.watch(...)`` is entered (the
    subscription is made there), so what the caller does before its first iteration is
    seen -- it was made lazily at the first iteration, and the README's example lost its
    submit about one run in four over TCP."""
    run = await rs.scopes.create()
    m = await rs.mailboxes.ensure("watch-from-now")
    async with rs.events.watch(scope=run, start="now") as stream:
        t = await m.submit({"n": 1}, scope=run)  # before the first iteration
        ev = await stream.next(timeout=10)
    assert (ev.type, ev.id) == ("task.submitted", t.id)
